"""The ``train:`` block of the config as an object: its fields, their checks, and the accumulation they imply."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.errors import UserError

NONFINITE_POLICIES = ("skip", "stop")  # train.on_nonfinite: drop a step whose loss or gradient is NaN/Inf, or stop


@dataclass
class TrainSettings:
    """The ``train:`` block of the config: how long and in what batches to train, and how the run survives
    interruptions. Units are in the names."""

    max_steps: int | None = 300  # optimizer steps (0: evaluate the starting model and stop); or num_epochs
    num_epochs: int | None = None  # passes over the training split instead of max_steps (set one of the two)
    per_device_batch_size: int = 32  # examples (pairs for DPO) per process per micro-batch
    grad_accumulation_steps: int | None = None  # micro-batches per optimizer step (None: 1, or from global)
    global_batch_size: int | None = None  # examples per optimizer step over all processes (None: not fixed)
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; null disables clipping
    eval_every_steps: int = 50  # evaluate on the held-out split every N optimizer steps (0: only at the end)
    eval_batch_size: int = 64  # examples per process per evaluation batch
    log_every_steps: int = 10  # write averaged training metrics every N optimizer steps
    eval_at_start: bool = True  # evaluate before the first step, to show where training starts from
    save_final: bool = True  # save the trained model and tokenizer to <run dir>/final
    save_every_steps: int = 100  # write a checkpoint every N optimizer steps (0: only when stopped by a signal)
    keep_last: int | None = 2  # checkpoints kept (the oldest are removed after a new one is complete); null: all
    on_nonfinite: str = "skip"  # a step whose loss or gradient norm is NaN/Inf: "skip" it, or "stop" the run
    max_nonfinite_in_row: int = 5  # with on_nonfinite=skip: stop after this many non-finite steps in a row

    def __post_init__(self) -> None:
        for name in ("per_device_batch_size", "grad_accumulation_steps", "global_batch_size", "eval_batch_size",
                     "log_every_steps", "num_epochs", "keep_last", "max_nonfinite_in_row"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"train.{name}={getattr(self, name)} must be at least 1.")
        for name in ("max_steps", "eval_every_steps", "save_every_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UserError(f"train.{name}={getattr(self, name)} must be at least 0.")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise UserError(f"train.max_grad_norm={self.max_grad_norm} must be a finite number > 0, or null for no "
                            "clipping. Fix: e.g. train.max_grad_norm=1.0")
        if (self.max_steps is None) == (self.num_epochs is None):
            raise UserError(
                f"train.max_steps={self.max_steps} and train.num_epochs={self.num_epochs}: set exactly one of them. "
                "Fix: e.g. train.max_steps=null train.num_epochs=2 (epochs), or train.num_epochs=null (steps).")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise UserError(f"train.on_nonfinite={self.on_nonfinite!r} is not one of {list(NONFINITE_POLICIES)}. "
                            "Fix: train.on_nonfinite=skip (skip the step) or stop (stop the run at once).")

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
