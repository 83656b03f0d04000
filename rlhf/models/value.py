"""The value head (``model.head=value``): a causal LM's backbone with one scalar per token, for PPO's critic.

The model is transformers' token-classification model with one label (``AutoModelForTokenClassification``,
``num_labels=1``, no dropout before the score): the backbone's last hidden state at every position goes through
``Linear(hidden_size, 1)``. It is a ``PreTrainedModel`` like the other heads, so it saves and loads with
``save_pretrained``/``from_pretrained`` (its config names the class: ``LlamaForTokenClassification`` for the tiny
model), and the hardware strategies shard it as they shard a causal LM (its decoder layers are the same). A causal LM
checkpoint loaded with ``model.head=value`` keeps its backbone under a freshly initialized score. ``algo=ppo`` does
not load one: it attaches its critic to the policy (:mod:`rlhf.models.value_head`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf.core.errors import UserError


def token_values(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """``[B, T]`` values, one per position of ``input_ids`` (``[B, T]``), in float32; positions that
    ``attention_mask`` marks as padding get values too (mask them out where they are used)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    if logits.shape != (*input_ids.shape, 1):
        raise UserError(f"a value per token needs a model with model.head=value, but this one outputs shape "
                        f"{list(logits.shape)} for input {list(input_ids.shape)}. Fix: model.head=value")
    return logits.squeeze(-1).float()
