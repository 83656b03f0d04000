"""The ``train:`` block of the config as an object: its fields, their allowed values, and the accumulation they imply.

The block is written once, with its defaults and their comments, in ``conf/config.yaml``; this class gives it
types and limits. :func:`rlhf.config.checks.check_config` checks the block against both (``@limits`` below) before
anything is built, so constructing a :class:`TrainSettings` checks nothing again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits

NONFINITE_POLICIES = ("skip", "stop")  # train.on_nonfinite: drop a step whose loss or gradient is NaN/Inf, or stop
MEMORY_CHECKS = ("refuse", "warn", "off")  # train.memory_check: a run predicted not to fit stops, warns, or is not checked

# The top-level values of conf/config.yaml that no _target_ takes, checked by rlhf.config.checks.check_config.
TOP_LEVEL_LIMITS = {
    "seed": Range(ge=0, lt=2**32, integer=True, meaning="seeds Python, NumPy and torch", fix=0),
}


def _steps_or_epochs(values: Mapping[str, Any], where: str) -> None:
    """Exactly one of ``max_steps`` and ``num_epochs`` sets the run's length."""
    steps, epochs = values.get("max_steps"), values.get("num_epochs")
    if (steps is None) == (epochs is None):
        raise UserError(f"{where}.max_steps={steps} and {where}.num_epochs={epochs}: set exactly one of them. Fix: e.g. "
                        f"{where}.max_steps=null {where}.num_epochs=2 (epochs), or {where}.num_epochs=null (steps).")


def _known_policy(values: Mapping[str, Any], where: str) -> None:
    policy = values.get("on_nonfinite")
    if policy not in NONFINITE_POLICIES:
        raise UserError(f"{where}.on_nonfinite={policy!r} is not one of {list(NONFINITE_POLICIES)}. Fix: "
                        f"{where}.on_nonfinite=skip (skip the step) or stop (stop the run before anything of it is saved).")


def _known_memory_check(values: Mapping[str, Any], where: str) -> None:
    check = values.get("memory_check", "refuse")
    if check not in (*MEMORY_CHECKS, False):  # a bare off in a YAML file reads as false
        raise UserError(f"{where}.memory_check={check!r} is not one of {list(MEMORY_CHECKS)}. Fix: {where}.memory_check="
                        "refuse (stop before the first step when the prediction does not fit), warn, or off.")


def _count(meaning: str, fix: Any, low: int = 1) -> Range:
    return Range(ge=low, integer=True, meaning=meaning, fix=fix)


def _memory_needs_steps(values: Mapping[str, Any], where: str) -> None:
    if values.get("profile_memory") and not values.get("profile_steps"):
        raise UserError(f"{where}.profile_memory=true records the allocator over the profiled steps, but "
                        f"{where}.profile_steps={values.get('profile_steps')}. Fix: {where}.profile_steps=2 (or more)")


