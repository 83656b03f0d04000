"""optimizer=adam_mini (rlhf/optim/mini.py): its partition places each tensor of a Llama-style model in the block
of Zhang et al. 2024 (https://arxiv.org/abs/2406.16793), the package applies exactly those rules, its second
moment holds one value per block (about half AdamW's state), a model it cannot place is refused, and a run
records groups that pair one to one with the partition's parts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf import train
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.run import checkpoint
from tests.conftest import FAST, ROOT, compose_config

adam_mini = pytest.importorskip("adam_mini")
from rlhf.optim import mini  # noqa: E402  (after the skip: the package is an optional extra)

VOCAB, DIM, HEADS, KV_HEADS, FFN, LAYERS = 40, 32, 4, 2, 48, 2  # grouped-query attention, an untied output layer


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                        tie_word_embeddings=False, attention_bias=True))


def _step(optimizer: torch.optim.Optimizer, model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()


def _build(model: torch.nn.Module, **options) -> tuple[mini.AdamMini, object]:
    split = mini.AdamMiniBlocks()(model)
    return split.build(lambda groups, **dims: mini.AdamMini(groups, **options, **dims)), split


def test_the_partition_places_each_tensor_in_its_papers_block():
    """Red when a rule moves a tensor (queries/keys per row, the output layer per tensor, a bias with the norms)."""
    model = _model()
    optimizer, split = _build(model)
    parts = {part.rule: sorted(part.names) for part in split.parts}
    per_layer = lambda *names: [f"model.layers.{i}.{n}" for i in range(LAYERS) for n in names]  # noqa: E731
    assert parts["per_head"] == sorted(per_layer("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
    assert parts["per_row"] == sorted(["model.embed_tokens.weight", "lm_head.weight", *per_layer(
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")])
    assert parts["per_entry"] == sorted(per_layer(*(f"self_attn.{x}_proj.bias" for x in "qkvo")))
    assert parts["per_tensor"] == sorted([*per_layer("input_layernorm.weight", "post_attention_layernorm.weight"),
                                          "model.norm.weight"])
    assert split.options == {"dim": DIM, "n_heads": HEADS, "n_kv_heads": KV_HEADS}
    # the groups pair one to one with the parts (what the start-up line and partition.json rely on)
    assert [g["rule"] for g in optimizer.param_groups] == [p.rule for p in split.parts]
    assert [[id(p) for p in g["params"]] for g in optimizer.param_groups] == [[id(p) for p in part.params]
                                                                              for part in split.parts]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0, 0.0, 0.0]  # options: wd 0 given


def test_the_package_applies_the_rules_its_own_name_keywords_choose():
    """The merged groups update bit for bit as adam-mini's one group per named tensor does. Red when a part's
    rule is not the package's for those names (k_proj sent per row, say)."""
    ours, theirs = _model(), _model()
    optimizer, _ = _build(ours, lr=1e-2, weight_decay=0.1)
    reference = adam_mini.Adam_mini(theirs.named_parameters(), lr=1e-2, weight_decay=0.1, dim=DIM, n_heads=HEADS,
                                    n_kv_heads=KV_HEADS, verbose=False)
    for seed in range(3):
        _step(optimizer, ours, seed)
        _step(reference, theirs, seed)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_its_second_moment_has_one_value_per_block_and_half_adamws_state():
    """Red when a block is wrong (per row where per head: 8 values for a 2-head key matrix, not 2), or when the
    second moment is per entry (the state as AdamW's)."""
    model = _model()
    optimizer, _ = _build(model)
    _step(optimizer, model, 0)
    head_dim = DIM // HEADS
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        second = state["v"] if "v" in state else state["vmean"]
        expected = {"q_proj.weight": HEADS, "k_proj.weight": KV_HEADS}.get(".".join(name.split(".")[-2:]))
        if expected is None:
            expected = param.numel() if name.endswith(".bias") else 1 if param.ndim == 1 else param.shape[0]
        assert second.numel() == expected, (name, tuple(second.shape))
        assert state["m"].numel() == param.numel(), name
    assert optimizer.state[model.model.layers[0].self_attn.k_proj.weight]["vmean"].numel() == DIM // (2 * head_dim)

    def state_bytes(opt: torch.optim.Optimizer) -> int:
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    adamw_model = _model()
    adamw = torch.optim.AdamW(adamw_model.parameters())
    _step(adamw, adamw_model, 0)
    ratio = state_bytes(optimizer) / state_bytes(adamw)
    assert 0.45 < ratio < 0.55, ratio


