"""What a process holds (rlhf/hardware/holding.py): a frozen model's linear weights stored in bf16 under bf16
autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.hardware.holding import linear_weights_to_bf16


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, tie_word_embeddings=tied, attention_bias=True)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_linear_weights_give_the_same_outputs_under_autocast_bit_for_bit(tied):
    """Autocast casts a float32 linear weight (and bias) to bf16 for every product: stored in bf16, the logits are
    the same bit for bit. An output layer tied to the embeddings stays float32 (the embedding is not autocast:
    a bf16 table would change every hidden state); so does everything that is not a linear layer."""
    model = _llama(tied)
    stored = copy.deepcopy(model)
    converted = linear_weights_to_bf16(stored)
    linears = {name for name, m in stored.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, param in stored.named_parameters():
        in_linear = name.rsplit(".", 1)[0] in linears and not (tied and name.startswith("lm_head"))
        assert param.dtype == (torch.bfloat16 if in_linear else torch.float32), name
    head = model.lm_head.weight.numel()
    expected = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                   for m in model.modules() if isinstance(m, torch.nn.Linear)) - (head if tied else 0)
    assert converted == expected and stored.model.embed_tokens.weight.dtype == torch.float32
    if tied:
        assert stored.lm_head.weight is stored.model.embed_tokens.weight  # still one parameter
    ids = torch.randint(0, 300, (3, 17))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected_logits = model(input_ids=ids, attention_mask=mask).logits
        logits = stored(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, expected_logits)
    assert linear_weights_to_bf16(stored) == 0  # nothing float32 left to convert


def test_weights_that_are_not_plain_float32_parameters_are_left_alone():
    """A quantized weight is a Parameter subclass (bitsandbytes' Int8Params) or not float32: untouched, as is a
    linear weight that a module of another kind shares."""

    class Quantized(torch.nn.Parameter):
        pass

    quantized = torch.nn.Linear(4, 4)
    quantized.weight = Quantized(quantized.weight.data, requires_grad=False)
    half = torch.nn.Linear(4, 4).to(torch.float16)
    shared = torch.nn.Linear(4, 4, bias=False)
    table = torch.nn.Embedding(4, 4)
    table.weight = shared.weight
    model = torch.nn.ModuleDict({"q": quantized, "h": half, "s": shared, "e": table})
    assert linear_weights_to_bf16(model) == 4  # the quantized layer's float32 bias only
    assert quantized.weight.dtype == torch.float32 and quantized.bias.dtype == torch.bfloat16
    assert half.weight.dtype == torch.float16 and shared.weight.dtype == torch.float32
