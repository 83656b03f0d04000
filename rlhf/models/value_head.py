"""PPO's critic attached to the policy: a value per token, from the policy's own last hidden state (a head on the
trunk) or from a separate copy of its backbone (a separate critic).

The critic becomes a submodule of the policy (``policy.value_head``) before the hardware strategy wraps it, so the
one model the loop trains holds both: one optimizer, one set of gradients synchronized by DDP (FSDP2 and ZeRO-3 shard
the critic's layers like the policy's), one checkpoint that resumes both. The policy's ``forward`` is unchanged
unless values are asked for (:func:`values_on`): its ``forward`` then adds ``token_values [B, T]`` to its output, computed
inside the same call (so DDP sees every parameter used, and FSDP2 gathers and frees the critic with the policy). Generation never asks, so sampling costs what it did.

The saved model (``final/``) is the policy with the critic's weights as extra keys (``value_head.*``): loading it
as a causal LM (``AutoModelForCausalLM.from_pretrained``, or ``model.name_or_path=<run>/final``) uses the policy and
ignores them, with transformers' note on unused weights.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor, nn

from rlhf.core.errors import UserError


class ValueScore(nn.Linear):
    """The critic's ``Linear(hidden_size, 1)``, a sharding unit of its own (``_no_split_modules``): FSDP2 gathers it
    for its forward and again for its backward, whatever becomes of the root's parameters in between."""

    _no_split_modules = ["ValueScore"]


class ValueHead(nn.Module):
    """``Linear(hidden_size, 1)`` on a last hidden state; with ``backbone`` (a copy of the policy's decoder), on the
    backbone's own, so the critic shares no parameter with the policy."""

    def __init__(self, hidden_size: int, backbone: nn.Module | None = None, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.score = ValueScore(hidden_size, 1)
        # From its own generator: every process builds the same head, whatever its random state (a sharding strategy
        # keeps each process's own slice of what it built; a per-process seed would mix several initializations).
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(self.score.weight.shape, generator=generator) / (hidden_size + 1) ** 0.5)
            self.score.bias.zero_()
        self.active = False  # set by values_on(); not a parameter, not saved

    def values(self, hidden: Tensor | None, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.backbone is not None:
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def attach_value_head(policy: nn.Module, separate: bool, seed: int = 0) -> ValueHead:
    """Give ``policy`` (a causal LM, unwrapped) a critic as ``policy.value_head`` and a ``forward`` that fills in
    ``token_values`` while :func:`values_on` is on. ``separate``: the critic gets a copy of the policy's backbone (its
    decoder without the language-model head), trained apart from the policy's; else it reads the policy's last
    hidden state. ``seed``: the score's initialization (the same on every process)."""
    if hasattr(policy, "peft_config"):
        raise UserError("algo=ppo with a LoRA policy (peft=lora/qlora) is not supported: the critic would train the "
                        "frozen base's hidden states through the adapter only. Fix: peft=none")
    config = getattr(policy, "config", None)
    hidden_size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if hidden_size is None:
        raise UserError(f"algo=ppo needs the policy's hidden size for its value head, but {type(policy).__name__}'s "
                        "config has neither hidden_size nor n_embd. Fix: a transformers causal LM")
    backbone = copy.deepcopy(policy.base_model) if separate else None
    if backbone is not None:
        backbone.requires_grad_(True)
    head = ValueHead(hidden_size, backbone, seed).to(next(policy.parameters()).device)
    policy.add_module("value_head", head)

    inner = getattr(policy.forward, "__func__", type(policy).forward)  # the forward as a function of the module

    @functools.wraps(inner)  # the same signature for generate's inspection of the forward's arguments
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _forward_with_values(inner, self, *args, **kwargs)

    # Inside forward, not in a forward hook: a strategy's own hooks (FSDP2 gathers the root's parameters before the
    # call, frees them after it and hooks the backward pass on the call's outputs) then cover the critic as well.
    # A method bound to the policy, not a closure over it: a deep copy of the policy (eval=generate's frozen copy of
    # the initial policy) gets a forward bound to the copy, where a closure would go on calling the original.
    policy.forward = types.MethodType(forward, policy)
    return head


def without_value_head(model: nn.Module) -> nn.Module:
    """``model`` (a copy of a policy) without the critic :func:`attach_value_head` gave it: the head removed and the
    forward the one it had before. Returns ``model``."""
    if isinstance(getattr(model, "value_head", None), ValueHead):
        inner = model.forward.__wrapped__
        del model.value_head
        if inner is type(model).forward:
            model.__dict__.pop("forward", None)
        else:
            model.forward = types.MethodType(inner, model)
    return model


def _forward_with_values(original, self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``original(self, ...)``, the policy's forward, filling in ``token_values`` while its value head is on
    (:func:`values_on`)."""
    head = self.value_head
    if not head.active:
        return original(self, *args, **kwargs)
    if head.backbone is None:
        kwargs["output_hidden_states"] = True
    output = original(self, *args, **kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    hidden = None if head.backbone is not None else output.hidden_states[-1]
    output["token_values"] = head.values(hidden, input_ids, kwargs.get("attention_mask"))
    return output


@contextmanager
def values_on(model: nn.Module) -> Iterator[None]:
    """Within this block, the policy's forward passes (``model`` wrapped by a strategy or not) also return
    ``token_values [B, T]``: the critic's estimate at every position, in float32."""
    head = getattr(extract_model_from_parallel(model), "value_head", None)
    if not isinstance(head, ValueHead):
        raise ValueError("values_on: this model has no value head (attach_value_head)")
    head.active = True
    try:
        yield
    finally:
        head.active = False
