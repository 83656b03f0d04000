"""Parameter groups for optimizers built from ``conf/optimizer/*.yaml``."""

from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Trainable parameters in two groups: with weight decay (matrices) and without (biases, norms, 1-D).

    The no-decay group overrides ``weight_decay`` with 0; the other group takes the optimizer's own value.
    Frozen parameters (``requires_grad=False``) are left out, so optimizer state is kept only for what trains.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
