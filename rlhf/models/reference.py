"""Reference-model strategies for KL-regularized algorithms. Each is a callable ``(policy) -> frozen model``,
chosen in the algorithm's YAML by ``reference._target_``. Where the model then lives (device, precision, shards)
is the hardware strategy's business: the loop hands it to ``strategy.prepare_frozen``."""

from __future__ import annotations

import copy

import torch


class FrozenCopy:
    """A frozen deep copy of the initial policy, in eval mode."""

    def __call__(self, policy: torch.nn.Module) -> torch.nn.Module:
        return copy.deepcopy(policy).eval().requires_grad_(False)
