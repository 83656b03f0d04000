"""A decoding loop of this package's own (:func:`decode`): one key-value cache of fixed shape for a whole batch, a
decode step that can be compiled once (CUDA graphs on a GPU: ``torch.compile(mode="reduce-overhead")``), and the
end of the completions checked every few tokens instead of at every one.

transformers' ``generate`` asks the device whether every sequence has ended after each token: a host sync per token,
which leaves a GPU idle between small decode steps. Here the tokens stay on the device and the host looks only every
``check_every_tokens`` (one sync per that many tokens); the steps run past the last end are at most that many less
one, and their tokens are padding, cut off again, so the output is what ``generate`` returns: the prompts followed
by the completions, each row's tokens after its end replaced by ``pad_id``, as many columns as the longest one took.

Tokens are chosen as ``generate`` chooses them (:func:`choose`): the argmax of the logits (greedy), or a draw of
``torch.multinomial`` from ``softmax`` of the logits divided by the temperature, restricted to the ``top_k``
likeliest tokens and then to the nucleus of mass ``top_p`` (Holtzman et al. 2019, "The Curious Case of Neural Text
Degeneration", https://arxiv.org/abs/1904.09751), in that order, one draw per step for every row: with the same
seed, the same tokens as ``generate``'s sampling (tested on a CPU).

The cache's length (prompt plus ``max_new_tokens``) is rounded up to a multiple of ``bucket_tokens``, so that it
takes few values over a run (few caches to keep; on a GPU, few CUDA graphs to record); the positions past the last
token are never reached (the causal mask hides every position after the current one), so the completions are the
same, and the prefill runs the prompts' own positions only. The caches are kept per model and shape
(:data:`_DECODERS`, the :data:`KEPT_DECODERS` last used); the cache's memory (the keys and values of
``batch x cache length`` positions in every layer, as a static cache of ``generate`` holds) stays allocated between
calls, and goes with its decoder.

One compiled graph for every decoder: the compiled step is one function for all decoders (and all models of one
architecture: the graph reads the parameters as inputs), compiled with symbolic shapes, so a new bucket or batch
size runs the graph already built (a batch of one row is specialised by torch: one graph more). Two things make
them symbolic (https://docs.pytorch.org/docs/stable/torch.compiler_dynamic_shapes.html): ``dynamic=True``, for the
numbers transformers reads from the cache (its length), and the tensors' rows and lengths marked
(:func:`compilable`). transformers marks the cache's tensors with ``torch._dynamo.mark_static_address`` (fixed
addresses, which CUDA graphs need for tensors written in place); where torch's default guards on those addresses
(older torch), every new cache would be a new graph, past torch's recompile limit (8) an eager step, and the guards
would keep evicted caches alive. Here they are marked again, unguarded: a new cache is no recompile (on a GPU, CUDA
graphs record the step once more for its addresses), and an evicted decoder's cache is freed. Tested on a CPU with
inductor, cycling twice through more buckets than :data:`KEPT_DECODERS`.

On a CPU (``algo.generation=static_compiled``: :data:`CPU_COMPILE`, inductor's C++, buckets of
:data:`CPU_BUCKET_TOKENS`) the compiled decoder gives ``generate``'s completions, and at GRPO's embedded default
(256 rows, 16 new tokens, 1 thread) samples 1.04-1.16x as fast as ``generate`` in CPU time after a compile of 30-35 s
(``benchmarks/cpu_decoding.py``, 2026-11-29, a 2-core AMD EPYC): sampling there is a third of a step, its matrix
products the same kernels either way.

Compiled or not, the decoder runs a model whose layers ``hardware.compile=layers`` compiled: eagerly where the
step is not compiled (``torch.compiler.set_stance("force_eager")``, as for the prefill, whose length varies: a
layer's graph with a cache would be specialised on its index, one graph per layer), inside the step's own graph
where it is.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CHECK_EVERY_TOKENS = 8  # the host looks whether every completion has ended once per this many tokens
BUCKET_TOKENS = 64  # the cache's length (prompt + new tokens) is rounded up to a multiple of this many positions
# ... on a CPU, where the attention over the cache's unreached positions is paid for, not hidden behind a GPU's idle
# time, and a new length compiles nothing (the shapes are symbolic). Measured at GRPO's embedded default (2026-11-29,
# 1 thread, CPU seconds a rollout): 0.30 against 0.34 compiled, 0.33 against 0.38 eager, buckets of 8 against 64
CPU_BUCKET_TOKENS = 8
# torch.compile's options for the decode step on a GPU: CUDA graphs (one launch per step), the shapes symbolic (one
# graph for every bucket and batch size: see the module's docstring)
GPU_COMPILE: dict[str, Any] = {"mode": "reduce-overhead", "dynamic": True, "fullgraph": False}
# ... and on a CPU: inductor's generated C++ (no CUDA graphs there), the shapes symbolic as on a GPU
CPU_COMPILE: dict[str, Any] = {"backend": "inductor", "dynamic": True, "fullgraph": False}


def restrict(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The float32 ``logits [N, V]`` divided by ``temperature`` (when it is not 1), then every token outside the
    ``top_k`` likeliest (0: off; ties at the k-th value stay) and then outside the nucleus (``top_p < 1``: the
    likeliest tokens whose probabilities reach ``top_p``; counted from the least likely up, a token goes when the
    mass up to and including it is at most ``1 - top_p``; the likeliest always stays) set to ``-inf``. A new tensor."""
    scores = logits / temperature if temperature != 1.0 else logits.clone()
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        mass_up_to = ascending.softmax(-1).cumsum(-1)
        drop = mass_up_to <= 1.0 - top_p
        drop[..., -1] = False  # the likeliest token stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def choose(logits: Tensor, sampled: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The next token of each row ``[N]`` from the float32 ``logits [N, V]``: the argmax, or (``sampled``) one
    draw from ``softmax(restrict(logits, ...))`` with torch's global generator."""
    if not sampled:
        return torch.argmax(logits, dim=-1)
    probabilities = restrict(logits, temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probabilities, num_samples=1).squeeze(1)


