"""The output layer and the log-softmax at given tokens in one, for a GPU: large matrix products and a Triton kernel.

:class:`LinearLogSoftmaxTriton` computes what its plain-PyTorch twin
:class:`~rlhf.ops.linear_logps_torch.LinearLogSoftmaxTorch` computes (tested against each other and a float64
reference, on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``), shaped for a GPU:

- the logits of a block of rows over the WHOLE vocabulary come from one matrix product (cuBLAS) in the products'
  dtype (:func:`~rlhf.ops.linear_logps_torch.row_block` rows at a time: one or a few blocks at a training batch's
  size), into one buffer that is reused;
- one kernel pass over each row of that block (:func:`_forward_rows`) finds the row's logsumexp (running maximum and
  sum of exponentials over vocabulary blocks: Milakov & Gimelshein 2018, arXiv:1805.02867), its token's logit, its
  greedy token (the first of equal maxima) and its entropy, all of ``logits / T`` in float32;
- the backward pass computes a block's logits again, and one kernel pass (:func:`_backward_rows`) overwrites them in
  place with their gradient ``(1[v = token] - softmax(logits / T)[v]) * g / T``; then one product gives the block's
  hidden-state gradient (every vocabulary entry summed inside it, rounded once) and one adds its share of the
  weight's gradient into a float32 accumulator in place (:func:`add_product`: ``addmm_`` for float32 products, a
  kernel of its own, :func:`_add_product_rows`, for bfloat16 and float16 ones, whose float32 results torch's matrix
  products cannot add into a float32 tensor). No ``[V, H]`` product of a block exists beside the accumulator.

Nothing is read back to the host: a row without a gradient (``g = 0``) gets zeros from the same arithmetic. The
``[N, V]`` float32 logits never exist; the memory above the inputs is one block of logits in the products' dtype,
and in the backward pass the weight's float32 gradient.
Only long-standing ``triton.language`` operations are used (loads and stores with masks, ``max``/``min``/``sum``
reductions, ``exp``/``log``, ``where``), so that the Triton that ships with a GPU build of torch compiles them.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlhf.ops.linear_logps_torch import row_block, spans

# Vocabulary entries one kernel program reads at a time (a power of two): 4,096 bfloat16 values are 8 KiB, 16 per
# thread of 8 warps. Smaller where the vocabulary is.
VOCAB_BLOCK = 4096
# The tile of the weight's gradient one program of _add_product_rows adds into: vocabulary entries x hidden units,
# rows of the block read BLOCK_R at a time (tl.dot wants every side at least 16)
GRAD_BLOCK_V, GRAD_BLOCK_H, GRAD_BLOCK_R = 128, 64, 32
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter (on a CPU), chosen at its import


@triton.jit
def _forward_rows(logits_ptr, tokens_ptr, lse_ptr, logps_ptr, argmax_ptr, entropy_ptr, vocab, temperature,
                  BLOCK: tl.constexpr, WITH_ARGMAX: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One program per row of a ``[rows, vocab]`` contiguous block of logits: ``lse``, ``logp`` of the row's token,
    and (where asked) its argmax and entropy, of ``logits / temperature`` in float32."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * vocab
    token = tl.load(tokens_ptr + row)
    top = float("-inf")  # running maximum
    total = 0.0  # running sum of exp(x - top)
    weighted = 0.0  # running sum of exp(x - top) * x: the entropy's
    target = 0.0  # the token's x
    best = 0  # the first index of the running maximum
    for first in range(0, vocab, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32) / temperature
        block_max = tl.max(x, 0)
        if WITH_ARGMAX:  # strictly greater: an equal maximum of a later block is not the first
            block_arg = tl.min(tl.where(x == block_max, cols, vocab), 0)
            best = tl.where(block_max > top, block_arg, best)
        new_top = tl.maximum(top, block_max)
        scale = tl.exp(top - new_top)
        exps = tl.exp(x - new_top)  # 0 outside the vocabulary (x = -inf)
        total = total * scale + tl.sum(exps, 0)
        if WITH_ENTROPY:
            weighted = weighted * scale + tl.sum(exps * tl.where(inside, x, 0.0), 0)
        target += tl.sum(tl.where(cols == token, x, 0.0), 0)
        top = new_top
    lse = top + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(logps_ptr + row, target - lse)
    if WITH_ARGMAX:
        tl.store(argmax_ptr + row, best.to(tl.int64))
    if WITH_ENTROPY:  # H = lse - sum(softmax * x)
        tl.store(entropy_ptr + row, lse - weighted / total)


@triton.jit
def _backward_rows(logits_ptr, tokens_ptr, lse_ptr, grad_ptr, vocab, temperature, BLOCK: tl.constexpr):
    """One program per row: the row's logits overwritten with ``(1[v = token] - softmax(x)[v]) * g / T``, ``x =
    logits / T`` in float32, stored in the logits' dtype."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * vocab
    token = tl.load(tokens_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_ptr + row) / temperature
    for first in range(0, vocab, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) / temperature
        grad = tl.where(cols == token, g, 0.0) - tl.exp(x - lse) * g
        tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _add_product_rows(total_ptr, a_ptr, b_ptr, rows, vocab, width, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_R: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """``total[V, H] += a[rows, V].T @ b[rows, H]`` in place, ``total`` float32 and ``a``, ``b`` contiguous in one
    16-bit dtype: one program per ``[BLOCK_V, BLOCK_H]`` tile of ``total``, the product summed in float32 over the
    rows (``tl.dot``), then added to the tile once. ``FLOAT32_DOT``: the operands converted to float32 first (exact
    for 16-bit values), for Triton's interpreter, whose ``tl.dot`` multiplies bfloat16 operands as the integers that
    hold their bits."""
    first_v = tl.program_id(0) * BLOCK_V
    first_h = tl.program_id(1) * BLOCK_H
    vs = first_v + tl.arange(0, BLOCK_V)
    hs = first_h + tl.arange(0, BLOCK_H)
    product = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for first in range(0, rows, BLOCK_R):
        rs = first + tl.arange(0, BLOCK_R)
        row_inside = rs[:, None] < rows
        a = tl.load(a_ptr + rs[:, None].to(tl.int64) * vocab + vs[None, :], mask=row_inside & (vs[None, :] < vocab),
                    other=0.0)
        b = tl.load(b_ptr + rs[:, None].to(tl.int64) * width + hs[None, :], mask=row_inside & (hs[None, :] < width),
                    other=0.0)
        if FLOAT32_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        product += tl.dot(tl.trans(a), b)
    tile = total_ptr + vs[:, None].to(tl.int64) * width + hs[None, :]
    inside = (vs[:, None] < vocab) & (hs[None, :] < width)
    tl.store(tile, tl.load(tile, mask=inside, other=0.0) + product, mask=inside)


def _launch(vocab: int) -> dict:
    block = min(VOCAB_BLOCK, triton.next_power_of_2(max(vocab, 1)))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


def _on(device: torch.device):
    """The device a kernel launches on: Triton launches on the current CUDA device, which must be the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _product(h: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    """``h @ weight.T + bias`` into ``out`` (one matrix product in the operands' dtype)."""
    return torch.addmm(bias, h, weight.t(), out=out) if bias is not None else torch.mm(h, weight.t(), out=out)


def add_product(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``total += a.T @ b`` in place: ``total`` ``[V, H]`` float32, ``a`` ``[rows, V]`` and ``b`` ``[rows, H]`` in
    one dtype. float32 operands: ``addmm_`` (the matrix product adds into ``total``); bfloat16 or float16 ones:
    :func:`_add_product_rows`, which sums each tile's product in float32 and adds it where it lies, so that no
    ``[V, H]`` product exists beside ``total``."""
    if a.dtype == torch.float32:
        return total.addmm_(a.t(), b)
    a, b = a.contiguous(), b.contiguous()
    rows, vocab, width = a.shape[0], a.shape[1], b.shape[1]
    grid = (triton.cdiv(vocab, GRAD_BLOCK_V), triton.cdiv(width, GRAD_BLOCK_H))
    _add_product_rows[grid](total, a, b, rows, vocab, width, BLOCK_V=GRAD_BLOCK_V, BLOCK_H=GRAD_BLOCK_H,
                            BLOCK_R=GRAD_BLOCK_R, FLOAT32_DOT=INTERPRETED, num_warps=4)
    return total


class LinearLogSoftmaxTriton(torch.autograd.Function):
    """The same ``apply`` as :class:`~rlhf.ops.linear_logps_torch.LinearLogSoftmaxTorch`: ``(h [N, H], weight
    [V, H], bias [V] or None, tokens [N], with_argmax, with_entropy, dtype, temperature)`` -> ``(logps [N],
    argmax [N] or [0], entropy [N] or [0])``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, with_argmax: bool,
                with_entropy: bool, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
        device = hidden.device
        with torch.autocast(device.type, enabled=False), _on(device):
            h, w = hidden.to(dtype).contiguous(), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            tokens = tokens.contiguous()
            count, vocab = h.shape[0], w.shape[0]
            lse = torch.empty(count, dtype=torch.float32, device=device)
            logps = torch.empty_like(lse)
            argmax = torch.empty(count if with_argmax else 0, dtype=torch.long, device=device)
            entropy = torch.empty(count if with_entropy else 0, dtype=torch.float32, device=device)
            step = row_block(count, vocab, device)
            buffer = torch.empty(min(step, count), vocab, dtype=dtype, device=device)
            for r0, r1 in spans(count, step):
                logits = _product(h[r0:r1], w, b, buffer[:r1 - r0])
                _forward_rows[(r1 - r0,)](
                    logits, tokens[r0:], lse[r0:], logps[r0:], argmax[r0:] if with_argmax else lse,
                    entropy[r0:] if with_entropy else lse, vocab, temperature,
                    WITH_ARGMAX=with_argmax, WITH_ENTROPY=with_entropy, **_launch(vocab))
            del buffer
        ctx.save_for_backward(h, weight, bias, tokens, lse)  # the rows in the products' dtype
        ctx.dtype, ctx.hidden_dtype, ctx.temperature = dtype, hidden.dtype, temperature
        ctx.mark_non_differentiable(argmax, entropy)
        return logps, argmax, entropy

    @staticmethod
    def backward(ctx, grad_logps: Tensor, _grad_argmax: Tensor | None, _grad_entropy: Tensor | None):
        h, weight, bias, tokens, lse = ctx.saved_tensors
        dtype, temperature, device = ctx.dtype, ctx.temperature, h.device
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # a frozen output layer (LoRA elsewhere): no weight grad
        with torch.autocast(device.type, enabled=False), _on(device):
            g = grad_logps.float().contiguous()
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            count, vocab = h.shape[0], w.shape[0]
            grad_h = torch.empty(h.shape, dtype=dtype, device=device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
            step = row_block(count, vocab, device)
            buffer = torch.empty(min(step, count), vocab, dtype=dtype, device=device)
            for r0, r1 in spans(count, step):
                logits = _product(h[r0:r1], w, b, buffer[:r1 - r0])
                _backward_rows[(r1 - r0,)](logits, tokens[r0:], lse[r0:], g[r0:], vocab, temperature,
                                           **_launch(vocab))
                grad = logits  # overwritten in place: d logp / d logits, times the rows' g
                if grad_b is not None:
                    grad_b += grad.sum(0, dtype=torch.float32)
                if grad_h is not None:
                    torch.mm(grad, w, out=grad_h[r0:r1])
                if grad_w is not None:
                    add_product(grad_w, grad, h[r0:r1])
            del buffer
        return (None if grad_h is None else grad_h.to(ctx.hidden_dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)
