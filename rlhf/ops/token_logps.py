"""The log-probability of given next tokens, ``log_softmax(logits)[..., index]``, in one pass over the logits.

Every log-likelihood method (SFT, the DPO family, KTO, the online algorithms) turns the output layer's logits
``[B, T, V]`` into the log-probability of one token per position. Written with autograd's own operators that costs
several full ``[B, T, V]`` tensors: a float32 copy of bfloat16 logits, ``logsumexp``'s temporaries, and in the
backward pass the softmax, the gather's scattered zeros, a slice's zeros and a cast back, each a pass over memory
as large as the logits. :func:`selective_log_softmax` does the same arithmetic a block of positions at a time,
each block small enough to stay in cache, with a backward pass of its own that writes the gradient once:

    d logp[b, t] / d logits[b, t, v] = 1[v = index[b, t]] - softmax(logits[b, t])[v]

(the gradient of a log-softmax; the saved per-position ``logsumexp`` gives the softmax back). The values are
those of the autograd formula it replaces, ``x.gather(-1, index) - x.logsumexp(-1)`` with ``x = logits.float()``,
bit for bit, and so are the greedy tokens and the gradient: each position's reduction over the vocabulary is the
same, and the two terms of the gradient are added in the same two roundings (tested). ``python benchmarks/logps_kernels.py`` on the 2-core CPU at ``[16, 49, 32000]`` (the benchmark's 100m
short DPO batch), forward and backward: 176 ms -> 82 ms in float32, 247 ms -> 62 ms from bfloat16 logits.

Both functions take a sampling ``temperature`` ``T``: the log-probabilities are then those of ``softmax(logits / T)``,
the policy an online algorithm samples from (the division happens block by block, in float32, and the backward pass
carries its ``1 / T``), so the ratio, the KL and the entropy belong to the policy that sampled. ``T = 1`` divides by
nothing: the values and gradients above are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bytes of float32 values per block: a few MiB stay in a CPU's caches (measured best between 2 and 8 MiB at
# V = 4096 to 32000); on a GPU, where each block costs about ten kernel launches, larger blocks, yet small beside
# the logits: a block's float32 temporaries are what the pass adds to the peak memory.
BLOCK_BYTES_CPU = 2 * 2**20
BLOCK_BYTES_GPU = 64 * 2**20


def selective_log_softmax(logits: Tensor, index: Tensor, start: int = 0, with_argmax: bool = False,
                          temperature: float = 1.0) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(logits[:, start:start + L].float() / temperature, -1)`` at ``index`` (``[B, L]``): the float32
    log-probability ``[B, L]`` of each given token, from logits ``[B, T, V]`` of any float dtype (``L <= T -
    start``; positions outside the window get a zero gradient). With ``with_argmax``, also the ``[B, L]`` argmax
    of each position's logits (the greedy token), found on the same pass."""
    if logits.dim() != 3 or index.dim() != 2 or index.shape[0] != logits.shape[0] \
            or start < 0 or start + index.shape[1] > logits.shape[1]:
        raise ValueError(f"logits {list(logits.shape)} and index {list(index.shape)} from position {start}: expected "
                         "[B, T, V] and [B, L] with start + L <= T")
    _check_temperature(temperature)
    logps, argmax = _LogSoftmaxAt.apply(logits, index, start, with_argmax, float(temperature))
    return (logps, argmax) if with_argmax else logps


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: the logits are divided by it, so it must be > 0")


