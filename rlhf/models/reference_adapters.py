"""Reference strategies that need no second model, for a policy with a LoRA adapter (``peft=lora`` or ``qlora``):
the reference is the policy's own frozen base, with the trained adapter switched off (``algo/reference=adapter``)
or swapped for a second, frozen adapter (``algo/reference=ref_adapter``) for the length of the reference's forward.

The switch is made on the PEFT model found inside whatever the hardware strategy wrapped the policy in (DDP, FSDP2,
DeepSpeed all keep it among their modules), and the forward runs through the wrapper itself, as the policy's does:
under ``torch.no_grad()`` no wrapper records anything for the backward pass. The policy stays in its training
mode, so the reference runs the very kernels the policy's forward runs (bitsandbytes' 4-bit CPU kernel differs
between training and eval mode); ``algo.disable_dropout=true`` (the default) keeps the base's dropout out of it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.core.limits import limits
from rlhf.models.adapters import adapter_folder_check
from rlhf.models.reference import Reference
from rlhf.ops.completion_logps import completion_stats

REFERENCE_ADAPTER = "reference"  # the second adapter's name in the PEFT model ("default" is the trained one)


def peft_model(model: torch.nn.Module, option: str) -> Any:
    """The ``peft.PeftModel`` inside ``model`` (itself, or inside a DDP/FSDP/DeepSpeed wrapper)."""
    from peft import PeftModel

    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    raise UserError(f"algo/reference={option} needs a policy with a LoRA adapter, and this one has none. Fix: "
                    "peft=lora (or peft=qlora), or another algo/reference (copy, int8, ...).")


class AdapterOff(Reference):
    """The reference is the policy with its LoRA adapter switched off: the frozen base model, no second model.

    With a fresh adapter (LoRA's B matrices start at zero) the policy equals its base, so the first step's loss is
    exactly that of a frozen copy. Starting from an already trained adapter (``peft.init_from``), switching it off
    gives the base, not that adapter: use :class:`SecondAdapter` then.
    """

    needs_adapter = True
    option = "adapter"  # its name in algo/reference, for messages

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> None:
        peft_model(policy, "adapter")  # refuse a policy without an adapter now, not at the first step
        return None

    @contextlib.contextmanager
    def as_reference(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Within the block, ``policy`` (or the wrapper holding it) is the reference: its adapter switched off. For
        whatever scores or generates as the reference without a second model (eval=generate's win rate)."""
        with peft_model(policy, "adapter").disable_adapter():
            yield policy

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        with self.as_reference(policy) as reference:
            return completion_stats(reference, batch).logps

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        return 0


@limits(adapter_folder_check("path"))
class SecondAdapter(Reference):
    """The reference is the policy's base with a second LoRA adapter, loaded frozen from ``path`` (e.g. the SFT
    adapter the policy starts from, ``peft.init_from``): for DPO after an adapter-trained SFT, where switching the
    trained adapter off would give the base model instead of the SFT model. The base weights are shared; only the
    second adapter's (small) weights are added.

    Args:
        path: a folder holding a PEFT adapter (``adapter_config.json``), e.g. ``<run dir>/final`` of a run with
            ``peft=lora``; by default the adapter the policy starts from (``peft.init_from``).
    """

    needs_adapter = True
    option = "ref_adapter"

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def folder(self) -> Path:
        if self.path is None:
            raise UserError("algo/reference=ref_adapter needs the adapter to use as the reference. Fix: "
                            "peft.init_from=<run dir>/final (the policy starts from it, and it is the reference), or "
                            "algo.reference.path=<folder with adapter_config.json>.")
        adapter_folder_check("path")({"path": self.path}, "algo.reference")
        return Path(os.path.expanduser(self.path))

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> None:
        model = peft_model(policy, "ref_adapter")
        trained = model.active_adapter
        model.load_adapter(str(self.folder()), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        model.set_adapter(trained)  # load_adapter leaves the trained adapter active; said again, to be sure
        return None

    @contextlib.contextmanager
    def as_reference(self, policy: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Within the block, ``policy`` (or the wrapper holding it) is the reference: the reference adapter active."""
        with active_adapter(peft_model(policy, "ref_adapter"), REFERENCE_ADAPTER):
            yield policy

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        with self.as_reference(policy) as reference:
            return completion_stats(reference, batch).logps

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """The adapter's file size (its weights as saved)."""
        folder = self.folder()
        return sum(f.stat().st_size for f in folder.glob("adapter_model.*"))


@contextlib.contextmanager
def active_adapter(model: Any, name: str) -> Iterator[None]:
    """Within the block, ``model`` (a PeftModel) computes with its adapter ``name``; which parameters train is
    left exactly as it was (peft's ``set_adapter`` marks the active adapter trainable, so the flags are restored)."""
    trained = model.active_adapter
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(trained)
        for param, flag in flags:
            param.requires_grad_(flag)
