"""Which tensors get which rule (rlhf/optim/partition.py): every trainable tensor in exactly one part, the embedding
and output layer by role (tied or not), LoRA's factors, the shared layers of a reference, and the default partition
the same groups as before it was a component."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.embedded.tiny_model import TinySpec
from rlhf.optim.partition import DecayMatrices, HiddenMatrices
from rlhf.optim.rules import MuonWithAdamW


def _policy(tied: bool = True):
    policy = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, warm_start_steps=0).build()
    if not tied:  # an output layer of its own, as most real models above 1B have
        model = policy.model
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    return policy


def _check_counts(model, split) -> dict[str, set[str]]:
    """Every trainable tensor in exactly one part, and the parts' parameter counts the model's."""
    trainable = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}  # a tied tensor once
    placed = [id(p) for part in split.parts for p in part.params]
    assert sorted(placed) == sorted(trainable) and len(set(placed)) == len(placed)
    rows = split.rows()
    assert sum(r["parameters"] for r in rows) == sum(p.numel() for _, p in trainable.values())
    assert sum(r["tensors"] for r in rows) == len(trainable)
    return {part.name: set(part.names) for part in split.parts}


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_matrices_go_to_muon_and_the_embedding_and_output_layer_by_role_to_adamw(tied):
    """Red when the output layer is told by shape (it is a matrix: it would land among the hidden ones)."""
    model = _policy(tied).model
    parts = _check_counts(model, HiddenMatrices()(model))
    hidden, outer, vectors = parts.values()
    assert outer == ({"model.embed_tokens.weight"} if tied else {"model.embed_tokens.weight", "lm_head.weight"})
    assert len(hidden) == 2 * 7 and all(".layers." in n and n.endswith("proj.weight") for n in hidden)
    assert vectors and all("norm" in n for n in vectors)


def test_lora_factors_are_the_hidden_matrices_and_nothing_frozen_is_placed():
    """peft=lora: only A and B train; both go to Muon (each is a hidden layer's matrix, of rank r)."""
    from rlhf.models.adapters import LoRA

    model = LoRA(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]).apply(_policy().model)
    parts = _check_counts(model, HiddenMatrices()(model))
    hidden, outer, vectors = parts.values()
    assert len(hidden) == 2 * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in hidden)
    assert not outer and not vectors


def test_a_reference_that_shares_the_policys_first_layers_leaves_them_out():
    """algo/reference=shared_layers freezes the shared layer in the policy: the partition counts what trains."""
    from rlhf.models.reference import SharedLayers

    policy = _policy()
    SharedLayers(num_shared_layers=1)(policy.model, policy.tokenizer)
    parts = _check_counts(policy.model, HiddenMatrices()(policy.model))
    assert parts["hidden matrices"] and not any(".layers.0." in n for names in parts.values() for n in names)


def test_the_default_partition_is_the_groups_every_optimizer_had():
    """DecayMatrices: matrices with the optimizer's decay first, biases/norms/1-D at 0 (red: any other grouping)."""
    model = _policy().model
    split = DecayMatrices()(model)
    groups = split.groups()
    assert [sorted(g) for g in groups] == [["params"], ["params", "weight_decay"]] and groups[1]["weight_decay"] == 0.0
    names = dict(model.named_parameters())
    assert [id(p) for p in groups[0]["params"]] == [id(p) for n, p in names.items() if p.ndim == 2 and "norm" not in n]
    _check_counts(model, split)


def test_the_record_names_each_tensor_with_its_rule_and_rates():
    model = _policy().model
    split = HiddenMatrices()(model)
    optimizer = MuonWithAdamW(split.groups(), lr=2e-4, adjust_lr_fn="match_rms_adamw", adamw={"lr": 3e-4})
    record = json.loads(split.record(optimizer))
    assert record["partition"] == "rlhf.optim.partition.HiddenMatrices"
    assert [(r["rule"], r["lr"], r["weight_decay"]) for r in record["parts"]] == [
        ("muon", 2e-4, 0.0), ("adamw", 3e-4, 0.01), ("adamw", 3e-4, 0.0)]
    line = split.describe(optimizer)
    assert line.startswith("optimizer partition (rlhf.optim.partition.HiddenMatrices): muon: hidden matrices 14 "
                           "tensor(s), ") and "lr 0.0002 (match_rms_adamw)" in line
