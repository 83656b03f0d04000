"""Reference-model strategies for KL-regularized algorithms. Each is a callable ``(policy, accelerator) ->
frozen model``, chosen in the algorithm's YAML by ``reference._target_``."""

from __future__ import annotations

import copy

import torch


class FrozenCopy:
    """A frozen deep copy of the initial policy, in eval mode, on the policy's device."""

    def __call__(self, policy: torch.nn.Module, accelerator) -> torch.nn.Module:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        return reference.to(accelerator.device)
