"""Numbers over every process: the one reduction helper, the training log window's means, and evaluation.

Each process sees its own shard of the batches, so every metric the run reports is a sum over the processes
before it is a mean. :func:`sum_over_processes` is the only place that sums: the log window, evaluation, the
step's non-finite and stop flags, a failed checkpoint, a non-finite parameter. Algorithms, which have no
accelerator, sum with :func:`sum_over_every_process` (whether a held-out reference pass is needed anywhere, KTO's
reference point, BCO's running mean).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from rlhf.state import read_at_once

if TYPE_CHECKING:
    from rlhf.state import TrainState


def sum_over_processes(values: Mapping[str, float | torch.Tensor], accelerator, *,
                       same_keys: bool = False) -> dict[str, float]:
    """Each value summed over every process, in one all-reduce of one float64 tensor.

    Processes may hold different keys (an algorithm may report a metric for some batches only): unless
    ``same_keys`` promises that every process passes the same keys, they first agree on the union (one small
    all-gather), and a key a process lacks counts 0 there. A collective: every process calls it."""
    keys = sorted(values)
    if accelerator.num_processes == 1:
        return {key: float(values[key]) for key in keys}
    if not same_keys:
        everyone: list[list[str] | None] = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(everyone, keys)
        keys = sorted(set().union(*everyone))
    packed = torch.tensor([float(values.get(key, 0.0)) for key in keys], dtype=torch.float64,
                          device=accelerator.device)
    return dict(zip(keys, accelerator.reduce(packed, reduction="sum").tolist()))


def processes() -> int:
    """The processes of torch.distributed's default group; 1 where none is initialized."""
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if available else 1


def sum_over_every_process(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed element-wise over every process of torch.distributed's default group, as a new tensor
    without gradient (one all-reduce, on ``values``' device: a GPU's for NCCL, the CPU's for gloo); ``values``
    itself on one process. For code that has no accelerator to hand (an algorithm's loss); a collective: every
    process calls it."""
    if processes() == 1:
        return values.detach()
    total = values.detach().clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total


def flag_on_any_process(flag: bool, device: torch.device | str) -> bool:
    """``flag`` OR-ed over every process of torch.distributed's default group (one all-reduce of one number on
    ``device``, where the backend wants it: a GPU's for NCCL); ``flag`` itself on one process. A collective: every
    process calls it. For code without an accelerator to hand (an algorithm's rollout or held-out cache)."""
    if processes() == 1:
        return flag
    return bool(sum_over_every_process(torch.tensor(float(flag), device=device)) > 0)


def max_over_processes(value: float, accelerator) -> float:
    """The largest of each process's ``value`` (one small all-gather). A collective: every process calls it."""
    if accelerator.num_processes == 1:
        return float(value)
    return float(accelerator.gather(torch.tensor([float(value)], device=accelerator.device)).max())


def any_process(flags: Mapping[str, bool], accelerator) -> dict[str, bool]:
    """Each flag OR-ed over every process (one small all-reduce)."""
    sums = sum_over_processes({key: float(flag) for key, flag in flags.items()}, accelerator, same_keys=True)
    return {key: value > 0 for key, value in sums.items()}


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
