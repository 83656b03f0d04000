"""Sampling completions from a policy (:func:`sample`, for online algorithms' rollouts and the generation
evaluation alike), with its parameters gathered once for a whole generation where a strategy shards them.

Samples come from ``softmax(logits / temperature)`` with this project's top-p and top-k and nothing else: the
log-probabilities, importance ratios and KL of online RL assume that distribution, and a greedy evaluation must be
greedy. transformers fills every generation setting a call leaves unset from the model's own
``generation_config.json``, where many Hub models ship their authors' sampling defaults (``repetition_penalty``,
``no_repeat_ngram_size``, ``min_p``, ``top_k``, ...); :func:`plain_defaults` sets that aside for the call, so the
unset ones are transformers' neutral defaults. What a completion stops at is kept from the model: the tokenizer's
EOS and every id of the generation config's ``eos_token_id`` (:func:`stop_ids`: a chat model's end of turn).

Under FSDP2 and ZeRO-3 every forward pass of a sharded model all-gathers each unit's (layer's) parameters and frees
them after; generating ``T`` tokens would gather the model ``T`` times, and every process would have to keep stepping
until the last one's completions end (``synced_gpus``). :func:`gathered_for_generation` gathers it once for the
block; the forward passes inside are no collectives.

Two decoders: transformers' ``generate``, and :func:`rlhf.models.decoding.decode` (a static cache, the decode step
compiled into CUDA graphs on a GPU, and by inductor on a CPU where asked, the end of the completions checked every few
tokens), chosen by :attr:`Sampling.generation` (:func:`uses_static_decoding`, :func:`decode_compile_options`); they
give the same completions on a CPU, compiled or not (tested).

A model whose layers ``hardware.compile=layers`` compiled runs them eagerly in ``generate``
(:func:`eager_layers`: every generation path, :meth:`rlhf.launch.step_trainer.StepTrainer.generate` too): with a
key-value cache, each layer's graph would be specialised on its index and the cache's length, a new graph per layer
and length, until torch's recompile limit left training's layers eager as well.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from accelerate.utils import extract_model_from_parallel

from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.models import decoding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: ``temperature``, ``top_p``, ``top_k`` (0: off) and at most ``max_new_tokens``
    each; the tokenizer's ``pad_id``, the ids a completion ends at (``eos_ids``: :func:`stop_ids`), and the tokenizer
    that decodes them; transformers' ``cache_implementation`` (None: its dynamic cache); ``gather``: a sharded
    model's parameters gathered once for the whole generation (:func:`gathered_for_generation`); ``generation``: the
    decoder, ``transformers`` (its ``generate``), ``static`` (:func:`rlhf.models.decoding.decode`: one static cache,
    the decode step compiled into CUDA graphs on a GPU, eager on a CPU, the ends checked every
    ``check_every_tokens`` tokens), ``static_compiled`` (the same, its step compiled on a CPU too, by inductor), or
    ``auto``: what :mod:`rlhf.core.auto_choices` picks for the device, a static decoder only where the model is not
    sharded over processes and no ``cache_implementation`` is asked for (:func:`uses_static_decoding`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    pad_id: int = 0
    eos_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    cache_implementation: str | None = None
    gather: bool = True
    generation: str = "auto"
    check_every_tokens: int = decoding.CHECK_EVERY_TOKENS

    def __post_init__(self) -> None:
        if self.generation not in GENERATIONS:
            raise UserError(f"algo.generation={self.generation!r} is not one of {list(GENERATIONS)}. Fix: "
                            "algo.generation=auto (the decoder rlhf/core/auto_choices.py picks for the device)")
        if self.check_every_tokens < 1:
            raise UserError(f"check_every_tokens={self.check_every_tokens} must be at least 1. Fix: "
                            f"check_every_tokens={decoding.CHECK_EVERY_TOKENS}")


GENERATIONS = ("auto", "transformers", "static", "static_compiled")
STATIC = ("static", "static_compiled")  # the values that decode with rlhf.models.decoding


def uses_static_decoding(settings: Sampling, device: torch.device, partitioned: bool) -> bool:
    """Whether ``settings`` decode with :func:`rlhf.models.decoding.decode` on ``device``: ``static`` or
    ``static_compiled``, or ``auto`` where :mod:`rlhf.core.auto_choices` picks one of them for the device, for a model
    whose parameters are not ``partitioned`` over processes (FSDP2's, ZeRO-3's: there the gathered model runs
    transformers' ``generate``) when no ``cache_implementation`` is named."""
    if settings.generation != "auto":
        return settings.generation in STATIC
    chosen = auto_choices.pick("algo.generation", device.type)
    return chosen in STATIC and not partitioned and settings.cache_implementation is None


def decode_compile_options(settings: Sampling, device: torch.device, partitioned: bool) -> dict[str, Any] | None:
    """torch.compile's options for the static decoder's step (``None``: eager): CUDA graphs on a GPU
    (:data:`rlhf.models.decoding.GPU_COMPILE`), inductor on a CPU for ``static_compiled``
    (:data:`rlhf.models.decoding.CPU_COMPILE`; ``static`` stays eager there), eager for a model ``partitioned`` over
    processes."""
    if partitioned:
        return None
    if device.type == "cuda":
        return decoding.GPU_COMPILE
    asked = settings.generation if settings.generation != "auto" else auto_choices.pick("algo.generation", device.type)
    return decoding.CPU_COMPILE if asked == "static_compiled" else None


def eager_layers(cache_implementation: str | None = None) -> contextlib.AbstractContextManager:
    """A block in which compiled layers run eagerly (``torch.compiler.set_stance("force_eager")``), for transformers'
    ``generate`` (see the module's docstring), unless its ``cache_implementation`` is ``static``: then transformers
    compiles decoding itself, whole."""
    if cache_implementation is not None:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@torch.no_grad()
def sample(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_generations: int,
           seed: int | None, settings: Sampling) -> dict[str, Any]:
    """``num_generations`` completions per prompt of the left-padded ``input_ids`` (greedy when ``seed`` is None:
    one each), in eval mode without gradients, the random streams left as they were: ``prompt_ids``/``prompt_mask``
    ``[N, P]`` (left-padded), ``completion_ids``/``completion_mask`` ``[N, C]`` (right-padded; the mask covers the
    tokens up to and including EOS), ``truncated [N]`` (no EOS within ``max_new_tokens``), and the decoded
    ``completions`` (list of N strings). ``model`` as the hardware strategy wrapped it."""
    policy = extract_model_from_parallel(model)
    training = policy.training
    policy.eval()
    ids = input_ids.repeat_interleave(num_generations, 0)
    mask = attention_mask.repeat_interleave(num_generations, 0)
    options: dict[str, Any] = {"do_sample": False} if seed is None else {
        "do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
    if settings.cache_implementation is not None:  # "static": one cache of the longest length, which lets
        options["cache_implementation"] = settings.cache_implementation  # transformers compile decoding on a GPU
    config = transformers.GenerationConfig(max_new_tokens=settings.max_new_tokens, pad_token_id=settings.pad_id,
                                           eos_token_id=list(settings.eos_ids) or None, **options)
    devices = [ids.device] if ids.device.type == "cuda" else []
    partitioned = sharded(policy)  # before the block gathers it
    static = uses_static_decoding(settings, ids.device, partitioned)
    try:  # FSDP2's and ZeRO-3's parameters gathered once for the whole rollout, not at every token
        with torch.random.fork_rng(devices=devices), gathered_for_generation(model, settings.gather) as still_sharded:
            if seed is not None:
                torch.manual_seed(seed)
            # synced_gpus where the forward passes are still collectives: a process whose completions ended
            # keeps stepping until every process is done
            if static and not still_sharded:  # a process steps alone: no collective in its forward passes
                out = decoding.decode(
                    policy, ids, mask, settings.max_new_tokens, settings.pad_id, settings.eos_ids, seed is not None,
                    settings.temperature, settings.top_k, settings.top_p, settings.check_every_tokens,
                    compile_options=decode_compile_options(settings, ids.device, partitioned),
                    bucket_tokens=decoding.BUCKET_TOKENS if ids.device.type == "cuda" else decoding.CPU_BUCKET_TOKENS)
            else:  # layers compiled for training run eagerly (eager_layers)
                # none of the model's own sampling defaults (the module docstring)
                with plain_defaults(policy), eager_layers(settings.cache_implementation):
                    out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                          synced_gpus=still_sharded)
    finally:
        policy.train(training)
    completion = out[:, ids.shape[1]:]
    is_eos = torch.isin(completion, torch.tensor(settings.eos_ids, dtype=completion.dtype, device=completion.device))
    ended = is_eos.any(-1)
    first_eos = torch.where(ended, is_eos.float().argmax(-1), torch.full_like(ended, completion.shape[1],
                                                                             dtype=torch.long))
    positions = torch.arange(completion.shape[1], device=completion.device)
    completion_mask = (positions.unsqueeze(0) <= first_eos.unsqueeze(1)).long()
    completion = torch.where(completion_mask.bool(), completion, torch.full_like(completion, settings.pad_id))
    texts = [settings.tokenizer.decode(row[:n], skip_special_tokens=True)
             for row, n in zip(completion.tolist(), completion_mask.sum(-1).tolist())]
    return {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": completion,
            "completion_mask": completion_mask, "truncated": ~ended, "completions": texts}


def stop_ids(tokenizer: Any, model: torch.nn.Module | None = None) -> tuple[int, ...]:
    """The token ids a completion ends at: the tokenizer's EOS, then every id of the model's generation config's
    ``eos_token_id`` (one id or a list: Qwen2.5's ``<|im_end|>`` and ``<|endoftext|>``, Llama 3's ``<|eot_id|>``
    and ``<|end_of_text|>``), each once."""
    ids = [tokenizer.eos_token_id]
    config = getattr(extract_model_from_parallel(model), "generation_config", None) if model is not None else None
    more = getattr(config, "eos_token_id", None)
    ids += more if isinstance(more, (list, tuple)) else [more]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


@contextlib.contextmanager
def plain_defaults(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model.generation_config`` is transformers' plain one: a ``generate`` call gets only the
    settings it is given and transformers' neutral defaults, never those of the model's ``generation_config.json``
    (which is put back after)."""
    # a PeftModel hands its generate to the transformers model inside it, which keeps a generation config of its own
    inner = model.get_base_model() if hasattr(model, "get_base_model") else None
    holders = [m for m in (model, inner) if m is not None and hasattr(m, "generation_config")]
    own = [m.generation_config for m in holders]
    for holder in holders:
        holder.generation_config = transformers.GenerationConfig()
    try:
        yield
    finally:
        for holder, config in zip(holders, own):
            holder.generation_config = config


def sharded(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is partitioned over processes (an FSDP2 DTensor, a ZeRO-3 parameter):
    then every forward pass is a collective."""
    return any(hasattr(p, "ds_id") or hasattr(p, "to_local") for p in model.parameters())


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module, enabled: bool = True) -> Iterator[bool]:
    """The parameters of ``model`` (as the strategy wrapped it: a DeepSpeed engine, an FSDP2 module, or a plain one)
    gathered once, and kept whole until the block ends, instead of each unit's gathered at every forward pass and
    freed after it: generating ``T`` tokens then costs one all-gather of the model, not ``T``; the forward passes
    inside are no collectives. Yields whether the parameters stay sharded after all (then generation must be
    synced across processes: ``synced_gpus``), which is the case only where the strategy's internals are not the
    ones this was written for (a warning says so). Memory: the whole model in the compute dtype on each process for
    the length of the block. Generate with the unwrapped model inside it. ``enabled=False``: nothing is gathered
    (a model that fits only sharded), and the block yields whether generation must be synced."""
    if not enabled:
        yield sharded(getattr(model, "module", model))
        return
    offload = _zero3_offload(model)
    if offload is not None:
        with _zero3_gathered(model.module, offload) as still_sharded:
            yield still_sharded
        return
    model = getattr(model, "module", model)  # DDP's, or a stage 1/2 engine's, whole module
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield sharded(model)
        return
    saved = []
    try:
        # FSDP2 decides at its first forward (lazy init) that the root keeps its parameters after forward; run it
        # now, before the settings are read, or a first forward inside this block would skip that for good
        units[0]._get_fsdp_state()._lazy_init()  # units[0]: the outermost unit, the root
        for unit in units:  # what set_reshard_after_forward changes, to put back as the strategy set it
            state = unit._get_fsdp_state()
            saved.append((state, state._auto_reshard_after_forward,
                          [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
    except AttributeError:  # another torch's FSDP2 internals: gather per forward pass, as without this
        log.warning("FSDP2's internals differ in this torch: generation gathers the parameters at every token")
        yield True
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield False
    finally:
        for unit, (state, auto, meshes) in zip(units, saved):
            state._auto_reshard_after_forward = auto
            for group, mesh in zip(state._fsdp_param_groups, meshes):
                group.post_forward_mesh_info = mesh
            unit.reshard()


def _zero3_offload(model: torch.nn.Module):
    """The object that holds the ZeRO-3 hooks of a DeepSpeed engine ``model`` (which gather each module's
    parameters before its forward and release them after), or None where ``model`` is no ZeRO-3 engine."""
    partitions_weights = getattr(model, "zero_optimization_partition_weights", None)  # a DeepSpeed engine's
    if partitions_weights is None or not partitions_weights():
        return None
    optimizer = model.optimizer  # stage 3's optimizer holds them; an engine without optimizer: the offload itself
    return getattr(optimizer, "parameter_offload", optimizer)


@contextlib.contextmanager
def _zero3_gathered(module: torch.nn.Module, offload) -> Iterator[bool]:
    """ZeRO-3: every parameter of ``module`` gathered (``deepspeed.zero.GatheredParameters``) and the engine's
    per-module hooks taken off for the block, so that no forward pass inside gathers or releases anything; the hooks
    put back as the engine made them before the parameters are partitioned again."""
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload

    needed = ("_remove_module_hooks", "setup_zero_stage3_hooks", "forward_hooks", "backward_hooks")
    if not all(hasattr(offload, name) for name in needed):
        log.warning("DeepSpeed's ZeRO-3 internals differ in this version: generation gathers each layer at every token")
        yield True
        return
    stack = list(parameter_offload.FWD_MODULE_STACK)  # setting the hooks up again pushes the module once more
    ids = {m: m.ds_id for m in module.modules() if hasattr(m, "ds_id")}  # setting up numbers the modules anew
    parameters = list(module.parameters())
    with deepspeed.zero.GatheredParameters(parameters):
        try:
            offload._remove_module_hooks()
            offload.forward_hooks.clear()  # removed handles: setting up appends new ones
            offload.backward_hooks.clear()
            yield False
        finally:
            offload.setup_zero_stage3_hooks()
            parameter_offload.FWD_MODULE_STACK[:] = stack
            for submodule, ds_id in ids.items():  # the numbers the coordinator's recorded trace knows them by
                submodule.ds_id = ds_id
            for parameter in parameters:  # no module runs now: none holds a parameter (they are released next)
                getattr(parameter, "ds_active_sub_modules", set()).clear()
