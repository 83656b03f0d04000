"""rlhf/hardware/compiling.py: hardware.compile=layers compiles each decoder layer (found generically) and trains as
eager does; auto is off on a CPU; while compiling, batches are padded to buckets so that lengths recompile little."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf import train
from rlhf.core import auto_choices
from rlhf.data.collate import collate_in_buckets, collate_sequences, pad_to_multiple
from rlhf.hardware import DataParallel, compiling
from rlhf.hardware.compiling import repeated_blocks, resolve_compile
from rlhf.ops.completion_logps import keep_completion_logits
from tests.conftest import FAST, compose_config, fast_initial_model


def test_the_repeated_blocks_are_found_whatever_wraps_them_and_auto_is_the_tables_choice():
    from peft import LoraConfig, get_peft_model

    model = fast_initial_model()
    assert repeated_blocks(model) is model.model.layers
    wrapped = get_peft_model(fast_initial_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert repeated_blocks(wrapped) is wrapped.get_base_model().model.layers
    assert repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
    assert resolve_compile("auto", uses_cuda=True) == auto_choices.pick("hardware.compile", "cuda")  # not measured: off
    assert resolve_compile("auto", uses_cuda=False) is False
    assert resolve_compile("auto", uses_cuda=True, compiles=False) is False  # FSDP2, ZeRO
    assert resolve_compile("aot_eager", uses_cuda=False) == "aot_eager"
    assert DataParallel(device="cpu", compile="auto").compile is False
    from rlhf.hardware.fsdp import FSDP2

    assert FSDP2(device="cpu", compile="auto").compile is False  # auto: no refusal under a sharding option


def test_a_batch_is_padded_to_a_multiple_of_the_bucket_with_masked_positions():
    """Right padding with zeros: masks off, the logits kept from the end moved along; the completions' statistics
    of the tiny model unchanged; packed batches and left-padded prompts untouched."""
    from rlhf.ops.completion_logps import completion_stats

    ids, masks = [[5, 6, 7, 8, 9], [5, 6, 7]], [[0, 0, 1, 1, 1], [0, 1, 1]]
    batch = keep_completion_logits(collate_sequences(ids, masks, pad_id=0))
    padded = pad_to_multiple(batch, 8)
    assert padded["input_ids"].shape == padded["attention_mask"].shape == padded["completion_mask"].shape == (2, 8)
    assert padded["attention_mask"][:, 5:].sum() == 0 and padded["completion_mask"][:, 5:].sum() == 0
    assert padded["logits_to_keep"] == batch["logits_to_keep"] + 3
    model = fast_initial_model().eval()
    a, b = completion_stats(model, batch), completion_stats(model, padded)
    torch.testing.assert_close(b.token_logps[:, :4] * b.mask[:, :4], a.token_logps * a.mask, atol=1e-5, rtol=1e-5)
    assert pad_to_multiple(padded, 8) is padded  # already a multiple
    prompts = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}
    assert pad_to_multiple(prompts, 8) is prompts  # left-padded prompts: no completion_mask


def test_the_bucket_pads_tokens_with_the_pad_id_so_a_reward_head_reads_the_same_rows():
    """A sequence-classification head reads each row at its last token that is not the pad id: the bucket's
    tokens are the pad id, so the rewards of a padded batch are the unpadded batch's."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=99)
    head = LlamaForSequenceClassification(config).eval()
    ids = [[5, 6, 7, 8, 9], [5, 6, 7]]
    batch = collate_sequences(ids, [[1] * len(x) for x in ids], pad_id=99)
    padded = pad_to_multiple(batch, 8, pad_id=99)
    assert (padded["input_ids"][:, 5:] == 99).all()
    rewards = [head(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits for b in (batch, padded)]
    torch.testing.assert_close(rewards[1], rewards[0])


def test_lengths_within_a_bucket_compile_each_layer_once(monkeypatch):
    """Regional compilation (backend eager: dynamo's capture without code generation) of a 2-layer model: four
    training batches of lengths 5 to 40, padded by the compiling loader's collate, are one graph for both layers
    (red with buckets of one token: the second length recompiles)."""
    from torch._dynamo.utils import counters

    from rlhf.embedded.tiny_model import TinySpec

    monkeypatch.setitem(compiling.LAYER_OPTIONS, "backend", "eager")
    model = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, warm_start_steps=0).build().model
    torch._dynamo.reset()
    counters.clear()
    compiling.compile_model(model, "layers")
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model.lm_head._compiled_call_impl is None and model._compiled_call_impl is None  # the tap stays eager
    for length in (5, 17, 29, 40):
        rows = [[3] * length, [4] * (length - 2)]
        batch = collate_in_buckets(lambda r: collate_sequences(r, [[1] * len(x) for x in r], 0),
                                   compiling.BUCKET_TOKENS, 0, rows)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        out.logits.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph, both layers


