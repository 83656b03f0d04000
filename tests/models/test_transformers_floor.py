"""What rlhf needs of transformers that its oldest allowed version (pyproject.toml's floor) must give, beyond what the
rest of the suite checks at the pinned version: run at the floor by ``scripts/test_at_floor.sh``."""

from __future__ import annotations

import torch

from rlhf.models.generation import Sampling, sample
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import fast_initial_model


def test_the_static_decoder_places_tokens_after_a_padded_first_row_with_a_zero_pad_embedding():
    """The static decoder passes transformers no cache positions: the cache must count what it holds. transformers
    up to 5.3 counted the positions of batch row 0 whose keys are not all zero, so a left-padded first row over a
    zero pad embedding (nn.Embedding's ``padding_idx`` starts it at zero; such keys are zero) was counted short and
    every later token written over the cache's start; from 5.4 its StaticCache keeps a counter. Greedy completions
    equal generate()'s (red at transformers 5.3: ``scripts/test_at_floor.sh 5.3.0``)."""
    torch.manual_seed(0)
    tok, model = byte_tokenizer(), fast_initial_model()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0, 0.3)  # completions that vary from token to token
        model.get_input_embeddings().weight[tok.pad_token_id].zero_()
    rows = [tok(text)["input_ids"] for text in ("ab=", "hello there=", "xyz=")]  # row 0 the shortest: padded most
    longest = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (longest - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    out = {}
    for generation in ("transformers", "static"):
        settings = Sampling(max_new_tokens=12, pad_id=tok.pad_token_id, eos_ids=(), tokenizer=tok,
                            generation=generation)
        out[generation] = sample(model.eval(), ids, mask, 1, None, settings)["completion_ids"]
    assert torch.equal(out["transformers"], out["static"]), out
