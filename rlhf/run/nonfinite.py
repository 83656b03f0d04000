"""A NaN or Inf in training: skip the step or stop (``train.on_nonfinite``), and never save anything non-finite."""

from __future__ import annotations

import logging

from rlhf.core.errors import UserError
from rlhf.core.train_state import TrainState
from rlhf.run.train_settings import TrainSettings

log = logging.getLogger(__name__)

CAUSES = ("Likely causes: a learning rate too high for this optimizer (optimizer.lr), no gradient clipping "
          "(train.max_grad_norm=null), float16 overflow (use bf16 or float32), or a bad data row.")


class NonFinite(UserError):
    """Training produced a NaN or Inf; nothing non-finite was saved."""


def skip_or_stop(state: TrainState, settings: TrainSettings, strategy, model, optimizer, grad_norm) -> None:
    """A non-finite loss or gradient on some process (``state.step`` is the step it happened in): drop the step on
    every process, or raise :class:`NonFinite` (``train.on_nonfinite=stop``, or too many in a row)."""
    state.nonfinite_steps += 1
    state.nonfinite_in_row += 1
    what = f"step {state.step}: the loss or the gradient norm ({grad_norm}) is not finite on at least one process"
    if settings.on_nonfinite == "stop":
        raise NonFinite(f"{what}; stopping (train.on_nonfinite=stop), nothing of this step saved. " + CAUSES)
    if state.nonfinite_in_row >= settings.max_nonfinite_in_row:
        raise NonFinite(f"{what}, {state.nonfinite_in_row} steps in a row (train.max_nonfinite_in_row="
                        f"{settings.max_nonfinite_in_row}); stopping, nothing of these steps saved. " + CAUSES)
    strategy.skip_step(model, optimizer)
    log.warning("%s: step skipped (%d in a row; the run stops at %d)", what, state.nonfinite_in_row,
                settings.max_nonfinite_in_row)
