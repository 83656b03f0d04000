import pytest
import torch

from rlhf.ops import linear_logps_torch, token_logps
from rlhf.ops.token_logps import selective_log_softmax


def autograd_reference(logits, index, start):
    """The same quantity written with autograd's own operators (what the module replaces)."""
    x = logits[:, start:start + index.shape[1]].float()
    return torch.gather(x, -1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1), x.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_bytes", [4 * 11, 4 * 11 * 3, 2**20], ids=["part-of-a-row", "rows", "all"])
@pytest.mark.parametrize("start,length", [(0, 5), (1, 4), (2, 2)])
def test_values_argmax_and_gradient_equal_autograds_bit_for_bit(monkeypatch, dtype, block_bytes, start, length):
    """Blocks of part of a row, several rows or everything; a window of positions (the others get zero gradient);
    float32 and bfloat16 logits: the same values, greedy tokens and gradient as autograd's logsumexp and gather."""
    monkeypatch.setattr(token_logps, "BLOCK_BYTES_CPU", block_bytes)  # 11 float32 values = one position
    torch.manual_seed(0)
    base = (torch.randn(3, 6, 11) * 4).to(dtype)
    base[0, 1, :3] = base[0, 1].max()  # a tie: the first of the largest, as torch.argmax picks
    index = torch.randint(11, (3, length))
    weight = torch.randn(3, length)
    weight[1, 0] = 0.0  # a masked position, as a completion mask makes
    outputs = []
    for fn in (autograd_reference, lambda x, i, s: selective_log_softmax(x, i, start=s, with_argmax=True)):
        logits = base.clone().requires_grad_()
        logps, argmax = fn(logits, index, start)
        (logps * weight).sum().backward()
        outputs.append((logps.detach(), argmax, logits.grad))
    (want, want_argmax, want_grad), (got, got_argmax, got_grad) = outputs
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    assert torch.equal(got, want) and torch.equal(got_argmax, want_argmax) and torch.equal(got_grad, want_grad)
    outside = torch.ones(6, dtype=torch.bool)
    outside[start:start + length] = False
    assert not got_grad[:, outside].any()  # positions outside the window: zero gradient


def test_equals_a_gather_of_log_softmax():
    logits, index = torch.randn(2, 5, 11), torch.randint(11, (2, 5))
    expected = logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, index), expected, atol=1e-6)


def test_no_argmax_unless_asked_and_bad_shapes_are_refused():
    logits = torch.randn(2, 5, 11)
    assert isinstance(selective_log_softmax(logits, torch.zeros(2, 5, dtype=torch.long)), torch.Tensor)
    with pytest.raises(ValueError, match=r"from position 1: expected \[B, T, V\] and \[B, L\] with start \+ L <= T"):
        selective_log_softmax(logits, torch.zeros(2, 5, dtype=torch.long), start=1)
    with pytest.raises(ValueError, match="expected"):
        selective_log_softmax(logits, torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="expected"):  # [N, V] rows: one batch row of positions is [1, N, V]
        selective_log_softmax(logits[0], torch.zeros(5, dtype=torch.long))


def test_the_saved_tensors_are_the_logits_not_a_float32_copy():
    """Memory: what the backward pass keeps is the bfloat16 logits themselves and one float32 value per position."""
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    logps = selective_log_softmax(logits, torch.zeros(2, 4, dtype=torch.long))
    saved = logps.grad_fn.saved_tensors
    assert saved[0] is logits or saved[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() * t.element_size() for t in saved if t.dtype == torch.float32) == 2 * 4 * 4


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: any device that is not a CPU gets the GPU's block size
@pytest.mark.parametrize("batch,length,vocab", [(3, 5, 11), (16, 49, 32000), (2, 4096, 152064), (1, 1, 7), (4, 0, 9)])
def test_blocks_cover_every_position_once_within_the_block_size(device, batch, length, vocab):
    budget = token_logps.BLOCK_BYTES_CPU if device == "cpu" else token_logps.BLOCK_BYTES_GPU
    seen = torch.zeros(batch, length, dtype=torch.int)
    for rows, positions in token_logps._blocks(batch, length, vocab, torch.device(device)):
        block = seen[rows, positions]
        assert block.numel() > 0 and (block.numel() * vocab * 4 <= budget or block.numel() == 1)
        seen[rows, positions] += 1
    assert bool((seen == 1).all())


