"""rlhf/models/decoding.py: the static-cache decoding loop gives transformers' generate's completions (greedy, and
sampled with the same seed), eager and compiled by inductor, restricts the distribution as documented, looks at the
ends every few tokens, and its compiled decode step is one graph for every bucket and batch size.

Cost: inductor compiles the decode step once for the module (the tests share its graph: one architecture), about
15-30 s on 2 cores; the rest a few seconds."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf.core.errors import UserError
from rlhf.models import decoding
from rlhf.models.decoding import choose, decode, restrict
from rlhf.models.generation import Sampling, decode_compile_options, sample, stop_ids, uses_static_decoding
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
    sampled with a seed, for prompts of different lengths, and so does static_compiled (the decode step compiled by
    inductor on the CPU: one compile for the module, shared by every case); with frequent tokens as stop ids the rows
    end at different steps (some before the first look at the ends, some after it), and some never."""
    tok, model = byte_tokenizer(), _varied_model()
    ids, mask = _prompts(tok)
    out = {}
    for generation in ("transformers", "static", "static_compiled"):
        free = Sampling(max_new_tokens=20, pad_id=tok.pad_token_id, eos_ids=stop_ids(tok, model), tokenizer=tok,
                        generation=generation, **options)
        first = sample(model, ids, mask, 4, seed, free)["completion_ids"]  # the stop ids: tokens it draws
        ends = tuple(dict.fromkeys([*free.eos_ids, int(first[0, 9]), int(first[-1, 3])]))
        settings = Sampling(**{**free.__dict__, "eos_ids": ends})
        out[generation] = sample(model, ids, mask, 4, seed, settings)
    a = out["transformers"]
    for generation in ("static", "static_compiled"):
        b = out[generation]
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
            assert torch.equal(a[key], b[key]), (generation, key)
        assert a["completions"] == b["completions"], generation
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


class _Warnings(logging.Handler):
    """The warnings torch's compiler logs (its logger does not propagate to pytest's capture)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def compiler_warnings():
    handler = _Warnings()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_the_inductor_compiled_decoder_is_one_graph_for_every_bucket_and_batch(monkeypatch, compiler_warnings):
    """The decode step compiled by inductor on the CPU (the shipped CPU options, as algo.generation=static_compiled
    compiles it) decodes what the eager loop decodes, through more buckets than the decoders kept and two batch
    sizes, twice: at most one graph for all of them (none if an earlier test of the module compiled it; none more in
    the second round), no recompile-limit warning, and an evicted decoder's cache freed. transformers' cache is marked
    as torch's older default marks it (addresses guarded), which the decoder overrides. Red when the cache keeps
    guarded addresses (a graph per decoder: the limit warned at the ninth, the evicted caches alive), and with fixed
    shapes (``dynamic=False``: a graph per bucket and batch size)."""
    import gc
    import weakref

    marks = torch._dynamo.mark_static_address
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: marks(t, guard=guard))
    tok, model = byte_tokenizer(), fast_initial_model().eval()
    lengths = [8 * k for k in range(1, decoding.KEPT_DECODERS + 2)]  # a bucket each (buckets of 8 positions)
    first_cache, made, before = None, [], _graphs()
    for round_ in range(2):
        for rows in (2, 3):
            for length in lengths:
                ids = torch.randint(3, 200, (rows, length), generator=torch.Generator().manual_seed(length + rows))
                mask = torch.ones_like(ids)
                mask[0, : length // 2] = 0  # a left-padded row
                settings = (model, ids, mask, 4, tok.pad_token_id, (), False)
                compiled = decode(*settings, bucket_tokens=8, compile_options=decoding.CPU_COMPILE)
                if round_ == 0:
                    assert torch.equal(compiled, decode(*settings, bucket_tokens=8)), (rows, length)
                if first_cache is None:
                    held = decoding._DECODERS[model]
                    first_cache = weakref.ref(held[next(k for k in held if k[-1] is False)].cache.layers[0].keys)
        made.append(_graphs() - before)
    gc.collect()
    assert made[0] <= 1 and made[1] == made[0], made
    assert not [m for m in compiler_warnings if "recompile_limit" in m], compiler_warnings
    assert first_cache() is None  # evicted (KEPT_DECODERS) and freed


def test_the_decode_step_traces_whole_without_a_graph_break():
    """The decode step compiled as shipped but with fullgraph=True (a graph break raises) and the eager backend (no
    code generated: fast): the model's forward with the static cache has no graph break (each would split the CUDA
    graphs on a GPU), and it decodes what the eager loop decodes (red with a graph break in the step)."""
    tok, model = byte_tokenizer(), fast_initial_model().eval()
    ids, mask = _prompts(tok)
    options = {**decoding.CPU_COMPILE, "backend": "eager", "fullgraph": True}
    eager = decode(model, ids, mask, 10, tok.pad_token_id, (tok.eos_token_id,), False)
    assert torch.equal(decode(model, ids, mask, 10, tok.pad_token_id, (tok.eos_token_id,), False,
                              compile_options=options), eager)


def test_sampling_runs_layers_compiled_for_training_eagerly(monkeypatch):
    """A model whose layers hardware.compile=layers compiled (backend eager here, for speed): sampling with
    transformers' generate and with the eager static decoder compiles no graph (a layer's graph with a cache would be
    specialised on its index and the cache's length); the same completions as the model before compiling. Red
    without the eager stance around the static decoder's steps (1 graph), and without generate's (3)."""
    from rlhf.hardware import compiling

    monkeypatch.setattr(compiling, "LAYER_OPTIONS", {"backend": "eager"})
    tok, model = byte_tokenizer(), _varied_model().eval()
    ids, mask = _prompts(tok)
    settings = Sampling(max_new_tokens=6, pad_id=tok.pad_token_id, eos_ids=stop_ids(tok, model), tokenizer=tok)
    plain = sample(model, ids, mask, 2, 0, settings)["completion_ids"]
    compiling.compile_model(model, compiling.LAYERS)
    before = _graphs()
    for generation in ("transformers", "static"):
        out = sample(model, ids, mask, 2, 0, Sampling(**{**settings.__dict__, "generation": generation}))
        assert torch.equal(out["completion_ids"], plain), generation
    assert _graphs() == before


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
    assert uses_static_decoding(Sampling(generation="static_compiled"), cpu, partitioned=False)
    assert not uses_static_decoding(Sampling(generation="transformers"), cuda, partitioned=False)
    # compiled: on a GPU (CUDA graphs) either way, on a CPU only when asked (inductor), never for a sharded model
    options = {g: {d.type: decode_compile_options(Sampling(generation=g), d, partitioned=False) for d in (cuda, cpu)}
               for g in ("static", "static_compiled")}
    assert options == {"static": {"cuda": decoding.GPU_COMPILE, "cpu": None},
                       "static_compiled": {"cuda": decoding.GPU_COMPILE, "cpu": decoding.CPU_COMPILE}}
    assert decode_compile_options(Sampling(generation="static_compiled"), cpu, partitioned=True) is None
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
