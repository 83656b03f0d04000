"""Weights loaded in 8 or 4 bits with bitsandbytes, through transformers' ``BitsAndBytesConfig``.

A quantization is written as a plain dict of ``BitsAndBytesConfig`` arguments (``{"load_in_4bit": True,
"bnb_4bit_compute_dtype": "float32", ...}``), so that it travels through configs and checkpoints' ``config.json``:
``peft=qlora`` passes one to the policy's loader (:func:`rlhf.models.loading.load_policy`), ``algo/reference=int8``
loads its reference with one. transformers quantizes while it loads, so a model that exists only in memory (the
embedded tiny model, an initial policy) is written to a temporary folder first and loaded back
(:func:`quantized_copy`). bitsandbytes 0.50 runs 4-bit and 8-bit layers on CPUs too (tested here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bnb_config(settings: dict[str, Any]):
    """transformers' ``BitsAndBytesConfig`` from a dict of its arguments (dtype names as strings)."""
    from transformers import BitsAndBytesConfig

    values = {k: DTYPE_NAMES.get(v, v) if k.endswith("dtype") or k.endswith("storage") else v
              for k, v in settings.items()}
    return BitsAndBytesConfig(**values)


def load_device() -> torch.device:
    """Where this process loads quantized weights: its run's device (bitsandbytes quantizes where the weights
    land), from Accelerate's process state when a run has started one, else the CPU."""
    from accelerate.state import PartialState

    return PartialState().device if PartialState._shared_state else torch.device("cpu")


def load_quantized(auto_class: Any, path: str, settings: dict[str, Any], dtype: torch.dtype | None,
                   **kwargs: Any) -> torch.nn.Module:
    """``auto_class.from_pretrained(path)`` with its linear layers quantized as ``settings`` says; the layers that
    stay unquantized (norms, embeddings, the output head) in ``dtype``."""
    with quiet_bitsandbytes():
        model = auto_class.from_pretrained(path, quantization_config=bnb_config(settings), dtype=dtype,
                                           device_map={"": load_device()}, **kwargs)
    one_cpu_kernel(model)
    return model


def one_cpu_kernel(model: torch.nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers on one kernel in training and in eval mode. On CPUs with AVX512-BF16,
    bitsandbytes 0.50 repacks a 4-bit layer's weights for a faster bf16 kernel at its first forward in eval mode
    without gradients: the repacking re-quantizes the quantization constants (the frozen base changes for good, so
    a resumed run would not continue exactly), its results differ from the training kernel's (an adapter-off
    reference would not equal the policy at the start), and it fails on layers narrower than 64 (measured here).
    Switched off per layer; GPUs never take that path."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantized_copy(model: torch.nn.Module, settings: dict[str, Any], dtype: torch.dtype | None = None):
    """A quantized copy of an in-memory Hugging Face model (its weights written to a temporary folder and loaded
    back quantized; the folder is removed). ``model`` is left as it was."""
    from safetensors.torch import save_model

    auto_class = type(model)
    with tempfile.TemporaryDirectory(prefix="rlhf-quantize-") as folder:
        # Not save_pretrained: under torch.distributed it writes on rank 0 only, and every process loads its copy.
        model.config.save_pretrained(folder)
        save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        copy = load_quantized(auto_class, folder, settings, dtype if dtype is not None else model.dtype)
    copy.config._name_or_path = model.config._name_or_path  # where the weights came from, not the temporary folder
    copy.name_or_path = model.config._name_or_path
    return copy


class _OncePerProcess(logging.Filter):
    """A logger's records whose message starts with ``prefix``: the first passes, the rest are dropped."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix, self.seen = prefix, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


_CAST_NOTICE = "MatMul8bitLt: inputs will be cast"


@contextlib.contextmanager
def quiet_bitsandbytes() -> Iterator[None]:
    """bitsandbytes' notice that 8-bit matmuls cast float32 inputs to float16 (their design), which it logs (and
    some versions warn) at every call: once per process."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _OncePerProcess) for f in logger.filters):
        logger.addFilter(_OncePerProcess(_CAST_NOTICE))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CAST_NOTICE)
        yield


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers hold as stored (a 4-bit matrix counts half a byte per weight, its
    quantization constants included where bitsandbytes keeps them as tensors)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        for extra in (getattr(state, "absmax", None), getattr(tensor, "SCB", None)):
            if isinstance(extra, torch.Tensor):
                total += extra.numel() * extra.element_size()
    return total


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether any weight of ``model`` is stored in 8 or 4 bits by bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
                or any(type(p).__module__.startswith("bitsandbytes") for p in model.parameters()))



def has_8bit_weights(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes' 8-bit weights (``Int8Params``, LLM.int8())."""
    return any(type(p).__name__ == "Int8Params" for p in model.parameters())
