"""The Triton output layer (rlhf.ops.linear_logps_triton) on the CPU under Triton's interpreter, against a float64
reference and its torch twin; the scored-rows path; no host sync in either path's forward or backward.

Run by ``tests/ops/test_linear_logps_triton.py`` in a process of its own with ``TRITON_INTERPRET=1``: the
interpreter is chosen when ``triton`` is imported, which another test of the same process may have done first. To
run these alone: ``TRITON_INTERPRET=1 python -m pytest tests/ops/triton_interpreted_checks.py -n0``."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import rlhf.ops
from rlhf.ops import linear_logps_torch
from rlhf.ops.token_logps import linear_log_softmax

OPS = str(Path(rlhf.ops.__file__).parent)


@pytest.fixture(scope="module")
def kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter: TRITON_INTERPRET=1"
    from triton.runtime.interpreter import InterpretedFunction

    from rlhf.ops import linear_logps_triton  # triton missing: this fails, as a required test dependency must

    assert isinstance(linear_logps_triton._forward_rows, InterpretedFunction)
    return linear_logps_triton


def _reference(h, w, b, index, start, temperature, bf16):
    """float64 log_softmax(logits / T) at index, its argmax and entropy; with bf16, of the logits a bfloat16
    product gives (operands and result rounded to bfloat16)."""
    def rounded(x):  # to bfloat16's values, the gradient passed through in float64
        return x.double() + (x.to(torch.bfloat16).double() - x.double()).detach() if bf16 else x.double()

    h, w, b = (None if x is None else rounded(x) for x in (h, w, b))
    logits = rounded(torch.nn.functional.linear(h, w, b))
    x = logits[:, start:start + index.shape[1]] / temperature
    logp = x.log_softmax(-1)
    return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1), x.argmax(-1), -(logp.exp() * logp).sum(-1)


def _inputs(seed=0, vocab=37):
    torch.manual_seed(seed)
    h, w, b = torch.randn(3, 7, 6), torch.randn(vocab, 6), torch.randn(vocab)
    w[2], w[20], b[20] = torch.full((6,), 1.5), torch.full((6,), 1.5), b[2]  # entries 2 and 20 (blocks 0 and 1) ...
    h[1, 3] = 6.0  # ... tie for the largest logit at this position: the greedy token is the first, 2
    index, g = torch.randint(vocab, (3, 5)), torch.randn(3, 5)
    g[0, :2] = 0.0  # positions without a gradient (a completion mask's zeros)
    return h, w, b, index, g


def _run(fn, h0, w0, b0, g, bf16=False):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logps, argmax, entropy = fn(h, w, b)
    (logps * g).sum().backward()
    return logps.detach(), argmax, entropy, h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bf16,bias,temperature", [(False, True, 1.0), (False, False, 0.7), (True, True, 0.7),
                                                    (True, False, 1.0)],
                         ids=["fp32-bias", "fp32-T0.7", "bf16-autocast-bias-T0.7", "bf16-autocast"])
def test_the_kernel_gives_the_float64_values_argmax_entropy_and_gradients(kernel, monkeypatch, temperature, bias,
                                                                           bf16):
    """Vocabulary blocks of 16 over 37 entries (the last one short), row blocks of 4 over 15 rows (the last one
    short), a greedy token tied across blocks, a window from position 1, rows without a gradient: the float64
    log-probabilities, argmax, entropy and gradients of hidden states, weight and bias, at T = 1 and 0.7."""
    monkeypatch.setattr(kernel, "VOCAB_BLOCK", 16)
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", 4 * 37 * 4)  # 4 rows of float32 logits
    assert linear_logps_torch.row_block(15, 37, torch.device("cpu")) == 4
    h, w, b, index, g = _inputs()
    b = b if bias else None
    got = _run(lambda h, w, b: linear_log_softmax(h, w, b, index, start=1, with_argmax=True, with_entropy=True,
                                                  temperature=temperature, triton=True), h, w, b, g, bf16)
    want = _run(lambda h, w, b: _reference(h, w, b, index, 1, temperature, bf16), h, w, b, g)
    assert got[0].dtype == torch.float32 and got[3].dtype == h.dtype and got[4].dtype == w.dtype
    assert torch.equal(got[1], want[1]) and got[1][1, 2] == 2  # the first of the tied maxima
    values = {"atol": 1e-5, "rtol": 1e-5} if not bf16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got[0], want[0].float(), **values)
    torch.testing.assert_close(got[2], want[2].float(), **values)
    grads = {"atol": 1e-5, "rtol": 1e-5} if not bf16 else {"atol": 2e-2, "rtol": 2e-2}  # bf16 products
    for mine, theirs in zip(got[3:], want[3:]):
        if theirs is not None:
            torch.testing.assert_close(mine, theirs.float(), **grads)
    assert not got[3][:, [0, 6]].any() and not got[3][0, 1:3].any()  # outside the window; rows without gradient
    if temperature != 1:  # the temperature changes the answer: the test can tell
        assert (got[0] - _reference(h, w, b, index, 1, 1.0, bf16)[0]).abs().max() > 0.1


def test_the_kernel_and_its_torch_twin_agree_in_bf16(kernel, monkeypatch):
    """Under bf16 autocast, the kernel's one product per row block and the torch path's tiles: the same values and
    greedy tokens, gradients to bf16's rounding."""
    monkeypatch.setattr(kernel, "VOCAB_BLOCK", 16)
    h, w, b, index, g = _inputs(seed=3)
    outs = [_run(lambda h, w, b, t=t: linear_log_softmax(h, w, b, index, start=1, with_argmax=True, triton=t),
                 h, w, b, g, bf16=True) for t in (True, False)]
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][1], outs[1][1])
    for mine, theirs in zip(outs[0][3:], outs[1][3:]):
        torch.testing.assert_close(mine, theirs, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
def test_scored_rows_give_the_full_paths_answers_there_and_zeros_elsewhere(kernel, monkeypatch, triton):
    """rows: only the named positions are computed (their hidden states gathered); their values, greedy tokens,
    entropy and gradients are the full path's with the other positions' gradient zero; 0 elsewhere."""
    monkeypatch.setattr(kernel, "VOCAB_BLOCK", 16)
    h, w, b, index, g = _inputs(seed=1)
    rows = torch.tensor([2, 3, 4, 6, 9, 10, 14])  # flat into [3, 5]
    chosen = torch.zeros(15, dtype=torch.bool).index_fill(0, rows, True).view(3, 5)
    full = _run(lambda h, w, b: linear_log_softmax(h, w, b, index, start=1, with_argmax=True, with_entropy=True,
                                                   temperature=0.7, triton=triton), h, w, b, g * chosen)
    part = _run(lambda h, w, b: linear_log_softmax(h, w, b, index, start=1, with_argmax=True, with_entropy=True,
                                                   temperature=0.7, triton=triton, rows=rows), h, w, b, g)
    for mine, theirs in zip(part[:3], full[:3]):
        assert not mine[~chosen].any()
        torch.testing.assert_close(mine[chosen], theirs[chosen], atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(part[3:], full[3:]):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    assert not part[3][:, 0].any()  # position 0 is outside the window


def _count_syncs(monkeypatch) -> Counter:
    """Calls that read a value back to the host (``nonzero``, ``bool()``, ``item``, ``tolist``, a boolean mask as
    an index), made by the code of ``rlhf/ops``."""
    counts: Counter = Counter()

    def counting(name, original, check=lambda args: True):
        def counted(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(OPS) and check(args):
                counts[name] += 1
            return original(*args, **kwargs)
        return counted

    def boolean_index(args):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)

    for name in ("nonzero", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", counting("torch.nonzero", torch.nonzero))
    for name in ("__getitem__", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, counting(f"boolean {name}", getattr(torch.Tensor, name),
                                                         boolean_index))
    return counts


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("scored_rows", [True, False], ids=["scored-rows", "every-row"])
def test_no_host_sync_in_the_forward_or_the_backward(kernel, monkeypatch, triton, scored_rows):
    """Neither pass reads a value back to the host: rows without a gradient are computed (zeros), not found."""
    monkeypatch.setattr(kernel, "VOCAB_BLOCK", 16)
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", 4 * 37 * 4)  # several tiles and row blocks
    monkeypatch.setattr(linear_logps_torch, "MIN_VOCAB_CHUNK", 16)
    h0, w0, b0, index, g = _inputs(seed=2)
    h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))
    rows = torch.tensor([1, 2, 7, 8, 13]) if scored_rows else None
    counts = _count_syncs(monkeypatch)
    logps = linear_log_softmax(h, w, b, index, start=1, with_argmax=True, with_entropy=True, temperature=0.7,
                               rows=rows, triton=triton)[0]
    forward = dict(counts)
    (logps * g).sum().backward()
    backward = dict(counts - Counter(forward))
    monkeypatch.undo()
    assert h.grad is not None and w.grad.abs().sum() > 0 and b.grad.abs().sum() > 0
    assert forward == {} and backward == {}, (forward, backward)


def _backward_memory(kernel, monkeypatch, rows_per_block: int, vocab: int = 512, width: int = 64, rows: int = 64):
    """The Triton function's gradients of ``rows`` float32 hidden states and a float32 ``[vocab, width]`` weight
    with bfloat16 products (autocast's), in row blocks of ``rows_per_block``, and the bytes torch allocated in its
    backward pass: (gradients, peak, total)."""
    from tests.ops.live_bytes import LiveBytes

    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", rows_per_block * vocab * 4)
    assert linear_logps_torch.row_block(rows, vocab, torch.device("cpu")) == rows_per_block
    torch.manual_seed(0)
    h = torch.randn(rows, width, requires_grad=True)
    w = (torch.randn(vocab, width) / 8).requires_grad_()
    tokens, g = torch.randint(vocab, (rows,)), torch.randn(rows)
    logps = kernel.LinearLogSoftmaxTriton.apply(h, w, None, tokens, False, False, torch.bfloat16, 0.7)[0]
    loss = (logps * g).sum()
    with LiveBytes() as seen:
        loss.backward()
    return (h.grad, w.grad), seen.peak, seen.total


def test_the_weight_gradient_is_added_in_place_at_any_number_of_row_blocks(kernel, monkeypatch):
    """bfloat16 products in 1 and 8 row blocks: the same gradients, and the backward pass allocates no ``[V, H]``
    product per block beside the float32 accumulator of the weight's gradient: its bytes allocated in all do not grow
    with the blocks, its peak does not grow, and its peak is what the memory preflight counts for the layer
    (:func:`rlhf.telemetry.memory_preflight.output_layer_held`). Red when each block's product is made whole and then
    added (``(a @ b).float()`` then ``add_``: 6 bytes x V x H more per block)."""
    from rlhf.telemetry.memory_preflight import output_layer_held

    one, one_peak, one_total = _backward_memory(kernel, monkeypatch, rows_per_block=64)
    eight, eight_peak, eight_total = _backward_memory(kernel, monkeypatch, rows_per_block=8)
    for mine, theirs in zip(eight, one):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    vocab_by_width = 512 * 64
    assert eight_total - one_total < vocab_by_width, (one_total, eight_total)  # < a quarter of one float32 [V, H]
    assert eight_peak <= one_peak, (one_peak, eight_peak)
    for rows_per_block, peak in ((64, one_peak), (8, eight_peak)):
        monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", rows_per_block * 512 * 4)
        predicted = output_layer_held(64, 512, 64, torch.device("cpu"), product_bytes=2, weight_bytes=4,
                                      hidden_bytes=4, trains=True, triton=True)
        assert 0.9 < peak / predicted < 1.1, (rows_per_block, peak, predicted)