def test_its_name_keywords_are_the_packages():
    """Red when the package's keywords change (a new version), so that the partition would disagree with it."""
    reference = adam_mini.Adam_mini([("x", torch.nn.Parameter(torch.zeros(2, 2)))], verbose=False)
    assert set(mini.QUERY_KEY_NAMES) == reference.wqk_names
    assert set(mini.PER_ROW_NAMES) == reference.wv_names | reference.attn_proj_names | reference.mlp_names
    keyword = mini.PACKAGE_KEYWORD
    assert keyword["per_row"] in reference.embd_names and keyword["per_head"] in reference.wqk_names
    assert keyword["per_entry"] in reference.adam_block_names
    every = (reference.embd_names | reference.output_names | reference.wqk_names | reference.wv_names
             | reference.attn_proj_names | reference.mlp_names | reference.adam_block_names)
    assert not any(name in keyword["per_tensor"] for name in every)  # the package's last branch: one value per tensor


def test_a_model_it_cannot_place_is_refused_with_the_tensor_named():
    """Red when an unknown matrix is let through (the package would give it one value for the whole matrix) or a
    model without head counts gets the package's defaults (dim 2048, 32 heads)."""
    model = _model()
    model.model.layers[0].add_module("fused_qkv", torch.nn.Linear(DIM, 3 * DIM, bias=False))
    with pytest.raises(UserError, match=r"model\.layers\.0\.fused_qkv\.weight \(96, 32\).*Fix: optimizer=adamw"):
        mini.AdamMiniBlocks()(model)
    with pytest.raises(UserError, match=r"no config\.hidden_size, config\.num_attention_heads"):
        mini.AdamMiniBlocks()(torch.nn.Linear(4, 4))
    with pytest.raises(UserError, match="optimizer.partition._target_=rlhf.optim.mini.AdamMiniBlocks"):
        mini.AdamMini(_model().parameters(), dim=DIM, n_heads=HEADS)


@pytest.mark.parametrize("hardware", ["fsdp", "zero1", "zero2", "zero3"])
def test_a_sharded_strategy_is_refused_with_the_reason(hardware):
    """Red when the refusal is gone: each process would keep per-row and per-head moments of its shards."""
    with pytest.raises(UserError, match="keeps one second moment per row, head or tensor of each whole matrix"):
        check_config(compose_config("optimizer=adam_mini", f"hardware={hardware}",
                                    output_dir=ROOT / "outputs" / "unused"))


def test_dimensions_in_the_yaml_or_another_partition_are_refused():
    for override, message in [("+optimizer.n_heads=8", "optimizer.n_heads: Adam-mini's dimensions are read"),
                              ("optimizer.partition._target_=rlhf.optim.partition.DecayMatrices",
                               "Adam-mini's parameter groups are its block rules")]:
        with pytest.raises(UserError, match=message):
            check_config(compose_config("optimizer=adam_mini", override, output_dir=ROOT / "outputs" / "unused"))


def test_a_run_records_groups_that_pair_with_the_parts(tmp_path):
    """``algo=dpo optimizer=adam_mini`` trains (finite loss), and partition.json's rows are the checkpoint's
    parameter groups in order (rule for rule, tensor for tensor)."""
    train(compose_config(*FAST, "algo=dpo", "optimizer=adam_mini", "train.max_steps=2", "train.save_every_steps=2",
                         output_dir=tmp_path))
    rows = json.loads((tmp_path / "partition.json").read_text())["parts"]
    saved = torch.load(tmp_path / checkpoint.FOLDER / f"{checkpoint.PREFIX}{2:08d}" / "optimizer.pt",
                       weights_only=True)
    assert [r["rule"] for r in rows] == [g["rule"] for g in saved["param_groups"]]
    assert [r["tensors"] for r in rows] == [len(g["params"]) for g in saved["param_groups"]]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
