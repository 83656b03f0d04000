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
same, and the two terms of the gradient are added in the same two roundings (tested). ``python scripts/logps_kernels.py`` on the 2-core CPU at ``[16, 49, 32000]`` (the benchmark's 100m
short DPO batch), forward and backward: 176 ms -> 82 ms in float32, 247 ms -> 62 ms from bfloat16 logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bytes of float32 values per block: a few MiB stay in a CPU's caches (measured best between 2 and 8 MiB at
# V = 4096 to 32000); on a GPU, where each block costs about ten kernel launches, larger blocks, yet small beside
# the logits: a block's float32 temporaries are what the pass adds to the peak memory.
BLOCK_BYTES_CPU = 2 * 2**20
BLOCK_BYTES_GPU = 64 * 2**20


def selective_log_softmax(logits: Tensor, index: Tensor, start: int = 0, with_argmax: bool = False
                          ) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(logits[:, start:start + L].float(), -1)`` at ``index`` (``[B, L]``): the float32
    log-probability ``[B, L]`` of each given token, from logits ``[B, T, V]`` of any float dtype (``L <= T -
    start``; positions outside the window get a zero gradient). With ``with_argmax``, also the ``[B, L]`` argmax
    of each position's logits (the greedy token), found on the same pass."""
    if logits.dim() != 3 or index.dim() != 2 or index.shape[0] != logits.shape[0] \
            or start < 0 or start + index.shape[1] > logits.shape[1]:
        raise ValueError(f"logits {list(logits.shape)} and index {list(index.shape)} from position {start}: expected "
                         "[B, T, V] and [B, L] with start + L <= T")
    logps, argmax = _LogSoftmaxAt.apply(logits, index, start, with_argmax)
    return (logps, argmax) if with_argmax else logps


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
    def forward(ctx, logits: Tensor, index: Tensor, start: int, with_argmax: bool) -> tuple[Tensor, Tensor]:
        batch, length = index.shape
        window = logits[:, start:start + length]
        logps = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logps)
        argmax = torch.empty(batch, length if with_argmax else 0, dtype=torch.long, device=logits.device)
        for rows, positions in _blocks(batch, length, logits.shape[-1], logits.device):
            block = window[rows, positions].float()
            block_lse = torch.logsumexp(block, dim=-1)
            lse[rows, positions] = block_lse
            logps[rows, positions] = block.gather(-1, index[rows, positions].unsqueeze(-1)).squeeze(-1) - block_lse
            if with_argmax:
                argmax[rows, positions] = block.argmax(-1)
        ctx.save_for_backward(logits, index, lse)
        ctx.start = start
        ctx.mark_non_differentiable(argmax)
        return logps, argmax

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None):
        logits, index, lse = ctx.saved_tensors
        start, (batch, length) = ctx.start, index.shape
        grad = torch.empty_like(logits)
        grad[:, :start].zero_()
        grad[:, start + length:].zero_()
        window = grad[:, start:start + length]
        source = logits[:, start:start + length]
        for rows, positions in _blocks(batch, length, logits.shape[-1], logits.device):
            g = grad_logps[rows, positions].unsqueeze(-1)
            # -g * softmax, then +g at the given token: the same two roundings as autograd's logsumexp and gather
            block = (source[rows, positions].float() - lse[rows, positions].unsqueeze(-1)).exp_().mul_(-g)
            block.scatter_add_(-1, index[rows, positions].unsqueeze(-1), g)
            window[rows, positions] = block
        return grad, None, None, None


# Output-layer rows per block of :func:`linear_log_softmax`, in bytes of float32 logits. Each block is a matrix
# product against the whole ``[V, H]`` weight, so a block must have enough rows for that product to run at the
# matrix units' speed rather than at the speed of reading the weight (``python scripts/logps_kernels.py --fused``
# on the 2-core CPU, forward and backward: 4 MiB blocks up to 2.3x slower than 16 at vocabularies of 16k-32k; 64 MiB
# 5-15% faster than 16 at 32,000 but up to 1.6x slower at 4,096 and 16,384 in bf16).
LINEAR_BLOCK_BYTES_CPU = 16 * 2**20
LINEAR_BLOCK_BYTES_GPU = 64 * 2**20