def _losses(run) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["train/loss"] for line in lines if "train/loss" in line]


def test_layers_compiled_on_a_cpu_train_as_eager_and_auto_is_off_there(tmp_path, monkeypatch):
    """hardware.compile=layers (forced on a CPU; backend aot_eager, the graphs differentiated ahead of time without
    generated code) trains DPO for three steps with the eager run's losses to float32 rounding, the start-up line
    saying so; hardware.compile=auto on a CPU compiles nothing and says that."""
    from torch._dynamo.utils import counters

    monkeypatch.setitem(compiling.LAYER_OPTIONS, "backend", "aot_eager")
    counters.clear()
    common = [*FAST, "algo=dpo", "train.eval_at_start=false", "train.max_steps=3"]
    train(compose_config(*common, "hardware.compile=auto", output_dir=tmp_path / "auto"))
    assert counters["stats"]["unique_graphs"] == 0
    train(compose_config(*common, "hardware.compile=layers", output_dir=tmp_path / "layers"))
    assert counters["stats"]["unique_graphs"] > 0
    eager, layers = _losses(tmp_path / "auto"), _losses(tmp_path / "layers")
    assert len(eager) == 3 and eager == pytest.approx(layers, rel=1e-4, abs=1e-6)
    assert "decoder layers compiled" in (tmp_path / "layers" / "train.log").read_text()
    assert f"hardware.compile=false ({auto_choices.CHOICES['hardware.compile'].cpu_evidence})" in (tmp_path / "auto" / "train.log").read_text()


@pytest.mark.slow
def test_layers_compiled_by_inductor_compute_what_eager_computes_in_one_graph():
    """hardware.compile=layers with its own options (inductor, what a GPU gets: on a CPU it generates C++ and
    compiles it) on a 2-layer model: two training batches of one bucket give eager's logits and every gradient to
    float32 rounding, with one graph for both layers and both lengths, compiled by inductor (forward and backward).
    Red where the layers run uncompiled (no inductor graph) or a length recompiles."""
    import copy

    from torch._dynamo.utils import counters

    from rlhf.embedded.tiny_model import TinySpec

    assert "backend" not in compiling.LAYER_OPTIONS  # torch.compile's default: inductor
    torch.manual_seed(0)
    model = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, warm_start_steps=0).build().model
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiling.compile_model(model, "layers")
    for length in (5, 29):
        rows = [[3 + i % 50 for i in range(length)], [7] * (length - 2)]
        batch = collate_in_buckets(lambda r: collate_sequences(r, [[1] * len(x) for x in r], 0),
                                   compiling.BUCKET_TOKENS, 0, rows)
        outputs = []
        for net in (model, eager):
            net.zero_grad()
            logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            (logits * batch["attention_mask"][..., None]).pow(2).mean().backward()
            outputs.append((logits.detach(), [p.grad.clone() for p in net.parameters()]))
        (got, got_grads), (want, want_grads) = outputs
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # both layers, both lengths
    # inductor compiled the layer's forward and backward graphs (from its cache where an earlier run left them)
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == 2
