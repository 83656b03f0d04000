"""Prodigy, a learning-rate-free Adam (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive
Parameter-Free Learner", https://arxiv.org/abs/2306.06101), from the authors' ``prodigyopt`` package
(https://github.com/konstmish/prodigy; extra ``rlhf[optimizers]``): ``conf/optimizer/prodigy.yaml``.

Adam's step is multiplied by ``d``, an estimate of the distance from the initial weights to a solution that starts
at ``d0`` and only grows: ``d = d_coef x sum_k dlr_k <g_k, x0 - x_k> / || s ||_1`` (the paper's Algorithm 2), where
both sums run over every parameter of the model. ``lr`` (1.0) scales ``d``, and a schedule's multipliers still
apply. What it keeps per parameter: Adam's two moments, ``s`` (a running sum of gradients) and ``p0`` (a copy of
the initial weights): four tensors, twice AdamW's state. ``d`` and its sums live in the parameter groups, so torch's
``state_dict`` saves them and a resume continues them.

The loop needs nothing more than for AdamW: no train/eval mode, no closure, gradients read and left as they are
(``decouple=True``; the coupled decay ``decouple=False`` adds the decay into ``p.grad`` in place).
"""

from __future__ import annotations

import math
from typing import Any

import prodigyopt

from rlhf.core.errors import UserError


class Prodigy(prodigyopt.Prodigy):
    """``prodigyopt.Prodigy`` with the package's arguments (its defaults) except ``fsdp_in_use`` (and ``growth_rate=None`` for its
    unbounded ``inf``: a config holds finite numbers): its sharded path
    reduces on a CUDA tensor and detects only FSDP1's flat parameters, and this project refuses sharded strategies
    for Prodigy before anything loads (:attr:`whole_matrices`)."""

    # Read by rlhf.config.checks: refused under hardware=fsdp and zero1-3. Each process would sum over only its
    # shard of every tensor, so each would estimate its own d and the replicas would drift apart.
    whole_matrices = ("estimates its step size d from sums over every parameter of the model (Mishchenko & Defazio "
                      "2023), which each process would compute from its own shard alone")

    def __init__(self, params, lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999), beta3: float | None = None,
                 eps: float = 1e-8, weight_decay: float = 0.0, decouple: bool = True,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False, d0: float = 1e-6,
                 d_coef: float = 1.0, growth_rate: float | None = None, slice_p: int = 1):
        super().__init__(params, lr=lr, betas=tuple(betas), beta3=beta3, eps=eps, weight_decay=weight_decay,
                         decouple=decouple, use_bias_correction=use_bias_correction,
                         safeguard_warmup=safeguard_warmup, d0=d0, d_coef=d_coef,
                         growth_rate=math.inf if growth_rate is None else growth_rate,
                         fsdp_in_use=False, slice_p=slice_p)

    @property
    def d(self) -> float:
        """The current step-size estimate (the same in every group)."""
        return float(self.param_groups[0]["d"])

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "optimizer") -> None:
        """Before anything is built: the values Prodigy's own estimate needs (the shared limits check ``lr``,
        ``betas``, ``eps`` and ``weight_decay`` by name)."""
        rules = {"d0": (lambda v: v > 0, "the initial estimate of d, > 0", "1.0e-6"),
                 "d_coef": (lambda v: v > 0, "the factor on the estimate of d, > 0 (0.5-2 the paper's range)", "1.0"),
                 "growth_rate": (lambda v: v >= 1, "the most d may grow per step, a factor >= 1 (null: unbounded)", "null"),
                 "beta3": (lambda v: 0 <= v < 1, "the decay of d's running sums, in [0, 1) (null: sqrt(beta2))",
                           "null"),
                 "slice_p": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                             "every slice_p-th entry of each tensor feeds d's estimate, a whole number >= 1", "1")}
        for key, (ok, meaning, fix) in rules.items():
            value = node.get(key)
            if value is None or isinstance(value, str):  # absent, null, or an interpolation resolved later
                continue
            if not ok(value):
                raise UserError(f"{where}.{key}={value!r}: {meaning}. Fix: {where}.{key}={fix}")
