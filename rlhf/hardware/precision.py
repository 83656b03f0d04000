"""Which precision a run computes in: bf16 autocast or float32, what ``auto`` means on this machine, and whether a
run computes in bf16 at all (on a CPU its results then depend on the thread count)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf.core.bf16 import cpu_has_bf16_matmul
from rlhf.core.errors import UserError

PRECISIONS = ("no", "bf16", "auto")


FP16_REASON = ("fp16 needs a loss scaler that rlhf does not keep (it would have to be updated on every skipped step "
               "and saved in every checkpoint, and under ZeRO an fp16 overflow would stop the run as a non-finite "
               "gradient)")


def check_precision(mixed_precision: Any, key: str = "hardware.mixed_precision") -> None:
    """Refuse a mixed precision that no strategy trains with: fp16 (one message, pointing to bf16) or an unknown
    name."""
    if mixed_precision == "fp16":
        raise UserError(f"{key}=fp16 is not supported by any hardware option: {FP16_REASON}. Fix: {key}=bf16 (the "
                        "same memory and speed as fp16 on GPUs since Ampere, and it runs on CPUs), or \"no\".")
    if mixed_precision not in PRECISIONS:
        raise UserError(f"{key}={mixed_precision!r} is not one of {list(PRECISIONS)}. Fix: e.g. {key}=bf16")


def computes_in_bf16(mixed_precision: str, model_dtype: Any) -> bool:
    """Whether a run computes in bf16: autocast (``mixed_precision``, resolved), or a model loaded in bfloat16
    (``model_dtype``: :func:`model_dtype`; ``auto`` where the checkpoint's own dtype could not be read, counted as
    bf16). On a CPU its results then depend on the thread count (docs/threads/2026-11-28-same-numbers.md)."""
    return mixed_precision == "bf16" or model_dtype in ("bfloat16", "auto")


def model_dtype(model: Mapping[str, Any] | None) -> Any:
    """The dtype a run's model (its ``model`` config section) is loaded in: ``model.dtype``, with ``auto`` read from
    the checkpoint before anything loads (:func:`rlhf.models.loading.stored_dtype`: a float32 checkpoint computes in
    float32), and left ``auto`` where it cannot be read there."""
    if not model:
        return None
    dtype = model.get("dtype")
    if dtype != "auto":
        return dtype
    from rlhf.models.loading import stored_dtype

    return stored_dtype(model.get("name_or_path"), model.get("revision")) or "auto"


def resolve_precision(mixed_precision: str, cuda: bool) -> str:
    """What ``mixed_precision`` means on this machine. ``auto`` is ``bf16`` where the hardware computes in bf16: a
    CUDA GPU with bf16 matrix units (compute capability 8.0 on: as fast as fp16 there, and no loss scaler) or a CPU
    with bf16 matrix instructions (:func:`cpu_has_bf16_matmul`); else ``no``. Chosen by measurement: on a 2-core
    AVX-512 BF16 CPU bf16 autocast ran the main job (the embedded default) in 195 s over five seeds against 208 s in
    float32, DPO at 3.7M-106M parameters 1.4-1.6x as fast (docs/results/speed.md, Levers), and learned as well. ``hardware=cpu``
    pins float32 (``no``), the same precision on every CPU."""
    if mixed_precision != "auto":
        return mixed_precision
    if cuda:
        return "bf16" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 else "no"
    return "bf16" if cpu_has_bf16_matmul() else "no"
