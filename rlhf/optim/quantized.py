"""AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster, Older", https://arxiv.org/abs/2409.03137)
from bitsandbytes, with its two warmups as long as the run unless told otherwise.

AdEMAMix adds to Adam's fast momentum ``m1`` (``beta1``) a slow one ``m2`` (``beta3``, e.g. 0.9999) mixed in with
weight ``alpha``: ``p -= lr * ((m1 / (1 - beta1^t) + alpha * m2) / (sqrt(nu / (1 - beta2^t)) + eps) + weight_decay * p)``.
A slow momentum that starts at full weight destabilises the first steps, so the paper raises ``alpha`` linearly from
0 over ``t_alpha`` steps and ``beta3`` from ``beta1`` over ``t_beta3`` steps (its equations for the schedulers), and
sets both to the run's length ``T`` in its experiments. bitsandbytes (``bitsandbytes.optim.AdEMAMix``,
https://huggingface.co/docs/bitsandbytes/main/en/reference/optim/ademamix) implements both schedulers and reads
``t_alpha`` / ``t_beta3`` from each parameter group at every step; there ``None`` means no warmup at all (full
``alpha`` and ``beta3`` from the first step).

:class:`AdEMAMix` keeps bitsandbytes' update and kernels (32-bit or blockwise 8-bit states, ``optim_bits``) and gives
``None`` the paper's meaning: the run's length, which the run knows only once its data is loaded. The run tells it
with :func:`rlhf.optim.set_run_length` (on ``optimizer.param_groups``, so through any wrapper that exposes them) before the
first step; an optimizer that steps without having been told keeps bitsandbytes' meaning and says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import bitsandbytes.optim
import torch

from rlhf.core.errors import UserError
from rlhf.optim import RUN_LENGTH_KEY

log = logging.getLogger(__name__)

WARMUPS = ("t_alpha", "t_beta3")


class AdEMAMix(bitsandbytes.optim.AdEMAMix):
    """``bitsandbytes.optim.AdEMAMix`` (its update, state, ``state_dict`` and kernels) with ``t_alpha`` / ``t_beta3``
    of ``None`` meaning the run's length (:func:`rlhf.optim.set_run_length`). ``optim_bits``: 32 keeps the three moments in
    float32; 8 in blockwise-quantized uint8 (Dettmers et al. 2022, https://arxiv.org/abs/2110.02861), except in
    tensors of fewer than ``min_8bit_size`` elements, which bitsandbytes keeps in float32.

    Refused before loading under hardware=fsdp and zero1-3 (rlhf.config.checks reads :attr:`whole_matrices`):
    bitsandbytes' kernels are custom operators with no DTensor rule (FSDP2's shards raise "got mixed torch.Tensor and
    DTensor" at the first step), and 8-bit states quantized in blocks over ZeRO's flat partitions would span several
    tensors and quantize the small ones that one process keeps in float32: another rule than one process's."""

    whole_matrices = ("runs bitsandbytes' kernels on whole plain tensors (FSDP2's DTensor shards raise inside them) "
                      "and quantizes 8-bit states in blocks of 256 elements laid over each whole tensor")

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999), alpha: float = 5.0,
                 t_alpha: int | None = None, t_beta3: int | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 optim_bits: int = 32, min_8bit_size: int = 4096) -> None:
        super().__init__(params, lr=lr, betas=tuple(betas), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                         weight_decay=weight_decay, optim_bits=optim_bits, min_8bit_size=min_8bit_size)
        for group in self.param_groups:
            group[RUN_LENGTH_KEY] = [name for name in WARMUPS if group.get(name) is None]
        self._told = False  # whether the first step has checked that the run's length was given

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self._told:
            self._told = True
            untold = sorted({name for group in self.param_groups for name in group.get(RUN_LENGTH_KEY, ())
                             if group.get(name) is None})
            if untold:
                log.warning("AdEMAMix's %s (null: the run's length) were not given the run's length "
                            "(rlhf.optim.set_run_length): stepping with no warmup, bitsandbytes' None",
                            ", ".join(untold))
        return super().step(closure)

    @staticmethod
    def check_options(node: Any, where: str) -> None:
        """Before anything loads (rlhf.config.checks): three betas, ``alpha`` >= 0, warmups of at least one step or
        null, 8 or 32 bits, ``min_8bit_size`` >= 0."""
        betas = list(node.get("betas", (0.9, 0.999, 0.9999)))
        if len(betas) != 3:
            raise UserError(f"{where}.betas={betas}: AdEMAMix takes three decay rates, [beta1 (fast momentum), beta2 "
                            "(second moment), beta3 (slow momentum)]. Fix: optimizer.betas=[0.9,0.999,0.9999]")
        if len(betas) == 3 and not betas[0] <= betas[2]:
            raise UserError(f"{where}.betas={betas}: beta3 (the slow momentum) is below beta1; the paper's warmup "
                            "raises beta3 from beta1. Fix: optimizer.betas=[0.9,0.999,0.9999]")
        alpha = node.get("alpha", 5.0)
        if not isinstance(alpha, (int, float)) or alpha < 0:
            raise UserError(f"{where}.alpha={alpha}: the slow momentum's weight must be a number >= 0 (0: Adam). "
                            "Fix: optimizer.alpha=5.0")
        for name in WARMUPS:
            value = node.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UserError(f"{where}.{name}={value}: optimizer steps of the warmup, an integer >= 1, or null for "
                                f"the run's length. Fix: optimizer.{name}=null")
        bits = node.get("optim_bits", 32)
        if bits not in (8, 32):
            raise UserError(f"{where}.optim_bits={bits}: bitsandbytes keeps AdEMAMix's states in 8 or 32 bits. "
                            "Fix: optimizer.optim_bits=8 (or 32)")
        size = node.get("min_8bit_size", 4096)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise UserError(f"{where}.min_8bit_size={size}: a tensor's element count below which its states stay "
                            "32-bit, an integer >= 0. Fix: optimizer.min_8bit_size=4096")

