"""The config group ``peft``: what of the policy trains. ``none`` (the whole model), ``lora`` (low-rank adapters on
a frozen base, Hu et al. 2021, arXiv:2106.09685) or ``qlora`` (the same on a base loaded in 4 bits, Dettmers et
al. 2023, arXiv:2305.14314), with the ``peft`` library.

A run builds the option first; the policy's loader gets :meth:`NoAdapter.loader_arguments` (``qlora``: the 4-bit
quantization), then :meth:`NoAdapter.apply` adds the adapter, before the algorithm's ``setup`` makes its reference
(``algo/reference=adapter`` switches this adapter off instead of copying the model). ``final/`` then holds the
adapter (``PeftModel.save_pretrained``) and, with ``merge=true``, ``final/merged/`` the base with the adapter merged
in, a plain model that ``model.name_or_path`` loads. Checkpoints keep the parameters that train (the adapter) and a
fingerprint of the frozen ones (:mod:`rlhf.hardware.base`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.models.quantize import DTYPE_NAMES, quantized_bytes

log = logging.getLogger(__name__)

# model.head -> peft's task type (which PeftModel class wraps it; a sequence-classification head also trains its
# freshly initialized score layer).
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}
MERGED = "merged"  # final/merged/: the merged model (merge=true)


class NoAdapter:
    """``peft=none``: every parameter of the policy trains."""

    adapts = False  # whether the policy gets an adapter (algo/reference=adapter and ref_adapter need one)
    quantizes = False  # whether the base is loaded in 4 bits

    def loader_arguments(self) -> dict[str, Any]:
        """Extra arguments for the policy's loader (:func:`rlhf.models.loading.load_policy`)."""
        return {}

    def apply(self, model: torch.nn.Module, load_base: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        """The model to train, made from the loaded policy. ``load_base``: loads the policy again, unquantized and
        without adapter (for ``merge``)."""
        return model

    def save_merged(self, final: Path, tokenizer: Any, save_fn: Callable) -> None:
        """After ``final/`` is written (main process only): anything more to write beside it."""

    def trainable_parameters(self, model: torch.nn.Module) -> int:
        """Parameters that train, predicted for the loaded (not yet adapted) policy, or counted on an adapted one."""
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    def memory_bytes(self, model: torch.nn.Module) -> int:
        """Bytes of the policy's weights once this option is applied, predicted from the loaded unquantized policy,
        or measured on one already adapted/quantized (for the memory preflight)."""
        return quantized_bytes(model)


def _known_head(values: Mapping[str, Any], where: str) -> None:
    if values.get("head", "causal_lm") not in TASK_TYPES:
        raise UserError(f"{where}.head={values.get('head')!r}: LoRA knows the heads {list(TASK_TYPES)}. Fix: "
                        f"model.head=causal_lm, or peft=none")


def adapter_folder_check(key: str) -> Callable[[Mapping[str, Any], str], None]:
    """A check across arguments (:func:`rlhf.core.limits.limits`): the adapter folder named by ``key``, when set, holds
    ``adapter_config.json``; refused before anything loads."""
    def check(values: Mapping[str, Any], where: str) -> None:
        folder = values.get(key)
        if isinstance(folder, str) and not (Path(os.path.expanduser(folder)) / "adapter_config.json").is_file():
            raise UserError(f"{where}.{key}={folder}: no adapter_config.json there (looked in "
                            f"{Path(os.path.expanduser(folder)).absolute()}). Fix: the final/ folder of a run with "
                            "peft=lora.")
    return check


@limits(
    _known_head,
    adapter_folder_check("init_from"),
    r=Range(ge=1, integer=True, meaning="the adapter's rank; 8-64 is common", fix=16),
    alpha=Range(gt=0, meaning="the adapter's scale is alpha / r (alpha / sqrt(r) with use_rslora)", fix=32),
    dropout=Range(ge=0, lt=1, meaning="dropout on the adapter's input", fix=0.05),
)
class LoRA(NoAdapter):
    """``peft=lora``: low-rank adapters on the frozen policy, the only parameters that train.

    Args:
        r: rank of each adapter (its A is r x in, its B out x r; B starts at zero, so a fresh adapter changes nothing).
        alpha: scale numerator: the adapter's output is multiplied by ``alpha / r``.
        dropout: dropout on each adapter's input while training (``algo.disable_dropout=true``, DPO's default,
            turns it off, as every dropout).
        target_modules: the layers that get an adapter: a list of module names (``[q_proj, v_proj]``),
            ``all-linear`` (every linear layer but the output head), or ``null``: peft's default for the model's
            family (``model_type``): q_proj,v_proj for llama (the embedded model), qwen2 and mistral, c_attn for gpt2,
            query_key_value for gpt_neox (pythia); peft refuses a family it has no default for (then name them).
        bias: ``none``, ``all`` or ``lora_only``: which biases train too.
        use_rslora: rank-stabilized scale ``alpha / sqrt(r)`` (Kalajdzievski 2023, arXiv:2312.03732).
        init_from: a trained adapter to start from (a folder with ``adapter_config.json``, e.g. ``<run dir>/final``
            of an SFT run with peft=lora); its own settings (r, alpha, target_modules) then apply.
        merge: also write ``final/merged/``: the base with the adapter merged in, a plain Hugging Face model (loaded
            again unquantized on the main process at the end of the run: the base's memory once more).
        head: the policy's head (``model.head``); picks peft's task type.
    """

    adapts = True

    def __init__(self, r: int = 16, alpha: float = 32, dropout: float = 0.05,
                 target_modules: list[str] | str | None = None, bias: str = "none", use_rslora: bool = False,
                 init_from: str | None = None, merge: bool = False, head: str = "causal_lm") -> None:
        self.r, self.alpha, self.dropout, self.bias, self.use_rslora = r, alpha, dropout, bias, use_rslora
        self.target_modules = (target_modules if target_modules is None or isinstance(target_modules, str)
                               else [str(name) for name in target_modules])
        self.init_from, self.merge, self.head = init_from, merge, head
        self._load_base: Callable[[], torch.nn.Module] | None = None
        adapter_folder_check("init_from")({"init_from": init_from}, "peft")

    def config(self, model: torch.nn.Module):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, bias=self.bias, use_rslora=self.use_rslora,
                          task_type=TASK_TYPES[self.head])

    def apply(self, model: torch.nn.Module, load_base: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        from peft import PeftModel, get_peft_model

        self._load_base = load_base
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing: its warning
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")
            if self.init_from is not None:
                return PeftModel.from_pretrained(model, os.path.expanduser(self.init_from), is_trainable=True)
            try:
                return get_peft_model(model, self.config(model))
            except ValueError as error:  # e.g. a family peft has no default target modules for
                raise UserError(f"peft={type(self).__name__.lower()}: {error} Fix: name the layers, e.g. "
                                "peft.target_modules=[q_proj,v_proj], or peft.target_modules=all-linear") from error

    def save_merged(self, final: Path, tokenizer: Any, save_fn: Callable) -> None:
        """``final/merged/``: the base loaded again unquantized, the adapter of ``final/`` merged into its weights."""
        if not self.merge:
            return
        from peft import PeftModel

        if self._load_base is None:
            raise UserError("peft.merge=true: this LoRA option was applied without a way to load the base again.")
        merged = PeftModel.from_pretrained(self._load_base(), str(final)).merge_and_unload()
        save_fn(merged, tokenizer, final / MERGED)
        log.info("saved the merged model to %s", final / MERGED)

    def targets(self, model: torch.nn.Module) -> list[tuple[int, int]]:
        """(in, out) features of every layer the adapter would be put on (``target_modules`` resolved as peft does
        for the usual cases: a family's default, ``all-linear``, names matched against each layer name's end)."""
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        names = self.target_modules
        if names is None:
            names = DEFAULTS.get(getattr(model.config, "model_type", ""), [])
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        found = []
        for name, module in model.named_modules():
            shape = _linear_shape(module)
            if shape is None or module is head:
                continue
            if names == "all-linear" or (isinstance(names, list) and name.rsplit(".", 1)[-1] in names):
                found.append(shape)
        return found

    def trainable_parameters(self, model: torch.nn.Module) -> int:
        if any(type(m).__module__.startswith("peft") for m in model.modules()):
            return super().trainable_parameters(model)
        return sum(self.r * (n_in + n_out) for n_in, n_out in self.targets(model))

    def memory_bytes(self, model: torch.nn.Module) -> int:
        """The base as loaded plus the adapter in float32 (peft keeps adapters of a 16-bit base in float32)."""
        if any(type(m).__module__.startswith("peft") for m in model.modules()):
            return quantized_bytes(model)
        return quantized_bytes(model) + 4 * self.trainable_parameters(model)


def _linear_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer: ``nn.Linear``, or GPT-2's ``Conv1D`` (its weight stored in x out)."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.nf
    return None


QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = tuple(DTYPE_NAMES)


def _known_quantization(values: Mapping[str, Any], where: str) -> None:
    if values.get("quant_type", "nf4") not in QUANT_TYPES:
        raise UserError(f"{where}.quant_type={values.get('quant_type')!r} is not one of {list(QUANT_TYPES)}. "
                        f"Fix: {where}.quant_type=nf4")
    for key in ("compute_dtype", "quant_storage"):
        allowed = COMPUTE_DTYPES + (("uint8",) if key == "quant_storage" else ())
        if values.get(key, allowed[0]) not in allowed:
            raise UserError(f"{where}.{key}={values.get(key)!r} is not one of {list(allowed)}. Fix: "
                            f"{where}.{key}={allowed[0]}")


@limits(_known_quantization)
class QLoRA(LoRA):
    """``peft=qlora``: LoRA on a base whose linear layers are loaded in 4 bits by bitsandbytes (the adapters and
    the layers left unquantized, such as norms, embeddings and the output head, keep ``model.dtype``).

    Args (besides :class:`LoRA`'s):
        quant_type: ``nf4`` (4-bit NormalFloat, QLoRA's) or ``fp4``.
        double_quant: quantize the quantization constants too (about 0.4 bits per weight less).
        compute_dtype: dtype the 4-bit weights are dequantized to for each matmul: ``float32``, ``bfloat16``,
            ``float16``; ``bfloat16`` on GPUs, ``float32`` on CPUs without bf16 support.
        quant_storage: dtype the packed 4-bit weights are stored in (``uint8``); DeepSpeed ZeRO-3 and FSDP shard
            them only when it equals the dtype of the other parameters (``model.dtype``), per PEFT's documentation.
    """

    quantizes = True

    def __init__(self, r: int = 16, alpha: float = 32, dropout: float = 0.05,
                 target_modules: list[str] | str | None = None, bias: str = "none", use_rslora: bool = False,
                 init_from: str | None = None, merge: bool = False, head: str = "causal_lm",
                 quant_type: str = "nf4", double_quant: bool = True, compute_dtype: str = "float32",
                 quant_storage: str = "uint8") -> None:
        super().__init__(r=r, alpha=alpha, dropout=dropout, target_modules=target_modules, bias=bias,
                         use_rslora=use_rslora, init_from=init_from, merge=merge, head=head)
        self.quant_type, self.double_quant = quant_type, double_quant
        self.compute_dtype, self.quant_storage = compute_dtype, quant_storage

    def loader_arguments(self) -> dict[str, Any]:
        return {"quantization": {"load_in_4bit": True, "bnb_4bit_quant_type": self.quant_type,
                                 "bnb_4bit_use_double_quant": self.double_quant,
                                 "bnb_4bit_compute_dtype": self.compute_dtype,
                                 "bnb_4bit_quant_storage": self.quant_storage}}

    def memory_bytes(self, model: torch.nn.Module) -> int:
        """Measured on a quantized model; predicted on an unquantized one: half a byte per weight of the quantized
        layers (every linear layer but the output head) plus their constants (a float32 per 64 weights, or about a
        byte per 256 with ``double_quant``), the rest as loaded, and the adapter in float32."""
        if any(type(p).__module__.startswith("bitsandbytes") for p in model.parameters()):
            return quantized_bytes(model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        quantized = sum(module.weight.numel() for module in model.modules()
                        if isinstance(module, torch.nn.Linear) and module is not head)
        per_weight = 0.5 + (1 / 256 if self.double_quant else 4 / 64)
        rest = quantized_bytes(model) - sum(module.weight.numel() * module.weight.element_size()
                                            for module in model.modules()
                                            if isinstance(module, torch.nn.Linear) and module is not head)
        return int(quantized * per_weight) + rest + 4 * self.trainable_parameters(model)


def check_combination(adapter: type | None, reference: type | None) -> None:
    """Refuse, before anything loads, what cannot work with the ``peft`` option the config names (``adapter``, its
    class; ``reference``, the ``algo/reference`` strategy's class): a reference strategy that needs the policy's
    adapter (:attr:`rlhf.models.reference.Reference.needs_adapter`) with ``peft=none``. Every ``hardware`` option
    ran with ``lora`` and ``qlora`` on CPU processes (docs/how-to/lora-qlora.md), so none is refused."""
    if getattr(reference, "needs_adapter", False) and not getattr(adapter, "adapts", False):
        option = getattr(reference, "option", reference.__name__)
        raise UserError(f"algo/reference={option} uses the policy's LoRA adapter, but peft=none: the policy has no "
                        "adapter. Fix: peft=lora (or peft=qlora), or algo/reference=copy.")