def linear_log_softmax(hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, start: int = 0,
                       with_argmax: bool = False) -> tuple[Tensor, Tensor]:
    """The output layer and :func:`selective_log_softmax` in one: the float32 log-probability ``[B, L]`` of each
    token of ``index`` under ``logits = hidden @ weight.T + bias`` at positions ``start .. start + L`` of
    ``hidden`` (``[B, T, H]``), and the ``[B, L]`` greedy tokens (empty unless ``with_argmax``). The ``[B, T, V]``
    logits and their gradient never exist: each block of rows gets its logits, uses them and frees them, and the
    backward pass computes each block's logits again (one more output-layer product, only for the rows whose
    log-probability has a gradient: prompt and padding positions cost nothing there). The products run in the
    dtype the output layer would use: autocast's where it is on (bf16 on bf16 weights and inputs), else the
    weight's. The values equal those of :func:`selective_log_softmax` on ``F.linear``'s logits up to the matrix
    product's rounding (the same product, in blocks of rows; tested)."""
    if hidden.dim() != 3 or index.dim() != 2 or index.shape[0] != hidden.shape[0] \
            or start < 0 or start + index.shape[1] > hidden.shape[1]:
        raise ValueError(f"hidden {list(hidden.shape)} and index {list(index.shape)} from position {start}: expected "
                         "[B, T, H] and [B, L] with start + L <= T")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return _LinearLogSoftmaxAt.apply(hidden, weight, bias, index, start, with_argmax, dtype)


def rows_per_block(vocab: int, device: torch.device) -> int:
    """Rows of :func:`linear_log_softmax`'s blocks: the device's block size (:data:`LINEAR_BLOCK_BYTES_CPU` /
    ``_GPU``) in float32 logits."""
    return max(1, (LINEAR_BLOCK_BYTES_CPU if device.type == "cpu" else LINEAR_BLOCK_BYTES_GPU) // (4 * max(vocab, 1)))


def _row_blocks(rows: int, vocab: int, device: torch.device):
    step = rows_per_block(vocab, device)
    for r in range(0, rows, step):
        yield slice(r, r + step)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return (torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()).float()


class _LinearLogSoftmaxAt(torch.autograd.Function):
    """:func:`linear_log_softmax`'s forward and backward, block by block of rows (:func:`_row_blocks`)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, start: int,
                with_argmax: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        batch, length = index.shape
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden[:, start:start + length].reshape(-1, hidden.shape[-1]).to(dtype)
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            flat = index.reshape(-1, 1)
            logps = torch.empty(h.shape[0], dtype=torch.float32, device=hidden.device)
            lse = torch.empty_like(logps)
            argmax = torch.empty(h.shape[0] if with_argmax else 0, dtype=torch.long, device=hidden.device)
            for rows in _row_blocks(h.shape[0], w.shape[0], hidden.device):
                logits = _logits(h[rows], w, b)
                lse[rows] = torch.logsumexp(logits, dim=-1)
                logps[rows] = logits.gather(-1, flat[rows]).squeeze(-1) - lse[rows]
                if with_argmax:
                    argmax[rows] = logits.argmax(-1)
                del logits
        ctx.save_for_backward(h, weight, bias, index, lse)  # the window's rows, in the products' dtype
        ctx.start, ctx.dtype, ctx.hidden = start, dtype, (hidden.shape, hidden.dtype)
        ctx.mark_non_differentiable(argmax)
        return logps.view(batch, length), argmax.view(batch, length if with_argmax else 0)

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None):
        h, weight, bias, index, lse = ctx.saved_tensors
        start, dtype, (batch, length), (shape, hidden_dtype) = ctx.start, ctx.dtype, index.shape, ctx.hidden
        with torch.autocast(h.device.type, enabled=False):
            g_all = grad_logps.reshape(-1)
            live = g_all.nonzero().squeeze(-1)  # rows with a gradient: the others contribute exact zeros
            h = h[live]
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            flat, lse, g_all = index.reshape(-1, 1)[live], lse[live], g_all[live]
            need_h, need_w, need_b = ctx.needs_input_grad[:3]  # a frozen output layer (LoRA elsewhere): no weight grad
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
            for rows in _row_blocks(h.shape[0], w.shape[0], h.device):
                g = g_all[rows].unsqueeze(-1)
                # d logp / d logits = 1[v = token] - softmax: -g * softmax, then +g at the token
                block = (_logits(h[rows], w, b) - lse[rows].unsqueeze(-1)).exp_().mul_(-g)
                block.scatter_add_(-1, flat[rows], g)
                if grad_b is not None:
                    grad_b += block.sum(0)
                block = block.to(dtype)
                if need_h:
                    grad_h[rows] = block @ w
                if need_w and dtype == torch.float32:
                    grad_w.addmm_(block.t(), h[rows])
                elif need_w:  # a bf16 product added into float32: no float32 [V, H] temporary per block
                    grad_w.add_(block.t() @ h[rows])
                del block
            grad_hidden = None
            if need_h:
                grad_hidden = torch.zeros(shape, dtype=hidden_dtype, device=h.device)
                window = torch.zeros(batch * length, shape[-1], dtype=hidden_dtype, device=h.device)
                window[live] = grad_h.to(hidden_dtype)
                grad_hidden[:, start:start + length] = window.view(batch, length, -1)
        return (grad_hidden, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)