def _blocks(batch: int, length: int, vocab: int, device: torch.device):
    """``(rows, positions)`` slices that cover ``[batch, length]``, each of at most the device's block size in
    float32 values: several whole rows per block where one row fits, else parts of one row."""
    budget = (BLOCK_BYTES_CPU if device.type == "cpu" else BLOCK_BYTES_GPU) // (4 * max(vocab, 1))
    if length == 0:
        return
    if budget >= length:
        step = max(1, budget // length)
        for b in range(0, batch, step):
            yield slice(b, b + step), slice(0, length)
    else:
        step = max(1, budget)
        for b in range(batch):
            for t in range(0, length, step):
                yield slice(b, b + 1), slice(t, t + step)


class _LogSoftmaxAt(torch.autograd.Function):
    """:func:`selective_log_softmax`'s forward and backward, block by block (:func:`_blocks`)."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, start: int, with_argmax: bool, temperature: float
                ) -> tuple[Tensor, Tensor]:
        batch, length = index.shape
        window = logits[:, start:start + length]
        logps = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logps)
        argmax = torch.empty(batch, length if with_argmax else 0, dtype=torch.long, device=logits.device)
        for rows, positions in _blocks(batch, length, logits.shape[-1], logits.device):
            block = window[rows, positions].float()
            if temperature != 1:
                block = block / temperature
            block_lse = torch.logsumexp(block, dim=-1)
            lse[rows, positions] = block_lse
            logps[rows, positions] = block.gather(-1, index[rows, positions].unsqueeze(-1)).squeeze(-1) - block_lse
            if with_argmax:
                argmax[rows, positions] = block.argmax(-1)
        ctx.save_for_backward(logits, index, lse)
        ctx.start, ctx.temperature = start, temperature
        ctx.mark_non_differentiable(argmax)
        return logps, argmax

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None):
        logits, index, lse = ctx.saved_tensors
        start, temperature, (batch, length) = ctx.start, ctx.temperature, index.shape
        grad = torch.empty_like(logits)
        grad[:, :start].zero_()
        grad[:, start + length:].zero_()
        window = grad[:, start:start + length]
        source = logits[:, start:start + length]
        for rows, positions in _blocks(batch, length, logits.shape[-1], logits.device):
            g = grad_logps[rows, positions].unsqueeze(-1)
            block = source[rows, positions].float()
            if temperature != 1:  # d/d logits of f(logits / T) is f' / T: carried by g
                block, g = block / temperature, g / temperature
            # -g * softmax, then +g at the given token: the same two roundings as autograd's logsumexp and gather
            block = (block - lse[rows, positions].unsqueeze(-1)).exp_().mul_(-g)
            block.scatter_add_(-1, index[rows, positions].unsqueeze(-1), g)
            window[rows, positions] = block
        return grad, None, None, None, None


# The float32 logits of one tile of :func:`linear_log_softmax`: rows x a chunk of the vocabulary. A tile is a
# matrix product of ``rows x H`` hidden states against a ``chunk x H`` slice of the weight: each row block reads the
# whole weight once, so the tiles take as many rows as fit beside a chunk of at least ``MIN_VOCAB_CHUNK`` entries
# (all of a batch's rows, unless it has more than ``bytes / 4 / MIN_VOCAB_CHUNK``). ``python
# benchmarks/logps_kernels.py --fused`` on the 2-core CPU, forward and backward at bench.py's shapes: 4 MiB tiles as
# fast as 16 or faster (up to 1.2x at vocabulary 32,000), 64 MiB up to 1.6x slower than 16 (out of cache).
LINEAR_TILE_BYTES_CPU = 4 * 2**20
LINEAR_TILE_BYTES_GPU = 64 * 2**20
MIN_VOCAB_CHUNK = 1024


def linear_log_softmax(hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, start: int = 0,
                       with_argmax: bool = False, with_entropy: bool = False, temperature: float = 1.0
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """The output layer and :func:`selective_log_softmax` in one: the float32 log-probability ``[B, L]`` of each
    token of ``index`` under ``logits = hidden @ weight.T + bias`` at positions ``start .. start + L`` of
    ``hidden`` (``[B, T, H]``), the ``[B, L]`` greedy tokens (empty unless ``with_argmax``) and the ``[B, L]``
    entropy of each position's distribution, without gradient (empty unless ``with_entropy``). The ``[B, T, V]``
    logits and their gradient never exist: the logits are computed a tile at a time (:func:`tile_shape`: rows x a
    chunk of the vocabulary), each row's logsumexp and greedy token carried from chunk to chunk, and the backward
    pass computes each tile again (one more output-layer product, only for the rows whose log-probability has a
    gradient: prompt and padding positions cost nothing there) and writes each chunk's weight gradient once per row
    block. The products run in the dtype the output layer would use: autocast's where it is on, else the weight's.
    The values equal those of :func:`selective_log_softmax` on ``F.linear``'s logits up to rounding (bit for bit
    with one tile; tested), at the same ``temperature`` (each tile's float32 logits divided by it, the entropy
    that of ``softmax(logits / temperature)``)."""
    if hidden.dim() != 3 or index.dim() != 2 or index.shape[0] != hidden.shape[0] \
            or start < 0 or start + index.shape[1] > hidden.shape[1]:
        raise ValueError(f"hidden {list(hidden.shape)} and index {list(index.shape)} from position {start}: expected "
                         "[B, T, H] and [B, L] with start + L <= T")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    _check_temperature(temperature)
    return _LinearLogSoftmaxAt.apply(hidden, weight, bias, index, start, with_argmax, with_entropy, dtype,
                                     float(temperature))


def tile_shape(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """``(rows, vocabulary entries)`` of :func:`linear_log_softmax`'s tiles for ``rows`` rows on ``device``: at most
    the device's tile size in float32 (:data:`LINEAR_TILE_BYTES_CPU` / ``_GPU``), chunks of at least
    :data:`MIN_VOCAB_CHUNK` entries, and as many rows as then fit."""
    values = (LINEAR_TILE_BYTES_CPU if device.type == "cpu" else LINEAR_TILE_BYTES_GPU) // 4
    chunk = max(1, min(vocab, max(MIN_VOCAB_CHUNK, values // max(rows, 1))))
    return max(1, min(rows, values // chunk)), chunk


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return (torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()).float()


def _spans(total: int, step: int):
    for first in range(0, total, step):
        yield first, min(first + step, total)


class _LinearLogSoftmaxAt(torch.autograd.Function):
    """:func:`linear_log_softmax`'s forward and backward, tile by tile (:func:`tile_shape`)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, start: int,
                with_argmax: bool, with_entropy: bool, dtype: torch.dtype, temperature: float
                ) -> tuple[Tensor, Tensor, Tensor]:
        batch, length = index.shape
        device = hidden.device
        with torch.autocast(device.type, enabled=False):
            h = hidden[:, start:start + length].reshape(-1, hidden.shape[-1]).to(dtype)
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            tokens = index.reshape(-1)
            count, vocab = h.shape[0], w.shape[0]
            lse = torch.empty(count, dtype=torch.float32, device=device)
            target = torch.empty_like(lse)
            argmax = torch.zeros(count if with_argmax else 0, dtype=torch.long, device=device)
            entropy = torch.empty(count if with_entropy else 0, dtype=torch.float32, device=device)
            row_step, chunk = tile_shape(count, vocab, device)
            for r0, r1 in _spans(count, row_step):
                top = torch.full((r1 - r0,), -torch.inf, dtype=torch.float32, device=device)  # running max
                total = torch.zeros_like(top)  # running sum of exp(logit - top)
                best = torch.full_like(top, -torch.inf)  # the greedy token's logit so far
                weighted = torch.zeros_like(top)  # running sum of exp(logit - top) * logit: the entropy's
                row_tokens = tokens[r0:r1]
                for c0, c1 in _spans(vocab, chunk):
                    logits = _logits(h[r0:r1], w[c0:c1], None if b is None else b[c0:c1])
                    if temperature != 1:
                        logits = logits / temperature
                    chunk_max, chunk_arg = logits.max(-1)  # the first of equal maxima, as argmax
                    if with_argmax:
                        better = chunk_max > best  # strictly: an equal maximum of a later chunk is not the first
                        best = torch.where(better, chunk_max, best)
                        argmax[r0:r1] = torch.where(better, chunk_arg + c0, argmax[r0:r1])
                    new_top = torch.maximum(top, chunk_max)
                    scale, exps = (top - new_top).exp(), (logits - new_top.unsqueeze(-1)).exp()
                    total = total * scale + exps.sum(-1)
                    if with_entropy:  # H = logsumexp - sum(softmax * logits)
                        weighted = weighted * scale + (exps * logits).sum(-1)
                    top = new_top
                    inside = (row_tokens >= c0) & (row_tokens < c1)
                    picked = logits.gather(-1, (row_tokens - c0).clamp(0, c1 - c0 - 1).unsqueeze(-1)).squeeze(-1)
                    target[r0:r1] = torch.where(inside, picked, target[r0:r1])
                    del logits
                lse[r0:r1] = top + total.log()
                if with_entropy:
                    entropy[r0:r1] = lse[r0:r1] - weighted / total
            logps = target - lse
        ctx.save_for_backward(h, weight, bias, index, lse)  # the window's rows, in the products' dtype
        ctx.start, ctx.dtype, ctx.hidden, ctx.temperature = start, dtype, (hidden.shape, hidden.dtype), temperature
        argmax = argmax.view(batch, length if with_argmax else 0)
        entropy = entropy.view(batch, length if with_entropy else 0)
        ctx.mark_non_differentiable(argmax, entropy)
        return logps.view(batch, length), argmax, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None, _grad_entropy: Tensor | None):
        h, weight, bias, index, lse = ctx.saved_tensors
        start, dtype, (batch, length), (shape, hidden_dtype) = ctx.start, ctx.dtype, index.shape, ctx.hidden
        temperature = ctx.temperature
        device = h.device
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # a frozen output layer (LoRA elsewhere): no weight grad
        with torch.autocast(device.type, enabled=False):
            g_all = grad_logps.reshape(-1)
            live = g_all.nonzero().squeeze(-1)  # rows with a gradient: the others contribute exact zeros
            h, tokens, lse, g_all = h[live], index.reshape(-1)[live], lse[live], g_all[live]
            if temperature != 1:  # d/d logits of f(logits / T) is f' / T: carried by g
                g_all = g_all / temperature
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            count, vocab = h.shape[0], w.shape[0]
            grad_h = torch.zeros(h.shape, dtype=torch.float32, device=device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            row_step, chunk = tile_shape(count, vocab, device)
            for r0, r1 in _spans(count, row_step):
                g, row_tokens = g_all[r0:r1].unsqueeze(-1), tokens[r0:r1]
                for c0, c1 in _spans(vocab, chunk):
                    # d logp / d logits = 1[v = token] - softmax: -g * softmax, then +g at the token
                    block = _logits(h[r0:r1], w[c0:c1], None if b is None else b[c0:c1])
                    if temperature != 1:
                        block = block / temperature
                    block = (block - lse[r0:r1].unsqueeze(-1)).exp_().mul_(-g)
                    rows = ((row_tokens >= c0) & (row_tokens < c1)).nonzero().squeeze(-1)
                    block.index_put_((rows, row_tokens[rows] - c0), g[rows, 0], accumulate=True)
                    if grad_b is not None:
                        grad_b[c0:c1] += block.sum(0)
                    block = block.to(dtype)
                    if grad_h is not None:  # a product in dtype added into float32
                        grad_h[r0:r1].add_(block @ w[c0:c1])
                    if grad_w is not None and dtype == torch.float32:
                        grad_w[c0:c1].addmm_(block.t(), h[r0:r1])
                    elif grad_w is not None:
                        grad_w[c0:c1].add_(block.t() @ h[r0:r1])
                    del block
            grad_hidden = None
            if need_h:
                grad_hidden = torch.zeros(shape, dtype=hidden_dtype, device=device)
                window = torch.zeros(batch * length, shape[-1], dtype=hidden_dtype, device=device)
                window[live] = grad_h.to(hidden_dtype)
                grad_hidden[:, start:start + length] = window.view(batch, length, -1)
        return (grad_hidden, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)
