"""Which attention kernel a model runs: ``model.attn_implementation``.

``auto`` (the default) is what transformers picks for the model, except that where it picks ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention``), the kernel behind it is chosen per call by what measured
faster: torch's math kernel (two matrix products and a softmax) for a call in bf16 on a CPU whose backward pass will
run, when the keys are fewer than :data:`CPU_MATH_BELOW_KEYS`; torch's own choice (its flash kernel on a CPU)
everywhere else. ``python benchmarks/attention_kernels.py`` on a 2-core AVX-512-BF16 CPU (torch 2.13), 16 sequences:
forward and backward in bf16, flash took 1.7-2.3x the math kernel's time at 32 keys, 1.3-2.1x at 64, 1.2-1.5x at
128, and 0.7-1.1x at 192 (4 and 12 heads); the forward alone (a frozen reference, generation) and float32 were
faster with flash at every length. The choice is made inside each call, so a model switches as its batches'
lengths change; a GPU keeps torch's choice (flash or memory-efficient kernels).

The math kernel materialises each head's ``keys x keys`` scores, as ``eager`` does: below the threshold that is
fewer than ``heads x 192`` float32 values per token and layer (:func:`kept_bytes`; the memory preflight counts them).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rlhf.core.errors import UserError

AUTO = "auto"  # the config value
NAME = "rlhf_sdpa"  # what a model's config._attn_implementation says under ``auto`` (registered with transformers)
CPU_MATH_BELOW_KEYS = 192  # benchmarks/attention_kernels.py: the crossover on a 2-core CPU lies between 128 and 256 keys


def uses_math_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`sdpa_by_measurement` runs torch's math kernel for these ``[B, heads, length, dim]`` tensors:
    on a CPU, in bf16, fewer than :data:`CPU_MATH_BELOW_KEYS` keys, and a backward pass to come (a gradient is
    recorded). Under autocast the attention computes in autocast's dtype whatever the query's (rotary embeddings in
    float32 make a bf16 query float32 again before autocast casts it back inside the attention)."""
    if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
        return False
    cpu = query.device.type == "cpu"
    dtype = torch.get_autocast_dtype("cpu") if cpu and torch.is_autocast_enabled("cpu") else query.dtype
    return _math_is_faster(query.device.type, dtype == torch.bfloat16, key.shape[-2])


def _math_is_faster(device_type: str, bf16: bool, keys: int) -> bool:
    """The measured rule (module docstring), for a call whose backward will run."""
    return device_type == "cpu" and bf16 and keys < CPU_MATH_BELOW_KEYS


def sdpa_by_measurement(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, with torch's math kernel where it measured faster (:func:`uses_math_kernel`)."""
    if uses_math_kernel(query, key, value):
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(NAME, sdpa_by_measurement)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the same masks as sdpa's


def requested(attn_implementation: str | None) -> str | None:
    """What to ask transformers for when loading: ``auto`` lets it pick (:func:`apply` then refines ``sdpa``)."""
    return None if attn_implementation == AUTO else attn_implementation


def apply(model: torch.nn.Module, attn_implementation: str | None) -> None:
    """Set ``attn_implementation`` on a built or loaded model: under ``auto``, a model that transformers gave
    ``sdpa`` runs :func:`sdpa_by_measurement` instead; a named one is set where the model has another (one built
    from a config, e.g. the embedded tiny model); ``None`` leaves it as transformers picked."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attn_implementation == AUTO:
        if current == "sdpa":
            model.set_attn_implementation(NAME)
    elif attn_implementation is not None and current != attn_implementation:
        model.set_attn_implementation(attn_implementation)


def kept_bytes(config: Any, keys: int, device_type: str, bf16: bool) -> int | None:
    """What a training forward of ``keys`` tokens keeps for the attention's backward beyond flash's query, key, value
    and output, in bytes per token and decoder layer, where ``auto`` runs the math kernel (:func:`uses_math_kernel`):
    under bf16 it computes in float32, so it keeps float32 copies of query, key and value (``3 h`` values, ``h`` the
    hidden size, against flash's bf16 ones) and each head's float32 scores (``heads x keys``). ``None`` elsewhere:
    :func:`rlhf.telemetry.memory_preflight.activation_bytes`' own count (``eager``'s scores)."""
    if getattr(config, "_attn_implementation", None) != NAME or not _math_is_faster(device_type, bf16, keys):
        return None
    hidden, heads = getattr(config, "hidden_size", 0), getattr(config, "num_attention_heads", 1)
    return 3 * hidden * (4 - 2) + heads * keys * 4


FLEX = "flex_attention"  # transformers' name for flex attention (torch.nn.attention.flex_attention)


def flex_backward_fails(device_type: str) -> str | None:
    """Why torch here cannot train through flex attention on ``device_type`` (its own error, e.g. ``FlexAttention
    does not support backward on CPU``), or None where it can: one forward and backward pass of a query of 8 numbers,
    milliseconds."""
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.zeros(1, 1, 1, 8, device=device_type, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice to compile flex attention: beside the point here
            flex_attention(query, query, query).sum().backward()
    except (NotImplementedError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).rstrip('.')}"
    return None


def check_trains(model: Mapping[str, Any], hardware: Mapping[str, Any]) -> None:
    """Refuse ``model.attn_implementation=flex_attention`` on a device where torch cannot train through it (every
    algorithm trains the policy), before anything loads: asked of torch (:func:`flex_backward_fails`) on the run's
    device. A GPU not yet used by this process is not asked: the probe would hold a CUDA context in the process that
    starts the run, for the whole run; there a failure comes from torch at the first step."""
    from rlhf.core.limits import uses_cpu

    if not isinstance(model, Mapping) or model.get("attn_implementation") != FLEX or not isinstance(hardware, Mapping):
        return
    device = "cpu" if uses_cpu(hardware) else "cuda"
    if device == "cuda" and not torch.cuda.is_initialized():
        return
    reason = flex_backward_fails(device)
    if reason is not None:
        raise UserError(
            f"model.attn_implementation={FLEX}: torch {torch.__version__} cannot train through flex attention on the "
            f"{device} that this run computes on ({reason}). Fix: model.attn_implementation=auto (sdpa) or eager; "
            "the shared prompt (algo.shared_prompt) and algo.padding_free work with both there, under a dense mask "
            "instead of flex attention's block mask. Flex attention trains on a GPU.")
