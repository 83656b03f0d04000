"""Where a run is, and everything the loop carries from one step to the next (saved per rank in checkpoints)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch


def read_at_once(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """``values`` as Python floats in their order, the tensors among them read in one transfer per device (one wait
    for a GPU, not one per value; an online algorithm's reward metrics are CPU tensors beside the GPU's)."""
    by_device: dict[torch.device, list[str]] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(key)
    read: dict[str, float] = {}
    for keys in by_device.values():
        stacked = torch.stack([values[key].detach().to(torch.float64).reshape(()) for key in keys])
        read.update(zip(keys, stacked.tolist()))
    return {key: read[key] if key in read else float(value) for key, value in values.items()}


@dataclass
class TrainState:
    """Where the loop is, and everything it carries from step to step (saved per rank)."""

    step: int = 0  # optimizer steps done (skipped non-finite steps included)
    epoch: int = 0  # passes over the training split begun
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed by this process
    nonfinite_steps: int = 0  # steps skipped because the loss or gradient norm was not finite
    nonfinite_in_row: int = 0  # of which at the end, in a row
    # log window, this rank: each metric's sum (a float64 tensor on the device while training: read when logged)
    window_sums: dict[str, float | torch.Tensor] = field(default_factory=lambda: defaultdict(float))
    window_weights: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    window_steps: int = 0  # optimizer steps in the log window
    window_tokens: int | torch.Tensor = 0  # non-padding tokens this rank trained on in the log window (for perf/*)
    window_samples: int = 0  # examples this rank trained on in the log window (Algorithm.samples; for perf/*)
    last: dict[str, float] = field(default_factory=dict)  # the latest metrics of each key (summary.json)

    def new_window(self) -> None:
        """Start a new log window (after its metrics were written)."""
        self.window_sums.clear()
        self.window_weights.clear()
        self.window_steps, self.window_tokens, self.window_samples = 0, 0, 0

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers (what a checkpoint stores): the device's sums read here."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**data, "window_sums": read_at_once(self.window_sums), "window_weights": dict(self.window_weights),
                "window_tokens": int(self.window_tokens), "last": dict(self.last)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        state = cls(**data)
        state.window_sums = defaultdict(float, state.window_sums)
        state.window_weights = defaultdict(float, state.window_weights)
        return state
