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
