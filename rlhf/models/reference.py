"""Reference-model strategies for KL-regularized algorithms: the config group ``algo/reference``
(``python train.py algo=dpo algo/reference=shared_layers``). Each is a :class:`Reference`, built from
``conf/algo/reference/<name>.yaml``: called with ``(policy, tokenizer)`` it returns the frozen model or None; where
that model then lives (device, precision, shards) is the hardware strategy's business: the loop hands it to
``strategy.prepare_frozen``. Its :meth:`~Reference.logps` gives an algorithm the reference log-probabilities of a
batch, and :meth:`~Reference.precompute` / :meth:`~Reference.collate` let a strategy compute them once, before
training, as columns of the rows (``precomputed``, :mod:`rlhf.models.precomputed`).

- :class:`FrozenCopy` (``copy``): a frozen copy of the initial policy.
- :class:`Pretrained` (``model``): a separately given model (e.g. the SFT model when the policy starts elsewhere);
  a tokenizer with another vocabulary is refused.
- :class:`SharedLayers` (``shared_layers``): the first N decoder layers are the policy's own, frozen in both, so only
  the layers above them are duplicated (the idea of TRL's ``create_reference_model(num_shared_layers=N)``).
- :class:`~rlhf.models.precomputed.Precomputed` (``precomputed``): log-probabilities computed once before training,
  cached on disk; no reference model during training.
- :class:`NoReference` (``none``): no reference model; the log-ratios are the policy's log-probabilities (for
  reference-free objectives).
- :class:`Int8` (``int8``): the reference in 8 bits (bitsandbytes' LLM.int8()), from ``name_or_path`` or from the
  initial policy's weights.
- :class:`~rlhf.models.reference_adapters.AdapterOff` (``adapter``) and
  :class:`~rlhf.models.reference_adapters.SecondAdapter` (``ref_adapter``): with ``peft=lora``/``qlora``.

Each also says how many bytes it holds beside the policy (:meth:`Reference.memory_bytes`), for the memory preflight.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data import shared_prompt
from rlhf.models.quantize import (
    DTYPE_NAMES,
    is_quantized,
    quantized_bytes,
    quantized_copy,
    quiet_bitsandbytes,
)
from rlhf.ops.completion_logps import completion_stats


class Reference:
    """What an algorithm asks of its reference, whatever the strategy. Subclasses build the model in ``__call__``;
    the rest has defaults here (a forward pass of that model)."""

    # Whether logps() scores any batch of sequences, or only those of the rows precompute() saw (precomputed): an
    # algorithm that makes sequences per batch (KTO's mismatched pairs) needs the former.
    scores_any_batch: bool = True
    # Whether it works on the policy's LoRA adapter (peft=lora/qlora): refused with peft=none before anything loads
    # (rlhf.models.adapters.check_combination).
    needs_adapter: bool = False
    # Whether its model keeps 8-bit weights (a sharding strategy may keep such a model whole: frozen_share).
    quantized: bool = False
    # Whether its model computes what the initial policy computes, bit for bit (a copy of its weights in the same
    # dtype): until the policy trains, the policy's own log-probabilities are the reference's (held-out batches at
    # the start of a run; rlhf.algos.regularized).
    copies_policy: bool = False

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> torch.nn.Module | None:
        """The frozen reference model built from the initial ``policy`` (None: no model during training)."""
        raise NotImplementedError

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        """``[B]``: the reference's summed log-probability of each sequence's completion in ``batch``; ``model`` is
        what ``__call__`` returned, placed by the hardware strategy, ``policy`` the model being trained. Called
        under ``torch.no_grad()``."""
        return completion_stats(model, batch).logps

    def precompute(self, rows, strategy, collate) -> Any:
        """Once, before training (after the hardware strategy has started): the tokenized splits (a
        ``DatasetDict``) with any columns this strategy adds; ``collate(rows)`` makes a batch of sequences of them.
        Default: the rows unchanged."""
        return rows

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Tensors of the columns added by :meth:`precompute`, for a batch of ``rows``. Default: none."""
        return {}

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """Bytes of weights this strategy holds beside the policy on each process during training, predicted from
        the initial policy (also one on the meta device) before :meth:`__call__`, for the memory preflight's
        predictions (``scripts/memory.py``). Default: a whole copy of the policy as stored."""
        return quantized_bytes(policy)


