"""optimizer=galore and optimizer=apollo (rlhf/optim/low_rank.py): the partition projects the hidden matrices only,
each to a rank that fits it; GaLore's updates of a matrix stay in one rank-r subspace between refreshes; APOLLO's
moments are r x n and its update is the gradient scaled channel by channel; a resume from a weights-only checkpoint
continues bit for bit; the config is checked before anything loads."""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch

from rlhf import optim
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from tests.conftest import ROOT, assert_equal_trees, compose_config, fast_initial_model, installed

pytestmark = pytest.mark.skipif(not installed("apollo_torch"), reason="apollo-torch (rlhf[optimizers]) not installed")

HIDDEN = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj"}


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 12), generator=generator) for _ in range(count)]


def _train(model, optimizer, batches) -> None:
    for ids in batches:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


def _optimizer(kind: str, model, **partition):
    from rlhf.optim import low_rank

    if kind == "galore":
        split = low_rank.LowRankMatrices(**partition)(model)
        return split, low_rank.GaLoreAdamW(split.groups(), lr=1e-2)
    split = low_rank.ApolloMatrices(**partition)(model)
    return split, low_rank.APOLLOAdamW(split.groups(), lr=1e-2)


def test_a_matrix_rank_is_the_configured_one_clipped_to_the_matrix():
    """Red when the clip is gone (rank 128 on the embedded default's 128-wide matrices: moments as large as Adam's)."""
    from rlhf.optim.low_rank import matrix_rank

    assert matrix_rank((128, 128), 128, 0.25) == 32  # the embedded default
    assert matrix_rank((576, 576), 128, 0.25) == 128 and matrix_rank((1536, 576), 128, 0.25) == 128  # smollm2-135m
    assert matrix_rank((192, 576), 128, 0.25) == 48  # its k/v projections
    assert matrix_rank((16, 64), 8, 0.25) == 4 and matrix_rank((2, 64), 8, 0.25) == 1


