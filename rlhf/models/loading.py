"""Load the policy (model + tokenizer) from the Hub, a local folder, or the embedded tiny spec."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf.core import hub
from rlhf.core.errors import UserError
from rlhf.core.limits import limits
from rlhf.models import attention
from rlhf.models.quantize import DTYPE_NAMES, load_quantized, quantized_copy

DTYPES = DTYPE_NAMES  # model.dtype names -> torch dtypes (one table, shared with the quantized loaders)


@dataclass(frozen=True)
class Head:
    """What sits on top of the transformer (``model.head``): the transformers Auto class that builds the model, the
    config fields it needs, and whether it reads its output at the last non-pad token (which needs the model
    config's ``pad_token_id``)."""

    auto_class: Any
    config: dict[str, Any]
    pools_last_token: bool = False


# model.head -> how to build it. A Hub checkpoint saved with another head keeps its backbone weights; a new head is
# freshly initialized (transformers says which weights are new).
HEADS = {
    "causal_lm": Head(AutoModelForCausalLM, {}),
    # One scalar per sequence, read at its last token: a reward model (rlhf.algos.reward).
    "sequence_classification": Head(AutoModelForSequenceClassification, {"num_labels": 1}, pools_last_token=True),
    # One scalar per token: a value model, PPO's critic (rlhf.models.value.token_values reads it). No dropout before
    # the score (transformers' default is 0.1): a regression target is not dropped out (TRL turns dropout off too).
    "value": Head(AutoModelForTokenClassification, {"num_labels": 1, "classifier_dropout": 0.0}),
}
# Declared heads that are not built yet, with what to do instead (none today).
PLANNED_HEADS: dict[str, str] = {}


def _known_head(values: dict[str, Any], where: str) -> None:
    """A check across arguments (:func:`rlhf.core.limits.limits`): ``head`` is one that can be built."""
    head = values.get("head", "causal_lm")
    if head in PLANNED_HEADS:
        raise UserError(f"{where}.head={head}: {PLANNED_HEADS[head]}")
    if head not in HEADS:
        raise UserError(f"{where}.head={head!r} is not one of {[*HEADS, *PLANNED_HEADS]}. Fix: e.g. "
                        f"{where}.head=causal_lm (a language model), {where}.head=sequence_classification "
                        f"(a reward model) or {where}.head=value (a value per token)")


@dataclass
class Policy:
    """The model being trained and its tokenizer."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def _looks_local(name_or_path: str) -> bool:
    return name_or_path.startswith((".", "/", "~")) or os.path.exists(name_or_path) or name_or_path.count("/") > 1


# What a run folder holds beside its model (which is in final/).
_RUN_FOLDER_MARKERS = ("final", ".hydra", "metrics.jsonl", "summary.json")


def _check_not_a_run_folder(name_or_path: str, path: str) -> None:
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return
    if any(os.path.exists(os.path.join(path, marker)) for marker in _RUN_FOLDER_MARKERS):
        final = os.path.join(str(name_or_path).rstrip("/"), "final")
        missing = "" if os.path.isdir(os.path.join(path, "final")) else (
            " (not there: the run has not finished, or ran with train.save_final=false)")
        raise UserError(f"model.name_or_path={name_or_path} is a run folder; its model is in {final}{missing}. "
                        f"Fix: model.name_or_path={final}")


def check_model_path(name_or_path: str) -> None:
    """Refuse a local ``model.name_or_path`` that is no folder, or is a run folder rather than its model."""
    path = os.path.expanduser(str(name_or_path))
    if _looks_local(path) and not os.path.isdir(path):
        raise UserError(f"model.name_or_path={name_or_path}: no such folder (looked in {os.path.abspath(path)}). "
                        "Fix: point it at a folder with config.json, e.g. <run dir>/final, or a Hub id.")
    _check_not_a_run_folder(name_or_path, path)


def _local_model(values: dict[str, Any], where: str) -> None:
    """A check across arguments (:func:`rlhf.core.limits.limits`): a local model folder exists, before anything loads."""
    if isinstance(values.get("name_or_path"), str):
        check_model_path(values["name_or_path"])


# The dtype names a checkpoint's safetensors header gives its tensors (the safetensors format's own names).
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def stored_dtype(name_or_path: str | None = None, revision: str | None = None) -> str | None:
    """The dtype ``model.dtype=auto`` loads a model in, read without loading it, as transformers decides it
    (``PreTrainedModel.from_pretrained``: the config's ``dtype``, which transformers before 4.56 called
    ``torch_dtype``, else the dtype of the first floating tensor in the weights file): ``float32`` for the embedded
    tiny model and a packaged one (``name_or_path`` None: both built or saved in float32, :mod:`rlhf.models.packaged`).
    ``None`` where it cannot be read here (a Hub model neither in the cache nor reachable; a folder without
    ``config.json``)."""
    if name_or_path is None:
        return "float32"
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
    else:
        config = _hub_file(path, revision, "config.json")
    if config is None or not os.path.isfile(config):
        return None
    with open(config) as file:
        fields = json.load(file)
    dtype = fields.get("dtype") or fields.get("torch_dtype")
    if isinstance(dtype, str) and dtype != "auto":
        return dtype.removeprefix("torch.")
    return _weights_dtype(os.path.dirname(config))


def _hub_file(repo_id: str, revision: str | None, filename: str) -> str | None:
    """``filename`` of the Hub model ``repo_id`` from the cache, else downloaded where the Hub answers (the load
    fetches it next anyway); None otherwise."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str):
            return cached
        if hub.offline_mode() or not hub.reachable():
            return None
        return hf_hub_download(repo_id, filename, revision=revision)
    except Exception:  # not a repository id, no such file, the Hub's errors: unread, said by the load itself
        return None


def _weights_dtype(folder: str) -> str | None:
    """The dtype of the first floating tensor of the safetensors weights in ``folder`` (a sharded checkpoint's first
    shard), from the file's header alone (https://huggingface.co/docs/safetensors: an 8-byte little-endian length,
    then a JSON header that names each tensor's dtype); None without such a file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as file:
            shards = sorted(set(json.load(file).get("weight_map", {}).values()))
        weights = os.path.join(folder, shards[0]) if shards else ""
    else:
        weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        return None
    with open(weights, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    return next((_SAFETENSORS_DTYPES[entry["dtype"]] for name, entry in header.items()
                 if name != "__metadata__" and entry.get("dtype") in _SAFETENSORS_DTYPES), None)


@limits(_local_model, _known_head)
def load_policy(
    name_or_path: str | None = None,
    dtype: str = "float32",
    chat_template: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "auto",
    gradient_checkpointing: bool = False,
    tiny: Any = None,
    packaged: Any = None,
    head: str = "causal_lm",
    quantization: dict[str, Any] | None = None,
) -> Policy:
    """Load a model (a causal LM unless ``head`` says otherwise) and its tokenizer.

    Args:
        name_or_path: a Hub model id or a folder saved with ``save_pretrained`` (e.g. ``<run dir>/final``);
            ``None`` builds the embedded tiny model from ``tiny``.
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (as stored).
        chat_template: a Jinja chat template replacing the tokenizer's (needed for conversational data on
            base models without one).
        revision: Hub branch, tag or commit.
        trust_remote_code: run Python code that the Hub repository ships (custom architectures). Off unless
            asked: such code runs with your permissions. Weights are read from safetensors files where the
            repository has them, else with ``torch.load(weights_only=True)``, which runs no code.
        attn_implementation: ``auto`` (transformers' pick; where that is ``sdpa``, the kernel behind it chosen per
            call by measurement: :mod:`rlhf.models.attention`), or one of transformers' names (``sdpa``, ``eager``,
            ``flash_attention_2``, ...); ``None`` lets transformers pick.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of keeping
            them (non-reentrant ``torch.utils.checkpoint``): activation memory for about a third more compute.
        tiny: a :class:`rlhf.embedded.tiny_model.TinySpec`, used when ``name_or_path`` is ``None``.
        packaged: a model that an installed package ships (:class:`rlhf.models.packaged.PackagedGguf`), used when
            ``name_or_path`` is ``None``: its Hugging Face folder, made once in the cache, loads as a local folder.
        head: what the model outputs, a key of :data:`HEADS`: ``causal_lm`` (next-token logits),
            ``sequence_classification`` (one scalar per sequence, a reward model) or ``value`` (one scalar per
            token, PPO's critic: :func:`rlhf.models.value.token_values`). A causal LM checkpoint loaded with another
            head keeps its backbone and gets a new score head.
        quantization: ``BitsAndBytesConfig`` arguments to load the linear layers in 4 or 8 bits with (a dict,
            :mod:`rlhf.models.quantize`); given by ``peft=qlora`` (:meth:`rlhf.models.adapters.LoRA.loader_arguments`),
            not by the model YAMLs. The layers left unquantized keep ``dtype``.
    """
    _known_head({"head": head}, "model")
    spec = HEADS[head]
    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype!r} is not one of {[*DTYPES, 'auto']}. Fix: e.g. model.dtype=bfloat16")
    if name_or_path is None and packaged is not None:
        name_or_path = str(packaged.folder())
    if name_or_path is None:
        if tiny is None:
            raise UserError("model.name_or_path is null and no tiny spec is given. Fix: model=tiny or "
                            "model.name_or_path=<hub id or folder>")
        policy = tiny.build(head)
        if quantization is not None:
            policy = Policy(quantized_copy(policy.model, quantization, DTYPES.get(dtype)), policy.tokenizer)
    else:
        path = os.path.expanduser(str(name_or_path))
        check_model_path(name_or_path)
        kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
        model_kwargs: dict[str, Any] = {}
        if not os.path.isdir(path) and hub.cache_only(path, revision, "model.name_or_path"):
            # A Hub id without network: from the cache only. transformers does not pass local_files_only on to its
            # look-up of a PEFT adapter config, which would then retry the Hub for a minute.
            kwargs["local_files_only"] = True
            model_kwargs["adapter_kwargs"] = {"local_files_only": True}
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            if spec.config:  # the head's fields set on the checkpoint's config: fields a config class does not
                # declare (e.g. Llama's classifier_dropout) would otherwise go to the model's constructor and fail
                model_kwargs["config"] = AutoConfig.from_pretrained(path, **kwargs)
                model_kwargs["config"].update(spec.config)
            loaded_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
            if quantization is not None:
                model = load_quantized(spec.auto_class, path, quantization, loaded_dtype,
                                       attn_implementation=attention.requested(attn_implementation), **kwargs,
                                       **model_kwargs)
            else:
                model = spec.auto_class.from_pretrained(
                    path, dtype=loaded_dtype, attn_implementation=attention.requested(attn_implementation), **kwargs,
                    **model_kwargs,
                )
        except OSError as error:
            raise UserError(f"model.name_or_path={name_or_path}: could not load it ({error}). Fix: check the id or "
                            "folder; Hub ids need network access (or a cache with HF_HUB_OFFLINE=1).") from error
        policy = Policy(model, tokenizer)
    attention.apply(policy.model, attn_implementation)
    if dtype != "auto" and quantization is None:  # a quantized model keeps its 4/8-bit layers (loaded in dtype)
        policy.model.to(DTYPES[dtype])
    if gradient_checkpointing:
        policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.model.config.use_cache = False  # a cache is of no use when activations are recomputed
    tokenizer = policy.tokenizer
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token_id is None:
        # Padding is masked explicitly everywhere, so reusing EOS as PAD cannot hide real EOS tokens.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if spec.pools_last_token and policy.model.config.pad_token_id is None:
        # The head reads each sequence at its last token before the first pad: it must know the pad id.
        policy.model.config.pad_token_id = tokenizer.pad_token_id
    return policy