def bucketed(length: int, bucket_tokens: int) -> int:
    """``length`` rounded up to a multiple of ``bucket_tokens`` (1: unchanged)."""
    return -(-length // bucket_tokens) * bucket_tokens


class StaticDecoder:
    """One model's key-value cache of ``max_cache_len`` positions for ``batch_size`` rows and its decode step (one
    token per row, positions given), compiled with ``compile_options`` (``None``: eager)."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int, compile_options: dict[str, Any] | None) -> None:
        from transformers import StaticCache

        self._model = weakref.ref(model)  # the kept decoders are the model's (below): no reference back to it
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.step: Callable[[Tensor, Tensor, Tensor], Tensor] = self.forward
        self.compiled = compile_options is not None
        if compile_options is not None:
            self.step = torch.compile(self.forward, **compile_options)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """The float32 logits ``[N, V]`` at the last position of ``input_ids [N, L]``, its keys and values written
        into the cache after those it holds; ``attention_mask`` covers the whole cache ``[N, max_cache_len]``."""
        out = self._model()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()


def compilable(cache: Any, *inputs: Tensor) -> None:
    """Mark a filled ``cache`` and a decode step's ``inputs`` so that one compiled step serves every decoder: each
    tensor a cache layer holds keeps its static address, unguarded (a new cache is no recompile, and no guard keeps an
    evicted one alive; transformers marks them with torch's default, guarded in older torch); every dimension of the
    ``inputs``, and the rows and length of the keys and values (dimensions 0 and 2 of ``[rows, heads, length, head
    size]``), symbolic from the first compile (``maybe_mark_dynamic``: torch still specialises a dimension of one
    element). ``dynamic=True`` alone left them fixed (measured: a recompile at the second batch size)."""
    for layer in getattr(cache, "layers", ()):
        for name, held in vars(layer).items():
            if isinstance(held, Tensor):
                torch._dynamo.mark_static_address(held, guard=False)
                if name in ("keys", "values"):
                    torch._dynamo.maybe_mark_dynamic(held, [0, 2])
    for tensor in inputs:
        torch._dynamo.maybe_mark_dynamic(tensor, list(range(tensor.dim())))


# By model, then by (rows, cache length, device, compile options): the caches kept between calls, at most
# KEPT_DECODERS a model (the least recently used goes, with its key-value cache; the compiled code and its CUDA graphs
# belong to the decode step's code, one graph shared by every decoder of the process: see the module's docstring).
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StaticDecoder]] = weakref.WeakKeyDictionary()
KEPT_DECODERS = 4


def decoder_for(model: torch.nn.Module, batch_size: int, max_cache_len: int, device: torch.device,
                compile_options: dict[str, Any] | None) -> StaticDecoder:
    """The kept :class:`StaticDecoder` of ``model`` for these shapes (built on first use), its cache emptied."""
    key = (batch_size, max_cache_len, str(device), repr(sorted((compile_options or {}).items())),
           compile_options is None)
    held = _DECODERS.setdefault(model, {})
    if key in held:
        held[key] = held.pop(key)  # the most recently used last
    else:
        while len(held) >= KEPT_DECODERS:
            held.pop(next(iter(held)))
        held[key] = StaticDecoder(model, max_cache_len, compile_options)
        log.info("decoding with a static key-value cache of %d positions x %d rows%s", max_cache_len, batch_size,
                 f", the decode step compiled ({compile_options})" if compile_options is not None else "")
    decoder = held[key]
    decoder.cache.reset()
    return decoder


@torch.no_grad()
def decode(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, pad_id: int,
           eos_ids: Sequence[int], sampled: bool, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           check_every_tokens: int = CHECK_EVERY_TOKENS, bucket_tokens: int = BUCKET_TOKENS,
           compile_options: dict[str, Any] | None = None) -> Tensor:
    """What ``model.generate`` returns for the left-padded ``input_ids``/``attention_mask [N, P]``: ``[N, P + C]``,
    the prompts and then the completions (at most ``max_new_tokens``; a row's tokens after the first of ``eos_ids``
    are ``pad_id``; ``C`` the longest completion's length), tokens chosen by :func:`choose` (``sampled``: drawn with
    torch's global generator, as ``generate`` draws them). ``model`` in eval mode, unwrapped (its own forward, with
    whatever autocast a strategy put on it). See the module for the cache, the buckets and ``check_every_tokens``."""
    if max_new_tokens < 1 or check_every_tokens < 1 or bucket_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, check_every_tokens={check_every_tokens} and "
                         f"bucket_tokens={bucket_tokens} must each be at least 1")
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    cache_len = bucketed(prompt_len + max_new_tokens, bucket_tokens)
    # the prompt, the completion's positions, then the bucket's, never reached (the causal mask hides what lies ahead)
    mask = torch.nn.functional.pad(attention_mask.long(), (0, cache_len - prompt_len), value=0)
    mask[:, prompt_len:prompt_len + max_new_tokens] = 1
    decoder = decoder_for(model, rows, cache_len, device, compile_options)
    prompt_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # a padded position's id is never seen
    last = prompt_positions[:, -1:]  # each row's last prompt position [N, 1]
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    running = torch.ones(rows, dtype=torch.bool, device=device)
    with torch.compiler.set_stance("force_eager"):  # the prefill, eager (compiled layers too): its length varies
        logits = decoder.forward(input_ids, mask, prompt_positions)
    if decoder.compiled:  # the cache's tensors exist from the prefill on
        compilable(decoder.cache, mask)
    steps = max_new_tokens
    # an eager step runs compiled layers eagerly too; a compiled one holds them in its own graph
    with contextlib.nullcontext() if decoder.compiled else torch.compiler.set_stance("force_eager"):
        for t in range(max_new_tokens):
            chosen = choose(logits, sampled, temperature, top_k, top_p)
            chosen = torch.where(running, chosen, torch.full_like(chosen, pad_id))
            tokens[:, t] = chosen
            if len(eos_ids):
                running &= ~torch.isin(chosen, eos)
            if t + 1 == max_new_tokens or ((t + 1) % check_every_tokens == 0 and not bool(running.any())):
                steps = t + 1
                break
            step_ids, step_positions = chosen.unsqueeze(1), last + (t + 1)
            if decoder.compiled:
                compilable(None, step_ids, step_positions)
                if device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are read: a new replay
            logits = decoder.step(step_ids, mask, step_positions)
    tokens = tokens[:, :steps]
    ended = torch.isin(tokens, eos) if len(eos_ids) else torch.zeros_like(tokens, dtype=torch.bool)
    first_end = torch.where(ended.any(-1), ended.float().argmax(-1) + 1, torch.full_like(ended[:, 0], steps,
                                                                                       dtype=torch.long))
    return torch.cat([input_ids, tokens[:, :int(first_end.max())]], dim=1)