class FrozenCopy(Reference):
    """A frozen deep copy of the initial policy, in eval mode."""

    copies_policy = True

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> torch.nn.Module:
        return copy.deepcopy(policy).eval().requires_grad_(False)


class Pretrained(Reference):
    """A reference loaded from ``name_or_path`` (a Hub id or a folder such as ``<run dir>/final``), frozen.

    Args:
        name_or_path: the reference model; its tokenizer must have the policy's vocabulary (log-probabilities of
            the same token ids are compared).
        dtype: its parameter dtype (``float32``, ``bfloat16``, ``float16``, ``auto``).
        revision: Hub branch, tag or commit.
        trust_remote_code: run code the Hub repository ships (only repositories you trust).
    """

    def __init__(self, name_or_path: str, dtype: str = "float32", revision: str | None = None,
                 trust_remote_code: bool = False) -> None:
        self.name_or_path, self.dtype, self.revision = name_or_path, dtype, revision
        self.trust_remote_code = trust_remote_code

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> torch.nn.Module:
        from rlhf.models.loading import load_policy

        loaded = load_policy(name_or_path=self.name_or_path, dtype=self.dtype, revision=self.revision,
                             trust_remote_code=self.trust_remote_code)
        return self.check(loaded, policy, tokenizer).eval().requires_grad_(False)

    def check(self, loaded: Any, policy: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
        """``loaded.model`` when ``loaded`` (a :class:`~rlhf.models.loading.Policy`) scores the policy's token ids;
        refused otherwise."""
        if tokenizer is not None and loaded.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise UserError(
                f"algo.reference.name_or_path={self.name_or_path} has another tokenizer than the policy "
                f"({len(loaded.tokenizer)} tokens against {len(tokenizer)}, or the same ids for other tokens): their "
                "log-probabilities of one sequence cannot be compared. Fix: a reference of the policy's family "
                "(e.g. the SFT model the policy came from), or algo/reference=copy.")
        if loaded.model.get_output_embeddings().weight.shape[0] != policy.get_output_embeddings().weight.shape[0]:
            raise UserError(f"algo.reference.name_or_path={self.name_or_path} scores "
                            f"{loaded.model.get_output_embeddings().weight.shape[0]} token ids, the policy "
                            f"{policy.get_output_embeddings().weight.shape[0]}. Fix: a reference with the policy's "
                            "vocabulary, or algo/reference=copy.")
        return loaded.model

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """The policy's parameter count at this reference's ``dtype`` (a reference of the policy's family and size;
        one of another size is not known before it loads)."""
        width = torch.finfo(DTYPE_NAMES[self.dtype]).bits // 8 if self.dtype in DTYPE_NAMES else 4
        return sum(p.numel() for p in policy.parameters()) * width


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the ``ModuleList`` with ``config.num_hidden_layers`` entries."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise UserError(f"algo/reference=shared_layers: no list of {count} decoder layers found in "
                    f"{type(model).__name__}. Fix: algo/reference=copy.")


@limits(num_shared_layers=Range(ge=1, meaning="decoder layers, counted from the input, that policy and reference "
                                "share (frozen in both)", fix=1))
class SharedLayers(Reference):
    """A reference whose first ``num_shared_layers`` decoder layers are the policy's own modules, frozen (in the
    policy too: they no longer train); the layers above them, the final norm and the output head are a frozen copy.
    The embeddings are copied, not shared (they are often tied to the output head, which keeps training).
    """

    def __init__(self, num_shared_layers: int = 1) -> None:
        self.num_shared_layers = num_shared_layers

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> torch.nn.Module:
        layers = decoder_layers(policy)
        if self.num_shared_layers >= len(layers):
            fix = (f"at most {len(layers) - 1}" if len(layers) > 1
                   else "algo/reference=copy (a one-layer model has no layer to share)")
            raise UserError(f"algo.reference.num_shared_layers={self.num_shared_layers} but the model has "
                            f"{len(layers)} decoder layer(s): nothing would train. Fix: {fix}.")
        shared = list(layers)[: self.num_shared_layers]
        for layer in shared:
            layer.requires_grad_(False)
        # deepcopy's memo maps each shared layer to itself: the copy holds the policy's own modules there.
        reference = copy.deepcopy(policy, memo={id(layer): layer for layer in shared})
        reference.rlhf_shared_layers = self.num_shared_layers  # read by sharding strategies, which refuse it
        return reference.eval().requires_grad_(False)

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """The policy's bytes less those of the shared layers."""
        shared = list(decoder_layers(policy))[: self.num_shared_layers]
        return quantized_bytes(policy) - sum(quantized_bytes(layer) for layer in shared)


