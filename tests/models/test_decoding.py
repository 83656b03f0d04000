"""rlhf/models/decoding.py: the static-cache decoding loop gives transformers' generate's completions (greedy, and
sampled with the same seed), restricts the distribution as documented, looks at the ends every few tokens, and its
compiled decode step is one graph for every prompt length of a bucket."""

from __future__ import annotations

import pytest
import torch

from rlhf.core.errors import UserError
from rlhf.models import decoding
from rlhf.models.decoding import choose, decode, restrict
from rlhf.models.generation import Sampling, sample, stop_ids, uses_static_decoding
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import fast_initial_model


def _prompts(tok, texts=("abcab=", "hello there=", "x=")):
    """Left-padded prompts of different lengths."""
    rows = [tok(t)["input_ids"] for t in texts]
    longest = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (longest - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _varied_model():
    """The tiny model with larger random weights (std 0.3): its greedy completions vary from token to token."""
    torch.manual_seed(0)
    model = fast_initial_model()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("seed, options", [(None, {}), (0, {}), (3, {"top_k": 5}),
                                           (1, {"top_p": 0.6, "temperature": 0.7}),
                                           (2, {"top_k": 20, "top_p": 0.9, "temperature": 1.3})])
def test_static_decoding_gives_generates_completions(seed, options):
    """generation=static returns what generation=transformers returns, every key of sample's dict, greedy and
    sampled with a seed, for prompts of different lengths; with frequent tokens as stop ids the rows end at
    different steps (some before the first look at the ends, some after it), and some never."""
    tok, model = byte_tokenizer(), _varied_model()
    ids, mask = _prompts(tok)
    out = {}
    for generation in ("transformers", "static"):
        free = Sampling(max_new_tokens=20, pad_id=tok.pad_token_id, eos_ids=stop_ids(tok, model), tokenizer=tok,
                        generation=generation, **options)
        first = sample(model, ids, mask, 4, seed, free)["completion_ids"]  # the stop ids: tokens it draws
        ends = tuple(dict.fromkeys([*free.eos_ids, int(first[0, 9]), int(first[-1, 3])]))
        settings = Sampling(**{**free.__dict__, "eos_ids": ends})
        out[generation] = sample(model, ids, mask, 4, seed, settings)
    a, b = out["transformers"], out["static"]
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(a[key], b[key]), key
    assert a["completions"] == b["completions"]
    lengths = a["completion_mask"].sum(-1)
    assert lengths.min() < 8 and lengths.max() > 8, lengths  # ends on both sides of the first look


def test_restrict_keeps_the_top_k_and_then_the_nucleus():
    """Hand-computed: probabilities 0.5, 0.25, 0.15, 0.1 (log-space logits); top_k=3 drops the last; top_p=0.7
    keeps 0.5 and 0.25 (0.5 alone is short of 0.7), top_p=0.5 keeps only the likeliest; a temperature divides."""
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()
    kept = lambda scores: torch.isfinite(scores)[0].tolist()  # noqa: E731
    assert kept(restrict(logits, top_k=3)) == [False, True, True, True]
    assert kept(restrict(logits, top_p=0.7)) == [False, True, False, True]
    assert kept(restrict(logits, top_p=0.5)) == [False, True, False, False]
    assert kept(restrict(logits, top_k=3, top_p=0.9)) == [False, True, True, True]  # top-p of the renormalised 3
    torch.testing.assert_close(restrict(logits, temperature=2.0), logits / 2)
    assert restrict(logits).data_ptr() != logits.data_ptr()  # a new tensor: the caller's logits untouched
    torch.manual_seed(0)
    draws = torch.stack([choose(logits.expand(4000, 4), True, top_k=2) for _ in range(1)]).flatten()
    assert set(draws.tolist()) == {1, 3}  # only the top 2
    assert abs((draws == 1).float().mean().item() - 2 / 3) < 0.03  # 0.5 / (0.5 + 0.25)
    assert choose(logits, False).tolist() == [1]


def test_the_ends_are_looked_at_every_few_tokens_not_at_every_one(monkeypatch):
    """Every row ends at its first token (every token is a stop id): the loop runs the decode step until its next
    look (check_every_tokens - 1 steps after the prefill), never to max_new_tokens, and returns one column as
    generate does; checking at every token stops after the prefill."""
    tok, model = byte_tokenizer(), fast_initial_model().eval()
    ids, mask = _prompts(tok)
    calls = []
    forward = decoding.StaticDecoder.forward
    monkeypatch.setattr(decoding.StaticDecoder, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    every = tuple(range(model.config.vocab_size))
    for check, forwards in ((8, 8), (4, 4), (1, 1)):
        calls.clear()
        out = decode(model, ids, mask, 30, tok.pad_token_id, every, False, check_every_tokens=check)
        assert out.shape == (3, ids.shape[1] + 1) and len(calls) == forwards, (check, len(calls))


def test_the_compiled_decode_step_is_one_graph_for_every_prompt_length_of_a_bucket():
    """The decode step compiled whole (fullgraph=True: no graph break in the model's forward with the static cache;
    backend eager, to be fast on a CPU) decodes what the eager loop decodes, and prompts of two lengths within one
    bucket replay one graph (red with buckets of one token: a graph per length)."""
    from torch._dynamo.utils import counters

    tok, model = byte_tokenizer(), fast_initial_model().eval()
    options = {"backend": "eager", "fullgraph": True, "dynamic": False}
    batches = [_prompts(tok, ("abcab=", "hello there=")), _prompts(tok, ("abcabcabcabcabc=", "hi="))]
    assert batches[0][0].shape[1] != batches[1][0].shape[1]
    for bucket, graphs in ((decoding.BUCKET_TOKENS, 1), (1, 2)):
        torch._dynamo.reset()
        counters.clear()
        for ids, mask in batches:
            eager = decode(model, ids, mask, 10, tok.pad_token_id, (tok.eos_token_id,), False, bucket_tokens=bucket)
            compiled = decode(model, ids, mask, 10, tok.pad_token_id, (tok.eos_token_id,), False,
                              bucket_tokens=bucket, compile_options=options)
            assert torch.equal(eager, compiled)
        assert counters["stats"]["unique_graphs"] == graphs, (bucket, dict(counters["stats"]))


def test_auto_decodes_statically_on_an_unsharded_gpu_model_only(monkeypatch):
    """Where the table picks the static decoder on a GPU (not yet: rlhf/core/auto_choices.py), only there."""
    import dataclasses

    from rlhf.core import auto_choices

    table = dict(auto_choices.CHOICES)
    table["algo.generation"] = dataclasses.replace(table["algo.generation"], gpu="static")
    monkeypatch.setattr(auto_choices, "CHOICES", table)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = Sampling()
    assert uses_static_decoding(auto, cuda, partitioned=False)
    assert not uses_static_decoding(auto, cpu, partitioned=False)
    assert not uses_static_decoding(auto, cuda, partitioned=True)  # FSDP2/ZeRO-3: generate on the gathered model
    assert not uses_static_decoding(Sampling(cache_implementation="static"), cuda, partitioned=False)
    assert uses_static_decoding(Sampling(generation="static"), cpu, partitioned=True)
    assert not uses_static_decoding(Sampling(generation="transformers"), cuda, partitioned=False)
    with pytest.raises(UserError, match="generation='vllm' is not one of"):
        Sampling(generation="vllm")
    with pytest.raises(UserError, match="check_every_tokens=0"):
        Sampling(check_every_tokens=0)


def test_a_model_keeps_few_decoders_and_is_not_kept_alive_by_them():
    """Each prompt bucket and batch size has its own cache (and, on a GPU, CUDA graphs): at most KEPT_DECODERS a
    model, the least recently used dropped; a model that is gone takes its decoders with it."""
    import gc
    import weakref

    model = fast_initial_model().eval()
    first = decoding.decoder_for(model, 1, 8, torch.device("cpu"), None)
    for length in range(16, 16 + 8 * decoding.KEPT_DECODERS, 8):
        decoding.decoder_for(model, 1, length, torch.device("cpu"), None)
        decoding.decoder_for(model, 1, 8, torch.device("cpu"), None)  # used again: kept
    held = decoding._DECODERS[model]
    assert len(held) == decoding.KEPT_DECODERS and any(d is first for d in held.values())
    gone = weakref.ref(model)
    del model, held, first
    gc.collect()
    assert gone() is None
