"""Optimizers' parts: parameter groups, the schedule of a run of known length, the warmup schedules of
``conf/scheduler/*.yaml``, the values every optimizer and scheduler accepts, and which optimizers can skip a step on
the device. May import ``rlhf.core`` only.

- :mod:`~rlhf.optim.partition`: which tensors get which update rule and learning rate (``optimizer.partition``).
- :mod:`~rlhf.optim.rules`: one optimizer of several rules (Muon on the hidden matrices, AdamW on the rest).
- :mod:`~rlhf.optim.support`: the extra that installs each optimizer library, and the strategies each can run under.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from rlhf.core.limits import Range
from rlhf.optim.partition import DecayMatrices

log = logging.getLogger(__name__)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The default partition's groups (:class:`rlhf.optim.partition.DecayMatrices`): matrices with the optimizer's
    weight decay, biases, norms and 1-D tensors with ``weight_decay: 0``; frozen parameters left out."""
    return DecayMatrices()(model).groups()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can be told to skip the update by a flag on the device, so that the host need not
    read whether the step is finite: torch's Adam and AdamW with ``fused=True`` in every parameter group. Their
    ``step()`` passes the optimizer's ``found_inf`` attribute (a float32 tensor, set by torch's ``GradScaler``) to
    the fused kernel, which leaves parameters and moments unchanged where it is 1, and subtracts it from the step
    count it has just incremented (torch 2.13, ``torch/optim/adam.py``: ``_fused_adam``); where it is 0 the update
    is the one without a flag, bit for bit (tested). Other optimizers (Lion, bitsandbytes' 8-bit ones, SGD, Adam
    without the fused kernel) have no such flag: the host reads the verdict and skips the call."""
    return isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)


RUN_LENGTH_KEY = "run_length_fields"  # a parameter group's fields whose null means the run's length (AdEMAMix's warmups)


def set_run_length(optimizer: Any, total_steps: int) -> None:
    """Give every field that a parameter group lists under :data:`RUN_LENGTH_KEY` and holds as ``None`` the run's
    ``total_steps`` optimizer steps (AdEMAMix's ``t_alpha`` / ``t_beta3``: the paper's warmups last the run); nothing
    for other optimizers. On ``optimizer.param_groups``, so through any wrapper that exposes them; called when the
    schedule is built, before the first step. A resumed run's groups come back with the length it began with."""
    for group in optimizer.param_groups:
        for name in group.get(RUN_LENGTH_KEY, ()):
            if group.get(name) is None:
                group[name] = max(1, int(total_steps))


def schedule(make: functools.partial, optimizer: torch.optim.Optimizer, total_steps: int, warn: bool = True):
    """The learning-rate schedule a ``conf/scheduler`` option makes (a partial call) for a run of ``total_steps``
    optimizer steps. ``num_training_steps: null`` (cosine, linear) means the run's length: ``train.max_steps``, or
    what ``train.num_epochs`` makes of the data, known only once the data is loaded; so does an optimizer's field
    listed for it (:func:`set_run_length`). ``warn``: log a warmup as long as the run (:func:`warmup_warning`; the
    process that speaks for the run)."""
    set_run_length(optimizer, total_steps)
    line = warmup_warning(make.keywords.get("num_warmup_steps", 0), total_steps, optimizer)
    if line and warn:  # warn: the process that speaks for the run (every process builds the schedule)
        log.warning("%s", line)
    if make.keywords.get("num_training_steps", 0) is None:
        return make(optimizer, num_training_steps=total_steps)
    return make(optimizer)