class NoReference(Reference):
    """No reference model: reference-free objectives (the log-ratios are the policy's log-probabilities)."""

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> None:
        return None

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        return torch.zeros(shared_prompt.scored_sequences(batch), device=batch["input_ids"].device)

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        return 0


@limits(threshold=Range(ge=0, meaning="LLM.int8()'s outlier threshold: input features above it are multiplied in "
                        "16 bits; 0 turns the outlier path off", fix=6.0))
class Int8(Reference):
    """The reference with its linear layers in 8 bits (bitsandbytes' LLM.int8(), Dettmers et al. 2022,
    arXiv:2208.07339): about a quarter of a float32 copy's bytes, at a small error in its log-probabilities
    (measured: docs/concepts/references.md).

    Args:
        name_or_path: the model to load in 8 bits (a Hub id or folder; the policy's own ``model.name_or_path`` by
            default); ``None``: the initial policy's weights (the embedded model, or a policy with a LoRA adapter,
            merged first), written to a temporary folder and loaded back quantized.
        dtype: the dtype of the layers left unquantized (norms, embeddings, the output head).
        revision: Hub branch, tag or commit.
        trust_remote_code: run code the Hub repository ships (only repositories you trust).
        threshold: LLM.int8()'s outlier threshold (``llm_int8_threshold``).
    """

    quantized = True

    def __init__(self, name_or_path: str | None = None, dtype: str = "float32", revision: str | None = None,
                 trust_remote_code: bool = False, threshold: float = 6.0) -> None:
        self.name_or_path, self.dtype, self.revision = name_or_path, dtype, revision
        self.trust_remote_code, self.threshold = trust_remote_code, threshold

    def settings(self) -> dict[str, Any]:
        return {"load_in_8bit": True, "llm_int8_threshold": self.threshold}

    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> torch.nn.Module:
        if self.name_or_path is not None:
            from rlhf.models.loading import load_policy

            loaded = load_policy(name_or_path=self.name_or_path, dtype=self.dtype, revision=self.revision,
                                 trust_remote_code=self.trust_remote_code, quantization=self.settings())
            return Pretrained(self.name_or_path).check(loaded, policy, tokenizer).eval().requires_grad_(False)
        if is_quantized(policy):
            raise UserError("algo/reference=int8 with algo.reference.name_or_path=null copies the initial policy's "
                            "weights, but they are already quantized (peft=qlora). Fix: algo/reference=adapter (the "
                            "4-bit base itself, no second model), or algo.reference.name_or_path=<the base model>.")
        initial = policy
        if hasattr(policy, "merge_and_unload"):  # a LoRA policy: its function is the base plus the adapter
            initial = copy.deepcopy(policy).merge_and_unload()
        return quantized_copy(initial, self.settings(), DTYPE_NAMES[self.dtype]).eval().requires_grad_(False)

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        with quiet_bitsandbytes():
            return completion_stats(model, batch).logps

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """One byte per weight of every linear layer but the output head (plus a float32 scale per row), the
        rest at ``dtype``."""
        width = torch.finfo(DTYPE_NAMES[self.dtype]).bits // 8
        head = policy.get_output_embeddings()
        total, seen = 0, set()
        for name, module in policy.named_modules():
            if "lora_" in name:  # a LoRA adapter's own layers: merged into the base before quantizing
                continue
            for kind, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # tied weights count once
                    continue
                seen.add(id(param))
                linear = kind == "weight" and isinstance(module, torch.nn.Linear) and module is not head
                total += param.numel() + 4 * param.shape[0] if linear else param.numel() * width
        return total


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn off every dropout of ``model``: ``nn.Dropout`` modules and the probabilities that attention layers read
    from their config at build time (``attention_dropout``, ``attn_pdrop``, ...), so that a policy and its reference
    agree exactly at the start."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if isinstance(value, float) and not isinstance(value, bool) and ("dropout" in name or "pdrop" in name):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
                setattr(config, name, 0.0)
