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

The prompts are left-padded further, to a multiple of ``bucket_tokens``, so that the cache's length (prompt plus
``max_new_tokens``), and with it the compiled step's shapes, takes few values over a run: each new one is a new
graph. A padded position is masked out and moves no position id, so the completions are the same. The cache and the
compiled step are kept per model and shape (:data:`_DECODERS`, the :data:`KEPT_DECODERS` last used), so a later
call with the same shapes replays the same graphs; the cache's memory (the keys and values of ``batch x (prompt + max_new_tokens)`` positions in every
layer, as a static cache of ``generate`` holds) stays allocated between calls.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CHECK_EVERY_TOKENS = 8  # the host looks whether every completion has ended once per this many tokens
BUCKET_TOKENS = 64  # the prompts (and so the cache) are padded to a multiple of this many positions
# torch.compile's options for the decode step on a GPU: CUDA graphs (one launch per step), shapes fixed per bucket
GPU_COMPILE: dict[str, Any] = {"mode": "reduce-overhead", "dynamic": False, "fullgraph": False}


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


# By model, then by (rows, cache length, device, compile options): the caches and compiled steps kept between calls,
# at most KEPT_DECODERS a model (the least recently used goes, with its key-value cache; the compiled code and its CUDA
# graphs belong to the decode step's code, shared by every decoder of the process: past torch's recompile limit, 8
# shapes of batch and cache length, the step runs eagerly).
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
    padded_len = bucketed(prompt_len, bucket_tokens)
    extra = padded_len - prompt_len
    ids = torch.nn.functional.pad(input_ids, (extra, 0), value=pad_id)
    mask = torch.nn.functional.pad(attention_mask.long(), (extra, max_new_tokens), value=1)
    mask[:, :extra] = 0  # the bucket's padding, before the prompts' own
    decoder = decoder_for(model, rows, padded_len + max_new_tokens, device, compile_options)
    prompt_positions = (mask[:, :padded_len].cumsum(-1) - 1).clamp(min=0)  # a padded position's id is never seen
    last = prompt_positions[:, -1:]  # each row's last prompt position [N, 1]
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    running = torch.ones(rows, dtype=torch.bool, device=device)
    with torch.compiler.set_stance("force_eager"):  # the prefill, eager (compiled layers too): its length varies
        logits = decoder.forward(ids, mask, prompt_positions)
    steps = max_new_tokens
    for t in range(max_new_tokens):
        chosen = choose(logits, sampled, temperature, top_k, top_p)
        chosen = torch.where(running, chosen, torch.full_like(chosen, pad_id))
        tokens[:, t] = chosen
        if len(eos_ids):
            running &= ~torch.isin(chosen, eos)
        if t + 1 == max_new_tokens or ((t + 1) % check_every_tokens == 0 and not bool(running.any())):
            steps = t + 1
            break
        if decoder.compiled and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are read: a new replay
        logits = decoder.step(chosen.unsqueeze(1), mask, last + (t + 1))
    tokens = tokens[:, :steps]
    ended = torch.isin(tokens, eos) if len(eos_ids) else torch.zeros_like(tokens, dtype=torch.bool)
    first_end = torch.where(ended.any(-1), ended.float().argmax(-1) + 1, torch.full_like(ended[:, 0], steps,
                                                                                       dtype=torch.long))
    return torch.cat([input_ids, tokens[:, :int(first_end.max())]], dim=1)