def warmup_warning(num_warmup_steps: int, total_steps: int, optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """The start-up warning for a warmup as long as the run or longer: step k trains at lr x k / num_warmup_steps, so
    a run of ``total_steps`` <= ``num_warmup_steps`` ends below the peak it never reaches (not scaled here: the run
    keeps the schedule it was given). None for a warmup shorter than the run, or a run of no steps."""
    if not total_steps or not num_warmup_steps or num_warmup_steps < total_steps:
        return None
    peaks = [float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups] if optimizer is not None else []
    reached = "the learning rate rises for the whole run and never reaches its peak"
    if peaks:  # step k (from 0) trains at peak x k / num_warmup_steps
        reached += (f" optimizer.lr={max(peaks):g} (the last step trains at "
                    f"{max(peaks) * (total_steps - 1) / num_warmup_steps:.3g})")
    return (f"scheduler.num_warmup_steps={num_warmup_steps} is not shorter than the run's {total_steps} optimizer "
            f"step(s): {reached}. Fix: scheduler.num_warmup_steps={total_steps // 10} (or another count below "
            f"{total_steps}; TRL's default is 0), or a run longer than {num_warmup_steps} steps (train.max_steps)")


# --- schedules with a linear warmup ---------------------------------------------------------------------------
# The multipliers of the peak learning rate that Hugging Face's schedules apply (documented at
# huggingface.co/docs/transformers/main_classes/optimizer_schedules), computed in the same order of float
# operations, so a run's learning rates are the same to the last bit. Here rather than imported: importing
# transformers.optimization imports peft, bitsandbytes and torch's compiler, about 0.9 s of every run's start-up.
# Each is a LambdaLR of a functools.partial (a checkpoint's scheduler state holds no function).

def _warmup(step: int, num_warmup_steps: int) -> float:
    return float(step) / float(max(1.0, num_warmup_steps))


def _constant(step: int, *, num_warmup_steps: int) -> float:
    return _warmup(step, num_warmup_steps) if step < num_warmup_steps else 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def constant_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0, last_epoch: int = -1):
    """Linear warmup from 0 to the optimizer's lr over ``num_warmup_steps`` optimizer steps, then constant."""
    lr_lambda = functools.partial(_constant, num_warmup_steps=num_warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


def linear_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0, *, num_training_steps: int,
                       last_epoch: int = -1):
    """Linear warmup over ``num_warmup_steps``, then linear decay to 0 at ``num_training_steps``."""
    lr_lambda = functools.partial(_linear, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


def cosine_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0, *, num_training_steps: int,
                       num_cycles: float = 0.5, last_epoch: int = -1):
    """Linear warmup over ``num_warmup_steps``, then a cosine over ``num_cycles`` periods until
    ``num_training_steps`` (0.5: one decay from the peak to 0)."""
    lr_lambda = functools.partial(_cosine, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps,
                                  num_cycles=num_cycles)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


# --- allowed values ------------------------------------------------------------------------------------------
# conf/optimizer/*.yaml and conf/scheduler/*.yaml build third-party classes, whose arguments cannot carry
# rlhf.core.limits.limits. These limits apply, by argument name, to whichever class the `optimizer` / `scheduler`
# group builds (rlhf.config.checks.GROUP_LIMITS); an argument a class does not take is simply not there to check.
OPTIMIZER_LIMITS: dict[str, Range] = {
    "lr": Range(gt=0, meaning="peak learning rate", fix="1e-4"),
    "weight_decay": Range(ge=0, meaning="weight decay of the matrices; 0 turns it off", fix=0.01),
    "betas": Range(ge=0, lt=1, each=True, meaning="decay rates of the moment estimates", fix=[0.9, 0.999]),
    "eps": Range(gt=0, each=True, meaning="term added to the denominator for numerical stability", fix="1e-8"),
    "momentum": Range(ge=0, lt=1, meaning="heavy-ball momentum; 0 is plain SGD", fix=0.9),
}

SCHEDULER_LIMITS: dict[str, Range] = {
    "num_warmup_steps": Range(ge=0, integer=True, meaning="optimizer steps of linear warmup; 0 for none", fix=10),
    "num_training_steps": Range(ge=0, integer=True, meaning="optimizer steps until the learning rate reaches 0; "
                                "null for the run's length", fix="null", null="the run's length (rlhf.optim.schedule)"),
    "num_cycles": Range(gt=0, meaning="cosine periods over training; 0.5 decays once from peak to 0", fix=0.5),
    "step_size": Range(ge=1, integer=True, meaning="optimizer steps between two decays", fix=100),
    "gamma": Range(gt=0, le=1, meaning="factor the learning rate is multiplied by at each decay: every step for "
                   "exponential, every step_size steps for step", fix=0.995),
}
