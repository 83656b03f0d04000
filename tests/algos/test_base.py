import torch

from rlhf.algos.base import completion_stats, selective_log_softmax
from rlhf.data.collate import collate_sequences
from rlhf.models.tiny import TinySpec


def test_selective_log_softmax_equals_gather_of_log_softmax():
    logits = torch.randn(2, 5, 11)
    index = torch.randint(11, (2, 5))
    expected = logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, index), expected, atol=1e-6)


def test_completion_stats_sum_completion_tokens_and_greedy_match_agrees_with_generate():
    policy = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build()
    model, tok = policy.model.eval(), policy.tokenizer
    prompt = list(b"xyz=")
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, 4:].tolist()
    wrong = generated[:3] + [(generated[3] + 1) % 256]
    batch = collate_sequences([prompt + generated, prompt + wrong, prompt + generated[:2]],
                              [[0] * 4 + [1] * 4, [0] * 4 + [1] * 4, [0] * 4 + [1] * 2], tok.pad_token_id)
    stats = completion_stats(model, batch)
    assert stats.greedy_match.tolist() == [True, False, True]
    assert stats.num_tokens.tolist() == [4, 4, 2]
    with torch.no_grad():
        logps = model(torch.tensor([prompt + wrong])).logits.log_softmax(-1)[0]
    manual = sum(logps[t - 1, (prompt + wrong)[t]].item() for t in range(4, 8))
    assert abs(stats.logps[1].item() - manual) < 1e-4
