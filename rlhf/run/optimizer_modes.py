"""Optimizers with a train and an eval mode, such as schedule-free AdamW: which weights the model holds when.

Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled", https://arxiv.org/abs/2405.15682; the
``schedulefree`` package, https://github.com/facebookresearch/schedule_free) keeps two points: the gradient is taken
at ``y`` (the model's parameters while training), and the point to evaluate, sample from and save is the average
``x``. ``optimizer.eval()`` writes ``x`` into the parameters and ``optimizer.train()`` writes ``y`` back (both from
the ``z`` sequence the optimizer keeps in its state). An optimizer "has modes" when its innermost object (below
Accelerate's ``AcceleratedOptimizer`` and DeepSpeed's wrappers, followed through their ``optimizer`` attribute) has
callable ``train`` and ``eval`` methods: detected by the methods, never by the optimizer's name. For any other
optimizer everything here does nothing.

- :func:`evaluation_weights`: a context manager around every evaluation, generation, rollout, checkpoint and final
  save (the loop's and :class:`rlhf.algos.online.Rollouts`'); the training weights come back when it exits.
- :func:`training_weights`: before the first step (and so after a resume: a checkpoint holds the evaluation
  weights, and the optimizer's state holds ``z``, from which ``train()`` rebuilds the training weights).
- :func:`check_reaches`: refuses a strategy whose optimizer holds copies of the parameters (DeepSpeed ZeRO's
  float32 partitions), where ``eval()`` would change the copies and never the model that is evaluated.
- :func:`schedule_free_adamw`: ``conf/optimizer/schedule_free_adamw.yaml``'s constructor: ``schedulefree``'s
  ``AdamWScheduleFree``, with a clear error where the optional extra is missing, its values' ranges, and built in
  train mode (so that the memory preflight's one probe step measures its state).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits

INSTALL = "pip install 'rlhf[optimizers]'  (or: pip install 'schedulefree>=1.4')"

log = logging.getLogger(__name__)


def innermost(optimizer: Any) -> Any:
    """The optimizer that holds the state, below the wrappers that keep it in their ``optimizer`` attribute
    (Accelerate's ``AcceleratedOptimizer``, DeepSpeed's ZeRO optimizer)."""
    seen = {id(optimizer)}
    while (inner := getattr(optimizer, "optimizer", None)) is not None and id(inner) not in seen:
        seen.add(id(inner))
        optimizer = inner
    return optimizer


def has_modes(optimizer: Any) -> bool:
    """Whether the optimizer (below its wrappers) has a train and an eval mode: callable ``train`` and ``eval``."""
    inner = innermost(optimizer)
    return callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None))


def training_weights(optimizer: Any) -> None:
    """Put the training weights (``y``) in the parameters, as the next step needs; nothing for other optimizers."""
    if has_modes(optimizer):
        innermost(optimizer).train()


@contextlib.contextmanager
def evaluation_weights(optimizer: Any) -> Iterator[None]:
    """Within the block the parameters hold the evaluation weights (``x``); on exit, even by an exception, the
    training weights again (``optimizer.train()``, what the next step needs). Nothing for other optimizers.
    Calls the innermost optimizer itself: a wrapper that does not pass ``eval()`` on (accelerate PR#4161,
    https://github.com/huggingface/accelerate/pull/4161) cannot leave the training weights in place."""
    if not has_modes(optimizer):
        yield
        return
    inner = innermost(optimizer)
    inner.eval()
    try:
        yield
    finally:
        inner.train()


def check_reaches(optimizer: Any, model: torch.nn.Module) -> None:
    """Refuse an optimizer with modes whose parameters are not the model's (DeepSpeed ZeRO keeps float32
    partitions of them): its ``eval()`` would write the evaluation weights into those copies, and the model would
    be evaluated and saved with its training weights, silently. Nothing for other optimizers."""
    if not has_modes(optimizer):
        return
    inner = innermost(optimizer)
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    trained = [p for p in model.parameters() if p.requires_grad]
    if trained and not all(id(p) in held for p in trained):
        raise UserError(
            f"optimizer {type(inner).__name__} has a train and an eval mode (schedule-free), but under this "
            "hardware= strategy it steps copies of the model's parameters (DeepSpeed ZeRO's float32 partitions), "
            "so its evaluation weights would never reach the model that is evaluated and saved. Fix: "
            "hardware=cpu, cpu_ddp, ddp or fsdp (which step the model's own parameters), or another optimizer")


@limits(lr=Range(gt=0, meaning="peak learning rate; schedule-free takes one ~1-10x AdamW's", fix=2.5e-3),
        betas=Range(ge=0, lt=1, each=True, meaning="decay rates of the moment estimates", fix=[0.9, 0.999]),
        eps=Range(gt=0, meaning="the denominator term", fix=1e-8),
        weight_decay=Range(ge=0, meaning="the L2 penalty, taken at y", fix=0.0),
        warmup_steps=Range(ge=0, integer=True, meaning="optimizer steps of the optimizer's own linear warmup",
                           fix=0),
        r=Range(ge=0, meaning="the power of the step count in the average's weights (0: uniform)", fix=0.0),
        weight_lr_power=Range(ge=0, meaning="the power of the learning rate in the average's weights", fix=2.0))
def schedule_free_adamw(params, lr: float = 2.5e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                        weight_decay: float = 0.0, warmup_steps: int = 0, r: float = 0.0,
                        weight_lr_power: float = 2.0, foreach: bool | None = None) -> torch.optim.Optimizer:
    """``schedulefree.AdamWScheduleFree(params, ...)`` (arguments as there), in train mode: a new optimizer's two
    points coincide, so this moves no weight, and a step may follow at once (the package's step refuses eval
    mode). ``foreach=None``: the package's default (its foreach kernels where torch has them)."""
    try:
        from schedulefree import AdamWScheduleFree
    except ImportError as error:
        raise UserError(f"optimizer=schedule_free_adamw needs the schedulefree package, an optional extra ({error})."
                        f" Fix: {INSTALL}") from None
    extra = {} if foreach is None else {"foreach": foreach}
    optimizer = AdamWScheduleFree(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                  warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power, **extra)
    optimizer.train()
    return optimizer


def decaying_schedule_warning(optimizer: Any, scheduler: Any, total_steps: int) -> str | None:
    """The start-up warning for an optimizer with modes under a schedule that lowers the learning rate during the
    run: schedule-free replaces the decay by its average (a warmup is fine: the package's own ``warmup_steps`` is
    the same multiplier). Read from the schedule's multipliers (``LambdaLR``, as ``conf/scheduler``'s warmup
    schedules are) or its ``gamma`` (``StepLR``, ``ExponentialLR``); None when it does not decay or for other
    optimizers."""
    if not has_modes(optimizer) or not total_steps:
        return None
    if hasattr(scheduler, "lr_lambdas"):
        decays = False
        for multiplier in scheduler.lr_lambdas:
            factors = [multiplier(step) for step in range(total_steps)]
            decays |= any(later < earlier for earlier, later in zip(factors, factors[1:]))
    else:
        decays = getattr(scheduler, "gamma", 1.0) < 1.0
    if not decays:
        return None
    return (f"optimizer {type(innermost(optimizer)).__name__} is schedule-free, but the scheduler "
            f"({type(scheduler).__name__}) lowers its learning rate during the run: a decay on top of the average "
            "that replaces it, not the method of Defazio et al. 2024. Fix: scheduler=constant (its num_warmup_steps "
            "or optimizer.warmup_steps give the warmup)")


def before_training(optimizer: Any, model: torch.nn.Module, scheduler: Any, total_steps: int, batches: Any,
                    warn: bool) -> None:
    """What the loop does once before its first step for an optimizer with modes (nothing for others): refuse one
    whose evaluation weights cannot reach the model (:func:`check_reaches`), put the training weights in (a resumed
    checkpoint holds the evaluation weights), warn of a decaying schedule (``warn``: on the main process), and let
    an online algorithm's rollouts (``batches.sampling_weights``) sample with the evaluation weights."""
    check_reaches(optimizer, model)
    training_weights(optimizer)
    if warn and (line := decaying_schedule_warning(optimizer, scheduler, total_steps)):
        log.warning("%s", line)
    if hasattr(batches, "sampling_weights"):
        batches.sampling_weights = lambda: evaluation_weights(optimizer)