@pytest.mark.parametrize("tied", [True, False])
def test_the_partition_projects_the_hidden_matrices_and_nothing_else(tied):
    """Red when the embedding or the output layer (matrices, told apart by role) or a norm lands in a low-rank group,
    or when a tensor is left out or counted twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.optim.low_rank import ApolloMatrices

    model = fast_initial_model() if tied else LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=False))
    split = ApolloMatrices(rank=128)(model)
    low, outer, vectors = split.parts[0], split.parts[-2], split.parts[-1]
    assert len(split.parts) == 3 and low.overrides == {"rank": 8, "update_proj_gap": 200, "scale": 1.0,
                                                       "proj_type": "std", "proj": "random", "scale_type": "channel"}
    assert sorted(n.split(".", 3)[3].removesuffix(".weight") for n in low.names) == sorted(HIDDEN)
    assert outer.names == ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    assert "rank" not in outer.group() and "rank" not in vectors.group() and vectors.overrides == {"weight_decay": 0.0}
    assert all(p.ndim == 1 for p in vectors.params)
    assert sum(p.numel() for part in split.parts for p in part.params) == sum(p.numel() for p in model.parameters())


def test_a_model_without_hidden_matrices_is_a_clear_error():
    from rlhf.optim.low_rank import LowRankMatrices

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    model[0].weight.requires_grad_(False)
    with pytest.raises(UserError, match="has none that train .*Fix: train the hidden layers"):
        LowRankMatrices()(model)


def test_galore_updates_a_matrix_in_one_rank_r_subspace_between_refreshes():
    """Red when a hidden matrix's group carries no rank (plain AdamW: a full-rank update), or when the projection is
    not carried from one step to the next (a new SVD each step: three subspaces). The embedding is not projected:
    its update has full rank."""
    torch.manual_seed(0)
    model = fast_initial_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    split, optimizer = _optimizer("galore", model, rank=2, update_proj_gap=100)
    _train(model, optimizer, _batches(3))
    for name, param in model.named_parameters():
        delta = (param.detach() - before[name]).double()
        if name in split.parts[0].names:
            assert torch.linalg.matrix_rank(delta, rtol=1e-6) <= 2, name
            assert optimizer.state[param]["projection"].shape[0] in (2, 32), name  # a tensor in the state
    embedding = model.model.embed_tokens.weight.detach() - before["model.embed_tokens.weight"]
    assert torch.linalg.matrix_rank(embedding.double(), rtol=1e-6) > 2


def test_apollo_keeps_moments_in_rank_r_and_scales_the_gradient_channel_by_channel():
    """Red when the moments are full-size (no rank in the group: AdamW's 8 bytes per parameter) or when the update is
    not the gradient scaled per channel (rows of a square matrix, the library's choice)."""
    from rlhf.telemetry.optimizer_state import state_bytes

    torch.manual_seed(0)
    model = fast_initial_model()
    split, optimizer = _optimizer("apollo", model, rank=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, optimizer, _batches(1))
    for param in split.parts[0].params:
        assert 4 in optimizer.state[param]["exp_avg"].shape and param.numel() > 4 * max(param.shape)
        assert optimizer.state[param]["exp_avg"].numel() == 4 * max(param.shape)
    q = model.model.layers[0].self_attn.q_proj.weight
    ratio = (q.detach() - before["model.layers.0.self_attn.q_proj.weight"]) / q.grad  # one factor per row
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-3)
    assert ratio[:, 0].std() > 1e-3 * ratio[:, 0].abs().mean()  # channel-wise, not one factor for the tensor
    assert state_bytes(optimizer) / sum(p.numel() for p in model.parameters()) < 0.6 * 8  # AdamW: 8 bytes


@pytest.mark.parametrize("kind", ["galore", "apollo"])
def test_a_resume_from_a_weights_only_checkpoint_continues_bit_for_bit(kind):
    """Red when the library's projector objects stay in the state (torch.load(weights_only=True) refuses them), when
    the projection is not saved (a resumed step draws or computes another), or, for APOLLO, when a refresh does not
    draw its next random projection (the seed not advanced). Refreshes at steps 0 and 3 (update_proj_gap=3), the
    second after the resume at 2."""
    torch.manual_seed(0)
    start, batches = fast_initial_model(), _batches(4)
    whole = copy.deepcopy(start)
    _, optimizer = _optimizer(kind, whole, rank=4, update_proj_gap=3)
    _train(whole, optimizer, batches[:3])
    q = whole.model.layers[0].self_attn.q_proj.weight
    first = optimizer.state[q]["projection"].clone()
    _train(whole, optimizer, batches[3:])
    assert not torch.equal(first, optimizer.state[q]["projection"]), "the refresh at step 3 kept the old projection"

    resumed = copy.deepcopy(start)
    _, optimizer_2 = _optimizer(kind, resumed, rank=4, update_proj_gap=3)
    _train(resumed, optimizer_2, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "optimizer": optimizer_2.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(start)
    resumed.load_state_dict(saved["model"])
    _, optimizer_3 = _optimizer(kind, resumed, rank=4, update_proj_gap=3)
    optimizer_3.load_state_dict(saved["optimizer"])
    _train(resumed, optimizer_3, batches[2:])
    for (name, x), y in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(x, y), name
    assert_equal_trees(optimizer.state_dict(), optimizer_3.state_dict(), "optimizer")


def _check(*overrides: str) -> None:
    check_config(compose_config(*overrides, output_dir=ROOT / "outputs" / "unused"))


@pytest.mark.parametrize("option", ["galore", "apollo"])
@pytest.mark.parametrize("hardware", ["fsdp", "zero1", "zero2", "zero3"])
def test_a_strategy_that_shards_the_matrices_is_refused_with_the_reason(option, hardware):
    """Red when the optimizer does not say it needs whole matrices: the run would project shards."""
    with pytest.raises(UserError) as error:
        _check(f"optimizer={option}", f"hardware={hardware}")
    assert "projects each hidden matrix's gradient" in str(error.value) and f"hardware={hardware}" in str(error.value)


@pytest.mark.parametrize("option", ["galore", "apollo"])
def test_replicas_are_accepted(option):
    _check(f"optimizer={option}", "hardware=cpu_ddp")


@pytest.mark.parametrize(("option", "override", "message"), [
    ("galore", "~optimizer.partition", "no group has one and every tensor would get plain AdamW. Fix: "
     "optimizer.partition._target_=rlhf.optim.low_rank.LowRankMatrices"),
    ("apollo", "optimizer.partition._target_=rlhf.optim.low_rank.LowRankMatrices",
     "it lacks proj, scale_type, which APOLLOAdamW needs). Fix: optimizer.partition._target_="
     "rlhf.optim.low_rank.ApolloMatrices"),
    # GaLore always projects by SVD: APOLLO's partition (proj=random, scale_type) would be accepted and ignored.
    # Red when the check accepts a subclass of GaLore's partition (issubclass instead of the class itself).
    ("galore", "optimizer.partition._target_=rlhf.optim.low_rank.ApolloMatrices",
     "it adds proj, scale_type, which GaLoreAdamW ignores). Fix: optimizer.partition._target_="
     "rlhf.optim.low_rank.LowRankMatrices"),
    ("galore", "+optimizer.partition.rnak=4", "optimizer.partition.rnak: rlhf.optim.low_rank.LowRankMatrices has no "
     "argument 'rnak'"),
    ("galore", "optimizer.partition.rank=0", "optimizer.partition.rank=0 must be a whole number >= 1"),
    ("apollo", "optimizer.partition.max_rank_fraction=2", "optimizer.partition.max_rank_fraction=2 must be in (0, 1]"),
    ("apollo", "optimizer.partition.proj_type=full", "optimizer.partition.proj_type='full' is not one of std"),
    ("apollo", "optimizer.partition.scale_type=row", "optimizer.partition.scale_type='row' is not one of APOLLO's"),
    ("apollo", "optimizer.lr=0", "optimizer.lr=0 must be > 0"),
])
def test_its_fields_are_checked_before_anything_loads(option, override, message):
    with pytest.raises(UserError) as error:
        _check(f"optimizer={option}", override)
    assert message in str(error.value)


def test_without_the_library_the_error_names_the_extra(monkeypatch):
    """Red when a missing apollo-torch ends in a raw ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "apollo_torch", None)  # import apollo_torch raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "rlhf.optim.low_rank", raising=False)
    monkeypatch.delattr(optim, "low_rank", raising=False)  # the package's attribute would find the module again
    with pytest.raises(UserError, match=r"needs the package apollo-torch.*pip install 'rlhf\[optimizers\]'"):
        _check("optimizer=apollo")
