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

from rlhf.ops.linear_logps_torch import LinearLogSoftmaxTorch, tile_shape  # noqa: F401  (tile_shape: public here)

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


def linear_log_softmax(hidden: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor, start: int = 0,
                       with_argmax: bool = False, with_entropy: bool = False, temperature: float = 1.0,
                       rows: Tensor | None = None, triton: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The output layer and :func:`selective_log_softmax` in one: the float32 log-probability ``[B, L]`` of each
    token of ``index`` under ``logits = hidden @ weight.T + bias`` at positions ``start .. start + L`` of
    ``hidden`` (``[B, T, H]``), the ``[B, L]`` greedy tokens (empty unless ``with_argmax``) and the ``[B, L]``
    entropy of each position's distribution, without gradient (empty unless ``with_entropy``). The ``[B, T, V]``
    logits and their gradient never exist: the logits are computed a block at a time and computed again in the
    backward pass, which reads nothing back to the host. The products run in the dtype the output layer would use:
    autocast's where it is on, else the weight's. The values equal those of :func:`selective_log_softmax` on
    ``F.linear``'s logits up to rounding (bit for bit on the CPU with one tile; tested), at the same
    ``temperature`` (the float32 logits divided by it, the entropy that of ``softmax(logits / temperature)``).

    ``rows`` (optional, ``[N]`` long, on ``hidden``'s device): the only positions to compute, as flat indices into
    the ``[B, L]`` grid (``b * L + l``); their hidden states are gathered (``index_select``), and the answers are
    scattered back into ``[B, L]``, 0 elsewhere (and no gradient there). ``triton``: compute with the Triton kernel
    (:mod:`rlhf.ops.linear_logps_triton`: one matrix product over the whole vocabulary per block of rows) or with
    torch operations (:mod:`rlhf.ops.linear_logps_torch`: tiles of rows x vocabulary chunks on a CPU); ``None``:
    the kernel on a CUDA device where ``triton`` imports, torch operations elsewhere (:func:`uses_triton`)."""
    if hidden.dim() != 3 or index.dim() != 2 or index.shape[0] != hidden.shape[0] \
            or start < 0 or start + index.shape[1] > hidden.shape[1]:
        raise ValueError(f"hidden {list(hidden.shape)} and index {list(index.shape)} from position {start}: expected "
                         "[B, T, H] and [B, L] with start + L <= T")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.long):
        raise ValueError(f"rows {list(rows.shape)} {rows.dtype}: expected a 1-D long tensor of flat indices into "
                         "[B, L]")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    _check_temperature(temperature)
    (batch, length), (_, positions, width) = index.shape, hidden.shape
    if rows is None:
        h, tokens = hidden[:, start:start + length].reshape(-1, width), index.reshape(-1)
    else:  # row b * L + l of the grid is row b * T + start + l of hidden
        h = hidden.reshape(-1, width).index_select(0, rows + rows // max(length, 1) * (positions - length) + start)
        tokens = index.reshape(-1).index_select(0, rows)
    function = _implementation(hidden.device, triton)
    logps, argmax, entropy = function.apply(h, weight, bias, tokens, with_argmax, with_entropy, dtype,
                                            float(temperature))
    if rows is not None:
        logps, argmax, entropy = (x.new_zeros(batch * length).index_copy(0, rows, x) if wanted else x
                                  for x, wanted in ((logps, True), (argmax, with_argmax), (entropy, with_entropy)))
    return (logps.view(batch, length), argmax.view(batch, length if with_argmax else 0),
            entropy.view(batch, length if with_entropy else 0))


def triton_kernel():
    """:class:`~rlhf.ops.linear_logps_triton.LinearLogSoftmaxTriton`, or ``None`` where ``triton`` does not
    import."""
    try:
        from rlhf.ops import linear_logps_triton
    except ImportError:
        return None
    return linear_logps_triton.LinearLogSoftmaxTriton


def uses_triton(device: torch.device) -> bool:
    """Whether :func:`linear_log_softmax` computes with the Triton kernel on ``device`` by default: on CUDA, where
    ``triton`` imports."""
    return device.type == "cuda" and triton_kernel() is not None


def _implementation(device: torch.device, triton: bool | None):
    if triton is False or (triton is None and not uses_triton(device)):
        return LinearLogSoftmaxTorch
    kernel = triton_kernel()
    if kernel is None:
        raise ValueError("linear_log_softmax(triton=True) needs the triton package, which does not import here: "
                         "pip install triton (or triton=None: torch operations where it is missing)")
    return kernel