@limits(
    _steps_or_epochs,
    _known_policy,
    _memory_needs_steps,
    _known_memory_check,
    max_steps=_count("optimizer steps; 0 evaluates the starting model and stops", 300, low=0),
    num_epochs=_count("passes over the training split, instead of max_steps", 1),
    per_device_batch_size=_count("examples per process per micro-batch", 32),
    grad_accumulation_steps=_count("micro-batches per optimizer step", 1),
    global_batch_size=_count("examples per optimizer step over all processes", 64),
    max_grad_norm=Range(gt=0, meaning="the gradient norm is clipped to this; null for no clipping", fix=1.0),
    eval_every_steps=_count("optimizer steps between evaluations; 0 evaluates only at the end", 50, low=0),
    eval_batch_size=_count("examples per process per evaluation batch", 64),
    log_every_steps=_count("optimizer steps averaged into one line of training metrics", 10),
    save_every_steps=_count("optimizer steps between checkpoints; 0 off", 500, low=0),
    save_every_minutes=Range(ge=0, meaning="minutes of training between checkpoints; 0 off", fix=30),
    keep_last=_count("checkpoints kept; null keeps all", 2),
    max_nonfinite_in_row=_count("non-finite steps in a row before the run stops", 5),
    empty_cache_every_steps=_count("optimizer steps between freeing the device's cached memory; 0 never", 50, low=0),
    profile_steps=_count("optimizer steps recorded by torch.profiler after the first log window; 0 off", 5, low=0),
)
@dataclass(frozen=True)
class TrainSettings:
    """The ``train:`` block (see ``conf/config.yaml`` for what each field does and its default). Units are in the
    names: ``*_steps`` are optimizer steps, ``*_batch_size`` are examples (pairs for DPO).

    ``on_nonfinite``, ``max_nonfinite_in_row`` and ``nonfinite_on_device``: a step whose loss or gradient norm is NaN
    or Inf (on any process) is skipped, counted in ``train/nonfinite_steps``, or stops the run. Where the verdict
    is kept on the device (:mod:`rlhf.run.nonfinite`: ``nonfinite_on_device`` true, or null on a GPU; one process
    with torch's fused Adam/AdamW, ``conf/optimizer/adamw.yaml``), the optimizer's kernel leaves the step out there
    and the host reads the verdicts when the log window is written or a checkpoint is about to be: the step never
    waits for the device, and ``stop`` and ``max_nonfinite_in_row`` act then, at the next log window or save,
    naming the step (nothing non-finite was applied in between, and nothing is saved before they act). Elsewhere
    (other optimizers, several processes, DeepSpeed) every step reads its verdict and acts at once."""

    max_steps: int | None
    num_epochs: int | None
    per_device_batch_size: int
    grad_accumulation_steps: int | None
    global_batch_size: int | None
    max_grad_norm: float | None
    eval_every_steps: int
    eval_batch_size: int
    log_every_steps: int
    eval_at_start: bool
    save_final: bool
    save_every_minutes: float
    save_every_steps: int
    keep_last: int | None
    on_nonfinite: str
    max_nonfinite_in_row: int
    nonfinite_on_device: bool | None
    empty_cache_every_steps: int
    profile_steps: int
    profile_memory: bool
    memory_check: str

    def accumulation_steps(self, processes: int) -> int:
        """Micro-batches per optimizer step: set, or derived from ``global_batch_size`` for this many processes,
        so that a sweep over ``hardware=`` keeps the optimization identical."""
        if self.global_batch_size is None:
            return self.grad_accumulation_steps or 1
        per_step = self.per_device_batch_size * processes
        if self.global_batch_size % per_step:
            raise UserError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of per_device_batch_size x "
                f"processes = {self.per_device_batch_size} x {processes} = {per_step}. Fix: a multiple of {per_step}, "
                "or another train.per_device_batch_size.")
        derived = self.global_batch_size // per_step
        if self.grad_accumulation_steps is not None and self.grad_accumulation_steps != derived:
            raise UserError(
                f"train.grad_accumulation_steps={self.grad_accumulation_steps} disagrees with "
                f"train.global_batch_size={self.global_batch_size} = {self.per_device_batch_size} per device x "
                f"{processes} process(es) x {derived}. Fix: drop one of them (train.grad_accumulation_steps=null).")
        return derived

    def steps(self, micro_batches_per_epoch: int, accumulation: int) -> int:
        """The run's length in optimizer steps: ``max_steps``, or what ``num_epochs`` makes of the epoch's
        micro-batches (per process) at ``accumulation`` micro-batches per step."""
        if self.num_epochs is None:
            return self.max_steps
        steps = self.num_epochs * micro_batches_per_epoch // accumulation
        if steps < 1:
            raise UserError(f"train.num_epochs={self.num_epochs} is less than one optimizer step "
                            f"({micro_batches_per_epoch} micro-batch(es) per epoch per process, {accumulation} per "
                            "step). Fix: more epochs, or a smaller train.per_device_batch_size / accumulation.")
        return steps
