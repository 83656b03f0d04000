"""Counting what one process holds of a model, however a strategy partitions it (whole, FSDP2 DTensors, ZeRO-3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this process stores for `tensor`: its own shard for a DTensor (FSDP2) or a ZeRO-3 parameter."""
    if hasattr(tensor, "ds_tensor"):  # DeepSpeed ZeRO-3 parameter: its partition, and the whole when it stays
        # gathered (ds_persist: fewer elements than stage3_param_persistence_threshold)
        return tensor.ds_tensor.numel() + (tensor.ds_numel if getattr(tensor, "ds_persist", False) else 0)
    if hasattr(tensor, "to_local"):  # DTensor
        return tensor.to_local().numel()
    return tensor.numel()


def global_numel(tensor: torch.Tensor) -> int:
    """Elements of the whole `tensor`, however it is partitioned (a DTensor reports its global shape)."""
    return getattr(tensor, "ds_numel", None) or tensor.numel()


@dataclass(frozen=True)
class StoredPrecision:
    """How a strategy stores the policy's state, where it differs from the model as loaded (the memory preflight):
    ``weight_bytes`` per parameter (None: as loaded), ``master_bytes`` per trainable parameter of a float32 master
    copy, and the dtype of the optimizer's states (None: the parameters')."""

    weight_bytes: int | None = None
    master_bytes: int = 0
    optimizer_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class FrozenHolding:
    """What one process holds of a frozen model (:meth:`DataParallel.prepare_frozen`): its parameter elements
    here and in the whole model, and the bytes of those here."""

    local_elements: int
    total_elements: int
    local_bytes: int

    @property
    def share(self) -> float:
        return self.local_elements / max(self.total_elements, 1)

    def __str__(self) -> str:
        return (f"this process holds {self.local_elements:,} of {self.total_elements:,} frozen parameter elements "
                f"({self.share:.0%}), {self.local_bytes:,} bytes")


def linear_weights_to_bf16(module: torch.nn.Module) -> int:
    """Store the float32 weights and biases of ``module``'s linear layers in bf16, for a frozen model whose
    forward runs under bf16 autocast. Autocast runs every ``linear`` in bf16 on a CPU and on CUDA, casting float32
    weights on each call; stored in bf16 they are the same values, so the outputs are the same bit for bit, without
    the casts (a frozen weight is cast again on every forward: autocast caches casts only of weights that train)
    and in half the memory. Left in float32: a parameter that a module of another kind shares (an output layer tied
    to the embeddings, which autocast does not cast) and anything not plain float32 (quantized weights). Returns
    the number of parameter elements converted."""
    others = {id(p) for m in module.modules() if not isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    converted, seen = 0, set()
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        for p in m.parameters(recurse=False):
            if id(p) in seen or id(p) in others or type(p) is not torch.nn.Parameter or p.dtype != torch.float32:
                continue
            seen.add(id(p))
            p.data = p.data.to(torch.bfloat16)
            converted += p.numel()
    return converted


def without_tied_copies(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the names under which ``model`` holds a parameter it also holds under an earlier name (a
    tied output layer): a gathered state dict has a copy under each name, which ``save_pretrained`` would write;
    unsharded, the model holds one tensor and writes it once."""
    first: dict[int, str] = {}
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied.add(name)
        else:
            first[id(parameter)] = name
    return {name: value for name, value in state.items() if name not in tied}
