"""The run's reported numbers: the training log window's means and the held-out evaluation, both over every
process.

Each process sees its own shard of the batches, so every metric the run reports is a sum over the processes before
it is a mean: both sum through :func:`rlhf.ops.collectives.sum_over_processes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from rlhf.core.train_state import read_at_once
from rlhf.ops.collectives import (  # noqa: F401  (the names rlhf.metrics, this module's old path, also had)
    any_process,
    flag_on_any_process,
    max_over_processes,
    processes,
    sum_over_every_process,
    sum_over_processes,
)

if TYPE_CHECKING:
    from rlhf.core.train_state import TrainState


def window_means(state: TrainState, prefix: str, accelerator) -> dict[str, float]:
    """The log window's metric means over every process: each metric's sum over its weight, both summed first (the
    sums, kept on the device through the window, read once here)."""
    sums = sum_over_processes({**{f"sum:{k}": v for k, v in read_at_once(state.window_sums).items()},
                               **{f"weight:{k}": v for k, v in state.window_weights.items()}}, accelerator)
    keys = sorted(key.removeprefix("sum:") for key in sums if key.startswith("sum:"))
    return {f"{prefix}{key}": sums[f"sum:{key}"] / sums[f"weight:{key}"] for key in keys
            if sums[f"weight:{key}"] > 0}


def evaluate(model, algo, loader, accelerator) -> dict[str, float]:
    """Mean of the algorithm's evaluation metrics over the held-out split (row-weighted, summed over processes).
    ``loader`` yields ``(batch, rows)``: see :func:`rlhf.data.loaders.eval_loader`. It leaves the random number
    generators as it found them (a loader's iterator draws a seed), so that training after it does not depend on
    when it ran: ``train.eval_every_steps`` may change on a resume without changing the training."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        return _evaluate(model, algo, loader, accelerator)


@torch.no_grad()
def _evaluate(model, algo, loader, accelerator) -> dict[str, float]:
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    rows_seen = 0.0
    for batch, rows in tqdm(loader, desc="evaluating", leave=False, disable=not accelerator.is_main_process):
        batch = send_to_device(batch, accelerator.device)
        for key, value in algo.evaluate(model, batch).items():
            sums[key] = sums.get(key, 0) + value.double() * rows
        rows_seen += rows
    model.train()
    totals = sum_over_processes({**sums, "_rows": rows_seen}, accelerator)
    return {f"eval/{key}": value / totals["_rows"] for key, value in totals.items() if key != "_rows"}