# --- the output layer and the log-softmax in one (linear_log_softmax) --------------------------------------------
def _linear_reference(hidden, weight, bias, index, start, bf16):
    """F.linear's logits (under the same autocast), then selective_log_softmax."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = torch.nn.functional.linear(hidden, weight, bias)
    return selective_log_softmax(logits, index, start=start, with_argmax=True)


def _fused(hidden, weight, bias, index, start, bf16):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return token_logps.linear_log_softmax(hidden, weight, bias, index, start=start, with_argmax=True)[:2]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tile", [(4 * 4, 4), (4 * 4 * 5, 4), (4 * 13 * 5, 1024), (2**20, 1024)],
                         ids=["one-row-chunks", "rows-chunks", "rows-whole-vocab", "all"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_log_softmax_equals_the_output_layer_then_the_log_softmax(monkeypatch, bf16, tile, bias):
    """Tiles of one row or several, chunks of 4 of the 13 vocabulary entries (the last one short) or all of them, or
    everything at once; a window from position 1; masked positions (zero gradient); a greedy token tied across
    chunks: the values and greedy tokens of F.linear then selective_log_softmax, and the gradients of hidden
    states, weight and bias, up to rounding (bf16 autocast: bf16's; the weight's gradient is summed over row
    blocks in float32, so it is not less exact than one bf16 product)."""
    tile_bytes, min_chunk = tile
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", tile_bytes)
    monkeypatch.setattr(linear_logps_torch, "MIN_VOCAB_CHUNK", min_chunk)
    torch.manual_seed(0)
    h0, w0, b0 = torch.randn(3, 7, 5), torch.randn(13, 5), torch.randn(13)
    w0[2], w0[9], b0[9] = torch.full((5,), 2.0), torch.full((5,), 2.0), b0[2]  # entries 2 and 9 (chunks 0, 2) ...
    h0[1, 3] = 5.0  # ... give equal logits, the largest, at this position: the greedy token is the first, 2
    index, g = torch.randint(13, (3, 5)), torch.randn(3, 5)
    g[0, :2] = 0.0  # masked positions: rows the backward pass skips
    outputs = []
    for fn in (_linear_reference, _fused):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        logps, argmax = fn(h, w, b, index, 1, bf16)
        (logps * g).sum().backward()
        outputs.append((logps.detach(), argmax, h.grad, w.grad, b.grad if bias else None))
    (want, want_argmax, *want_grads), (got, got_argmax, *got_grads) = outputs
    assert got.dtype == torch.float32 and torch.equal(got_argmax, want_argmax) and got_argmax[1, 2] == 2
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 2e-6, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tolerance)
    for mine, theirs in zip(got_grads, want_grads):
        if theirs is not None:
            assert mine.dtype == theirs.dtype
            torch.testing.assert_close(mine, theirs, **tolerance)
    assert not got_grads[0][:, [0, 6]].any() and not got_grads[0][0, 1:3].any()  # outside the window; masked


def test_linear_log_softmax_is_exact_in_float32_with_one_tile():
    """One tile: the same product as F.linear and the same logsumexp, so the same values bit for bit."""
    torch.manual_seed(1)
    hidden, weight, index = torch.randn(2, 6, 8), torch.randn(40, 8), torch.randint(40, (2, 5))
    want, want_argmax = _linear_reference(hidden, weight, None, index, 0, False)
    got, got_argmax = _fused(hidden, weight, None, index, 0, False)
    assert torch.equal(got, want) and torch.equal(got_argmax, want_argmax)


def test_linear_log_softmax_gives_no_gradient_to_a_frozen_weight_and_refuses_bad_shapes():
    hidden = torch.randn(2, 4, 3, requires_grad=True)
    weight = torch.randn(9, 3)  # frozen: LoRA elsewhere in the model
    logps, argmax, entropy = token_logps.linear_log_softmax(hidden, weight, None, torch.randint(9, (2, 3)))
    logps.sum().backward()
    assert hidden.grad is not None and weight.grad is None and argmax.numel() == entropy.numel() == 0
    with pytest.raises(ValueError, match=r"expected \[B, T, H\] and \[B, L\]"):
        token_logps.linear_log_softmax(hidden, weight, None, torch.randint(9, (2, 4)), start=1)


@pytest.mark.parametrize("min_chunk", [4, 1024], ids=["chunks", "whole-vocab"])
def test_linear_log_softmax_gives_each_positions_entropy_without_a_gradient(monkeypatch, min_chunk):
    """with_entropy: -sum(p log p) of each position's distribution (what the online algorithms log), carried across
    vocabulary chunks; it takes no part in the backward pass."""
    from rlhf.algos.policy_losses import entropy_from_logits

    monkeypatch.setattr(linear_logps_torch, "MIN_VOCAB_CHUNK", min_chunk)
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", 4 * 4 * 3)
    torch.manual_seed(2)
    hidden, weight, index = torch.randn(2, 6, 5, requires_grad=True), torch.randn(13, 5) * 3, torch.randint(13, (2, 4))
    logps, _, entropy = token_logps.linear_log_softmax(hidden, weight, None, index, start=1, with_entropy=True)
    want = entropy_from_logits(torch.nn.functional.linear(hidden, weight)[:, 1:5].detach())
    torch.testing.assert_close(entropy, want, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad and logps.requires_grad


# --- the sampling temperature: log_softmax(logits / T), values and gradients -----------------------------------------
def _at_temperature(logits, index, start, temperature):
    """What the kernels must give, written independently: float64 log_softmax of the logits divided by T."""
    x = logits[:, start:start + index.shape[1]].double() / temperature
    logp = torch.log_softmax(x, -1)
    return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
@pytest.mark.parametrize("block_bytes", [4 * 11, 2**20], ids=["part-of-a-row", "all"])
def test_selective_log_softmax_at_a_temperature_is_log_softmax_of_the_logits_over_it(monkeypatch, temperature,
                                                                                      block_bytes):
    monkeypatch.setattr(token_logps, "BLOCK_BYTES_CPU", block_bytes)
    torch.manual_seed(3)
    base, index, g = torch.randn(3, 6, 11) * 3, torch.randint(11, (3, 4)), torch.randn(3, 4)
    results = []
    for fn in (lambda x: _at_temperature(x, index, 1, temperature)[0],
               lambda x: selective_log_softmax(x, index, start=1, temperature=temperature)):
        logits = base.clone().requires_grad_()
        logps = fn(logits)
        (logps * g).sum().backward()
        results.append((logps.detach().float(), logits.grad))
    (want, want_grad), (got, got_grad) = results
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=2e-6, rtol=1e-5)
    at_one = selective_log_softmax(base, index, start=1)
    assert (got - at_one).abs().max() > 0.1  # the temperature changes the answer: the test can tell


@pytest.mark.parametrize("temperature", [0.5, 1.7])
@pytest.mark.parametrize("min_chunk", [4, 1024], ids=["chunks", "whole-vocab"])
def test_linear_log_softmax_at_a_temperature_gives_the_logps_entropy_and_gradients_of_logits_over_it(
        monkeypatch, temperature, min_chunk):
    monkeypatch.setattr(linear_logps_torch, "MIN_VOCAB_CHUNK", min_chunk)
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", 4 * 4 * 3)
    torch.manual_seed(4)
    h0, w0, b0 = torch.randn(2, 6, 5), torch.randn(13, 5) * 2, torch.randn(13)
    index, g = torch.randint(13, (2, 4)), torch.randn(2, 4)
    results = []
    for fused in (False, True):
        h, w, b = h0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        if fused:
            logps, _, entropy = token_logps.linear_log_softmax(h, w, b, index, start=1, with_entropy=True,
                                                               temperature=temperature)
        else:
            logps, entropy = _at_temperature(torch.nn.functional.linear(h, w, b), index, 1, temperature)
        (logps * g).sum().backward()
        results.append((logps.detach().float(), entropy.detach().float(), h.grad, w.grad, b.grad))
    (want, want_entropy, *want_grads), (got, got_entropy, *got_grads) = results
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_entropy, want_entropy, atol=2e-6, rtol=1e-5)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, atol=2e-6, rtol=1e-5)


def test_a_temperature_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="must be > 0"):
        selective_log_softmax(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
