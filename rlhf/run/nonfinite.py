"""A NaN or Inf in training: skip the step or stop (``train.on_nonfinite``), and never save anything non-finite.

Two ways to decide, chosen once per run (:func:`verdicts_for`):

- read every step (:func:`skip_or_stop`): the host reads whether the step is finite (with several processes, the
  flags' all-reduce), then steps or skips and counts, and stops at once where it must;
- kept on the device (:class:`Verdicts`): where the optimizer's step takes a skip flag on the device (torch's fused
  Adam/AdamW, :func:`rlhf.optim.skips_on_device`; one process), the update is left out there, the log window's sums
  leave the step's metrics out there, and the host reads the flags of the steps since the last reading when the log
  window is written or a checkpoint is about to be (:meth:`Verdicts.settle`): then the skipped steps are counted,
  and ``stop`` / ``max_nonfinite_in_row`` raise, naming the step. Nothing non-finite was applied in between.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.core.train_state import TrainState
from rlhf.optim import skips_on_device
from rlhf.run.train_settings import TrainSettings

log = logging.getLogger(__name__)

CAUSES = ("Likely causes: a learning rate too high for this optimizer (optimizer.lr), no gradient clipping "
          "(train.max_grad_norm=null), float16 overflow (use bf16 or float32), or a bad data row.")


class NonFinite(UserError):
    """Training produced a NaN or Inf; nothing non-finite was saved."""


def count(state: TrainState, settings: TrainSettings, step: int, grad_norm, when: str = "") -> None:
    """Count a non-finite step (``step``, on some process), or raise :class:`NonFinite` where the run must stop
    (``train.on_nonfinite=stop``, or ``train.max_nonfinite_in_row`` in a row); ``when``: where it was read, if
    later than the step."""
    state.nonfinite_steps += 1
    state.nonfinite_in_row += 1
    what = f"step {step}: the loss or the gradient norm ({grad_norm}) is not finite on at least one process{when}"
    if settings.on_nonfinite == "stop":
        raise NonFinite(f"{what}; stopping (train.on_nonfinite=stop), nothing of this step saved. " + CAUSES)
    if state.nonfinite_in_row >= settings.max_nonfinite_in_row:
        raise NonFinite(f"{what}, {state.nonfinite_in_row} steps in a row (train.max_nonfinite_in_row="
                        f"{settings.max_nonfinite_in_row}); stopping, nothing of these steps saved. " + CAUSES)
    log.warning("%s: step skipped (%d in a row; the run stops at %d)", what, state.nonfinite_in_row,
                settings.max_nonfinite_in_row)


def skip_or_stop(state: TrainState, settings: TrainSettings, strategy, model, optimizer, grad_norm) -> None:
    """A non-finite loss or gradient on some process, read at once (``state.step`` is the step it happened in):
    drop the step on every process, or raise :class:`NonFinite`."""
    count(state, settings, state.step, grad_norm)
    strategy.skip_step(model, optimizer)


@dataclass
class _Undecided:
    step: int
    bad: torch.Tensor  # bool, on the device
    norm: torch.Tensor | None  # the gradient norm, on the device
    weights: dict[str, float]  # what the step adds to the window's metric weights, if it was finite
    samples: int


class Verdicts:
    """The non-finite verdicts kept on the device: the steps since the last :meth:`settle`, in order."""

    def __init__(self) -> None:
        self._steps: list[_Undecided] = []

    def add(self, state: TrainState, bad: torch.Tensor, norm, sums: dict, weights: dict[str, float], tokens,
            samples: int) -> None:
        """Step ``state.step`` (already stepped with ``bad`` as its skip flag): its metric ``sums`` and ``tokens``
        go into the log window on the device, as 0 where ``bad`` (not multiplied: NaN x 0 is NaN); its ``weights``
        and ``samples`` once the verdict is read."""
        zero = torch.zeros((), dtype=torch.float64, device=bad.device)
        for key, value in sums.items():
            state.window_sums[key] += torch.where(bad, zero, value)
        state.window_tokens += torch.where(bad, 0, tokens) if isinstance(tokens, torch.Tensor) else tokens
        norm = torch.as_tensor(norm, device=bad.device) if norm is not None else None
        self._steps.append(_Undecided(state.step, bad, norm, dict(weights), samples))

    def settle(self, state: TrainState, settings: TrainSettings) -> None:
        """Read the verdicts of the steps since the last reading (one transfer) and count them in order, as
        :func:`skip_or_stop` would have at each step: a skipped one counted (or :class:`NonFinite`), a finite one's
        weights added to the log window."""
        if not self._steps:
            return
        steps, self._steps = self._steps, []
        nan = torch.full((), float("nan"), dtype=torch.float64, device=steps[0].bad.device)
        read = torch.stack([torch.stack([s.bad.to(torch.float64), nan if s.norm is None else s.norm.to(torch.float64)])
                            for s in steps]).tolist()
        for undecided, (bad, norm) in zip(steps, read):
            for key, weight in undecided.weights.items():  # weight 0: a window of skipped steps shows no mean
                state.window_weights[key] += 0.0 if bad else weight
            if bad:
                count(state, settings, undecided.step, norm, when=f" (read at step {state.step}: the verdict "
                      "was kept on the device, the update left out there)")
            else:
                state.nonfinite_in_row = 0
                state.window_samples += undecided.samples


def verdicts_for(settings: TrainSettings, strategy, optimizer) -> Verdicts | None:
    """:class:`Verdicts` where this run keeps the verdict on the device, else None (read every step):
    ``train.nonfinite_on_device`` true, or null where :data:`rlhf.core.auto_choices.CHOICES` says so for the device
    (not yet on a GPU: not measured there), where the strategy's step can pass a skip flag to the
    optimizer (:meth:`rlhf.hardware.DataParallel.skip_flag_reader`) and that optimizer reads it
    (:func:`rlhf.optim.skips_on_device`). Said in the log."""
    asked = settings.nonfinite_on_device
    if asked is None:  # unset: the table's choice for the device (rlhf/core/auto_choices.py)
        asked = auto_choices.pick("train.nonfinite_on_device", "cuda" if strategy.uses_cuda() else "cpu")
    if asked is False:
        return None
    reader = strategy.skip_flag_reader(optimizer)
    if reader is None or not skips_on_device(reader):
        log.info("non-finite steps: read every step (train.nonfinite_on_device=%s: %s)", str(asked).lower(),
                 "several processes or sharded state" if reader is None else
                 f"{type(reader).__name__} has no skip flag its step reads; torch's Adam/AdamW with fused=true have")
        return None
    log.info("non-finite steps: skipped on the device by %s's fused step; counted, and train.on_nonfinite=%s / "
             "train.max_nonfinite_in_row=%d act, at the next log window or checkpoint", type(reader).__name__,
             settings.on_nonfinite, settings.max_nonfinite_in_row)
    return Verdicts()
