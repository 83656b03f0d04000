import pytest
import torch

from rlhf.algos import token_logps
from rlhf.algos.token_logps import selective_log_softmax


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
