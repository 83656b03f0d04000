"""Every cross-process operation of the package: sums, flags, maxima and gathers over the processes of a run.

Each process sees its own shard of the batches, so what a run reports or decides from data is a sum (or a gather)
over the processes first. Nothing else in the package calls ``torch.distributed``'s or the accelerator's collectives
that move data (a test holds the package to it; the hardware strategies' sharding, which torch's FSDP2 and
DeepSpeed run themselves, and the accelerator's barriers, ``wait_for_everyone``, aside):

- with the accelerator to hand (the loop, evaluation, checkpoints): :func:`sum_over_processes` (one all-reduce of
  one float64 tensor; processes that hold different keys first agree on their union), :func:`any_process`,
  :func:`max_over_processes`;
- without one (an algorithm's loss or rollout, a reference's cache): :func:`processes`,
  :func:`sum_over_every_process`, :func:`flag_on_any_process`, :func:`gather_rows` (every process's rows, e.g.
  the rewards a group baseline needs) and :func:`gather_equal` (a small tensor from every process, stacked);
- the main process's tensor on every process: :func:`from_main_process` (a reference's precomputed cache).

Every function is a collective: every process calls it, in the same order. With one process each returns its input
(as a plain value) without touching ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


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


def gather_rows(values: Tensor, device: torch.device | str) -> tuple[Tensor, slice]:
    """Every process's ``values`` (equal shapes), concatenated in process order along the first dimension, and the
    slice of this process's rows in it: ``(values, slice(0, N))`` with one process. The all-gather runs on
    ``device`` (a GPU's for NCCL); the result comes back on ``values``' device."""
    if processes() == 1:
        return values, slice(0, values.shape[0])
    parts = gather_equal(values.to(device))
    rank, n = torch.distributed.get_rank(), values.shape[0]
    return torch.cat(parts).to(values.device), slice(rank * n, (rank + 1) * n)


def gather_equal(values: Tensor) -> list[Tensor]:
    """Every process's ``values`` (equal shapes, on the device the backend wants), in process order; ``[values]``
    with one process."""
    if processes() == 1:
        return [values]
    parts = [torch.empty_like(values) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, values.contiguous())
    return parts


def from_main_process(values: Tensor | None, accelerator) -> Tensor:
    """The main process's ``values`` (``None`` on the others) on every process, on the CPU (one all-reduce of the
    shape, one of the values: the other processes add zeros)."""
    if accelerator.num_processes == 1:
        return values
    shape = torch.tensor(list(values.shape) if values is not None else [0, 0], device=accelerator.device)
    shape = accelerator.reduce(shape, reduction="sum")
    mine = values.to(accelerator.device) if values is not None else torch.zeros(
        *shape.tolist(), dtype=torch.float32, device=accelerator.device)
    return accelerator.reduce(mine, reduction="sum").cpu()
