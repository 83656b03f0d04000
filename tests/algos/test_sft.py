import math

import pytest
import torch

from rlhf.algos.sft import SFT, nll_loss
from rlhf.models.tokenizer import byte_tokenizer


def test_nll_loss_is_mean_over_masked_tokens():
    token_logps = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.125, 1.0, 1.0]]))
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]]).bool()
    expected = -(math.log(0.25) + math.log(0.9) + math.log(0.125)) / 3
    assert nll_loss(token_logps, mask).item() == pytest.approx(expected, rel=1e-6)


def test_completion_only_loss_masks_the_prompt():
    tok = byte_tokenizer()
    row = {"prompt": "ab=", "completion": "ba"}
    only = SFT(completion_only_loss=True).tokenize(row, tok)
    full = SFT(completion_only_loss=False).tokenize(row, tok)
    assert only["input_ids"] == list(b"ab=ba") + [tok.eos_token_id]
    assert only["completion_mask"] == [0, 0, 0, 1, 1, 1]
    assert full["completion_mask"] == [1] * 6


# ---- padding-free batches ------------------------------------------------------------------------------------------
ROWS = [{"prompt": "abc=", "completion": "cba"}, {"prompt": "hello=", "completion": "olleh"},
        {"prompt": "x=", "completion": "x"}]


def _loss_and_gradients(model, padding_free: bool, **options):
    import copy

    policy = copy.deepcopy(model)
    algo = SFT(padding_free=padding_free, **options)
    tok = byte_tokenizer()
    algo.setup(policy, tok)
    batch = algo.collate([algo.tokenize(row, tok) for row in ROWS])
    loss, metrics = algo.loss(policy, batch)
    loss.backward()
    return float(loss), {k: float(v) for k, v in metrics.items()}, [p.grad for p in policy.parameters()], \
        algo.samples(batch)


@pytest.mark.parametrize("completion_only_loss", [True, False])
@pytest.mark.parametrize("completion_logits_only", [True, False])
@pytest.mark.parametrize("fused_output_layer", [True, False])
def test_padding_free_batches_give_the_loss_metrics_and_gradients_of_padded_ones(
        completion_only_loss, completion_logits_only, fused_output_layer):
    """Rows of different lengths packed into one sequence: the same loss, metrics, every gradient and sample count
    as the padded batch (red when a row's last token is scored on the next row's first, when the rows see each
    other, or when the metrics are per packed sequence instead of per row)."""
    from tests.conftest import fast_initial_model

    model = fast_initial_model()
    options = {"completion_only_loss": completion_only_loss, "completion_logits_only": completion_logits_only,
               "fused_output_layer": fused_output_layer}
    padded, packed = (_loss_and_gradients(model, padding_free, **options) for padding_free in (False, True))
    assert packed[0] == pytest.approx(padded[0], abs=1e-6)
    assert packed[1] == pytest.approx(padded[1], abs=1e-6)
    for a, b in zip(padded[2], packed[2]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert packed[3] == padded[3] == len(ROWS)


class _Successor(torch.nn.Module):
    """A causal LM whose every position predicts its token + 1 (position ids and masks ignored): a row of
    consecutive tokens is matched greedily, others are not."""

    def __init__(self, vocab: int = 300) -> None:
        super().__init__()
        self.vocab, self.weight = vocab, torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        from types import SimpleNamespace

        logits = 10.0 * torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float() + self.weight
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_packed_rows_are_scored_row_by_row():
    """Per-row statistics of a packed batch: each row's summed log-probability, completion tokens and greedy match
    are those of the same row padded (rows 1 and 3 consecutive tokens, row 2 not)."""
    from rlhf.data.collate import collate_packed, collate_sequences
    from rlhf.ops.completion_logps import completion_stats

    ids = [[1, 2, 3, 4, 5], [7, 9, 10], [20, 21, 22, 23]]
    masks = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 1, 1]]
    model = _Successor()
    padded = completion_stats(model, collate_sequences(ids, masks, 0))
    packed = completion_stats(model, collate_packed(ids, masks))
    assert padded.greedy_match.tolist() == packed.greedy_match.tolist() == [True, False, True]
    assert padded.num_tokens.tolist() == packed.num_tokens.tolist() == [3, 2, 3]
    torch.testing.assert_close(packed.logps, padded.logps)


class _Mixing(torch.nn.Module):
    """A model whose every position sees the whole sequence so far, whatever the position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.embed(input_ids).cumsum(1))


def test_a_model_that_lets_packed_rows_see_each_other_is_refused():
    from rlhf.algos.sft import require_packing
    from rlhf.core.errors import UserError

    with pytest.raises(UserError, match="packed rows attend to each other.*algo.padding_free=false"):
        require_packing(_Mixing())
    require_packing(__import__("tests.conftest", fromlist=["x"]).fast_initial_model())  # a Llama: accepted
