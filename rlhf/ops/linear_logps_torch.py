"""The output layer and the log-softmax at given tokens in one, written with torch operations: the plain-PyTorch
twin of :mod:`rlhf.ops.linear_logps_triton`, and what runs on a CPU and, unless ``algo.fused_output_layer=triton``,
on a GPU.

:class:`LinearLogSoftmaxTorch` takes ``N`` rows of hidden states ``[N, H]`` and one token per row, and gives each
row's float32 log-probability of its token under ``softmax((h @ W.T + b) / T)``, its greedy token and its entropy,
without the ``[N, V]`` logits ever existing whole: they are computed a tile at a time (:func:`tile_shape`), rows x a
chunk of the vocabulary, each row's running maximum, sum of exponentials and greedy token carried from chunk to
chunk (the online softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
arXiv:1805.02867). The backward pass computes each tile again and writes

    d logp / d logits = (1[v = token] - softmax(logits / T)[v]) / T

into it, then the tile's share of the gradients of the hidden states, the weight and the bias. It reads no value
back to the host (no ``nonzero``, no boolean mask, no ``item``): a row whose log-probability has no gradient gets a
zero gradient from the same arithmetic. :func:`rlhf.ops.token_logps.linear_log_softmax` is the public entry.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The float32 logits of one tile: rows x a chunk of the vocabulary. On a CPU a tile is a matrix product of
# ``rows x H`` hidden states against a ``chunk x H`` slice of the weight: each row block reads the whole weight once,
# so the tiles take as many rows as fit beside a chunk of at least ``MIN_VOCAB_CHUNK`` entries (all of a batch's
# rows, unless it has more than ``bytes / 4 / MIN_VOCAB_CHUNK``). ``python benchmarks/logps_kernels.py --fused`` on
# the 2-core CPU, forward and backward at bench.py's shapes: 4 MiB tiles as fast as 16 or faster (up to 1.2x at
# vocabulary 32,000), 64 MiB up to 1.6x slower than 16 (out of cache). On a GPU a tile is a block of rows over the
# WHOLE vocabulary (:func:`row_block`): few large matrix products, each row's sums over the vocabulary inside one
# product; ``LINEAR_TILE_BYTES_GPU`` bounds the float32 values of one block (the Triton kernel's block holds them in
# the products' dtype, half as many bytes in bfloat16).
LINEAR_TILE_BYTES_CPU = 4 * 2**20
LINEAR_TILE_BYTES_GPU = 256 * 2**20
# The torch operations' tiles on a GPU: rows x a chunk of the vocabulary of at most this many float32 bytes, the
# geometry the GPU check measured against the plain output layer (docs/gpu/2026-11-27-nvidia-h200-second-run.md), what
# algo.fused_output_layer=auto runs there until the Triton kernel's row blocks are measured.
TORCH_TILE_BYTES_GPU = 64 * 2**20
MIN_VOCAB_CHUNK = 1024


def row_block(rows: int, vocab: int, device: torch.device) -> int:
    """Rows per block where a block spans the whole vocabulary: at most the device's tile size in float32 values
    (at least one row), and blocks of equal size (``rows`` split into as few as fit, evenly)."""
    values = (LINEAR_TILE_BYTES_CPU if device.type == "cpu" else LINEAR_TILE_BYTES_GPU) // 4
    step = max(1, min(rows, values // max(vocab, 1)))
    blocks = -(-rows // step) if rows else 1
    return max(1, -(-rows // blocks))


def tile_shape(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """``(rows, vocabulary entries)`` of one tile of the torch operations for ``rows`` rows on ``device``: at most
    :data:`LINEAR_TILE_BYTES_CPU` (a CPU) or :data:`TORCH_TILE_BYTES_GPU` (a GPU) in float32, chunks of at least
    :data:`MIN_VOCAB_CHUNK` entries, and as many rows as then fit. (The Triton kernel's blocks: :func:`row_block`.)"""
    values = (LINEAR_TILE_BYTES_CPU if device.type == "cpu" else TORCH_TILE_BYTES_GPU) // 4
    chunk = max(1, min(vocab, max(MIN_VOCAB_CHUNK, values // max(rows, 1))))
    return max(1, min(rows, values // chunk)), chunk


def spans(total: int, step: int):
    """``(first, end)`` of consecutive blocks of ``step`` (the last one shorter) covering ``0 .. total``."""
    for first in range(0, total, step):
        yield first, min(first + step, total)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return (torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()).float()


class LinearLogSoftmaxTorch(torch.autograd.Function):
    """``apply(h [N, H], weight [V, H], bias [V] or None, tokens [N], with_argmax, with_entropy, dtype,
    temperature)`` -> ``(logps [N] float32, argmax [N] or [0], entropy [N] or [0])``, the products in ``dtype``
    (autocast's where it is on), tile by tile (:func:`tile_shape`)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, with_argmax: bool,
                with_entropy: bool, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
        device = hidden.device
        with torch.autocast(device.type, enabled=False):
            h, w, b = hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
            count, vocab = h.shape[0], w.shape[0]
            lse = torch.empty(count, dtype=torch.float32, device=device)
            target = torch.empty_like(lse)
            argmax = torch.zeros(count if with_argmax else 0, dtype=torch.long, device=device)
            entropy = torch.empty(count if with_entropy else 0, dtype=torch.float32, device=device)
            row_step, chunk = tile_shape(count, vocab, device)
            for r0, r1 in spans(count, row_step):
                top = torch.full((r1 - r0,), -torch.inf, dtype=torch.float32, device=device)  # running max
                total = torch.zeros_like(top)  # running sum of exp(logit - top)
                best = torch.full_like(top, -torch.inf)  # the greedy token's logit so far
                weighted = torch.zeros_like(top)  # running sum of exp(logit - top) * logit: the entropy's
                row_tokens = tokens[r0:r1]
                for c0, c1 in spans(vocab, chunk):
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
        ctx.save_for_backward(h, weight, bias, tokens, lse)  # the rows in the products' dtype
        ctx.dtype, ctx.hidden_dtype, ctx.temperature = dtype, hidden.dtype, temperature
        ctx.mark_non_differentiable(argmax, entropy)
        return target - lse, argmax, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None, _grad_entropy: Tensor | None):
        h, weight, bias, tokens, lse = ctx.saved_tensors
        dtype, temperature, device = ctx.dtype, ctx.temperature, h.device
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # a frozen output layer (LoRA elsewhere): no weight grad
        with torch.autocast(device.type, enabled=False):
            g_all = grad_logps.float()
            if temperature != 1:  # d/d logits of f(logits / T) is f' / T: carried by g
                g_all = g_all / temperature
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            count, vocab = h.shape[0], w.shape[0]
            grad_h = torch.zeros(h.shape, dtype=torch.float32, device=device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            row_step, chunk = tile_shape(count, vocab, device)
            for r0, r1 in spans(count, row_step):
                g, row_tokens = g_all[r0:r1].unsqueeze(-1), tokens[r0:r1]
                for c0, c1 in spans(vocab, chunk):
                    # d logp / d logits = 1[v = token] - softmax: -g * softmax, then +g at the token (0 where the
                    # token is in another chunk)
                    block = _logits(h[r0:r1], w[c0:c1], None if b is None else b[c0:c1])
                    if temperature != 1:
                        block = block / temperature
                    block = (block - lse[r0:r1].unsqueeze(-1)).exp_().mul_(-g)
                    inside = (row_tokens >= c0) & (row_tokens < c1)
                    block.scatter_add_(-1, (row_tokens - c0).clamp(0, c1 - c0 - 1).unsqueeze(-1),
                                       torch.where(inside.unsqueeze(-1), g, 0.0))
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
        return (None if grad_h is None else grad_h.to(ctx.hidden_dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)
