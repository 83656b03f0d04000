"""What the sharded strategies (FSDP2, ZeRO) share: how many processes by default, counting what a process holds."""

from __future__ import annotations

import os

import torch

from rlhf.core.errors import UserError
from rlhf.hardware.base import DataParallel
from rlhf.hardware.holding import global_numel, local_numel

CPU_PROCESSES = 2  # processes on a machine without GPU when hardware.num_processes is null: the fewest that shard


def name_deepspeed_accelerator(cuda: bool) -> None:
    """Tell DeepSpeed, if it gets imported, which device this process uses. Accelerate imports it whenever it is
    installed (``unwrap_model``, hence every ``save_pretrained``); left to guess, it prints "Setting accelerator to
    CPU. If you have GPU ..." on every rank of a CPU run, and would pick the GPU for ``hardware.device=cpu``."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")


class Sharded(DataParallel):
    """Base of the strategies that split the model's state over processes."""

    compiles = False  # hardware.compile: per-block compilation after sharding is not built yet

    @classmethod
    def processes_without_gpu(cls, num_processes: int | None) -> int:
        """``num_processes``, else ``CPU_PROCESSES`` (on a machine with GPUs, null means one per local GPU)."""
        return num_processes if num_processes is not None else CPU_PROCESSES

    def holding(self, params, label: str) -> str:
        """'this process holds N of M <label> elements (P%)' for `params`."""
        params = list(params)
        here, whole = sum(local_numel(p) for p in params), sum(global_numel(p) for p in params)
        return f"this process holds {here:,} of {whole:,} {label} elements ({here / max(whole, 1):.0%})"

    def prepare_frozen(self, module: torch.nn.Module, name: str = "frozen") -> torch.nn.Module:
        if getattr(module, "rlhf_shared_layers", 0):  # rlhf.models.reference.SharedLayers
            raise UserError("algo/reference=shared_layers makes the reference use the policy's own layers, which this "
                            "hardware option shards: not supported. Fix: algo/reference=copy (or hardware=cpu_ddp/ddp).")
        return super().prepare_frozen(module, name)
