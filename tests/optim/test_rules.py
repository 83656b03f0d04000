"""Muon on the hidden matrices, AdamW on the rest, as one optimizer (rlhf/optim/rules.py, rlhf/optim/partition.py):
each tensor gets the update its rule makes, the schedule reaches every rule, and a state dict resumes bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.optim import cosine_with_warmup
from rlhf.optim.partition import HiddenMatrices
from rlhf.optim.rules import MuonWithAdamW

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}


def _model() -> torch.nn.Module:
    return TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build().model


def _muon(model, **settings) -> MuonWithAdamW:
    return MuonWithAdamW(HiddenMatrices()(model).groups(), **{"lr": 1e-3, "weight_decay": 0.0,
                                                             "adjust_lr_fn": "match_rms_adamw", "adamw": ADAMW,
                                                             **settings})


def _spread_gradients(model, seed: int = 0) -> None:
    """Each gradient a matrix whose singular values spread over two decades (1e-2 .. 1), vectors random."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.ndim == 2:
            rows, cols = param.shape
            u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator))
            v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator))
            k = min(rows, cols)
            param.grad = (u[:, :k] * torch.logspace(-2, 0, k)) @ v[:, :k].T
        else:
            param.grad = torch.randn(param.shape, generator=generator)


def test_a_hidden_matrix_update_is_orthogonalized_and_the_embedding_gets_adamws():
    """A hidden matrix's update has its singular values equal within Newton-Schulz's tolerance (Jordan's quintic
    leaves them in about [0.7, 1.2], from a gradient whose own span 100x); the tied embedding/output layer's update is
    torch's AdamW's to the bit and not orthogonal; the norms' too, with no weight decay. Red when the embedding is
    sent to Muon (its update equal singular values), when the rule muon is not stepped (no hidden update)."""
    model = _model()
    optimizer = _muon(model, weight_decay=0.1)
    _spread_gradients(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    embedding = model.get_input_embeddings().weight
    assert embedding is model.get_output_embeddings().weight  # the embedded model ties them
    twin = torch.nn.Parameter(before["model.embed_tokens.weight"].clone())
    twin.grad = embedding.grad.clone()
    norm = model.model.norm.weight
    norm_twin = torch.nn.Parameter(norm.detach().clone())
    norm_twin.grad = norm.grad.clone()
    optimizer.step()
    for name, param in model.named_parameters():
        if param.ndim != 2 or param is embedding:
            continue
        rows, cols = param.shape
        scale = 1e-3 * 0.2 * max(rows, cols) ** 0.5  # match_rms_adamw's lr for this matrix
        update = (before[name] * (1 - 1e-3 * 0.1) - param.detach()) / scale  # decoupled decay taken out
        values = torch.linalg.svdvals(update)
        assert values.min() > 0.6 and values.max() < 1.3, (name, values.min(), values.max())
        spread = torch.linalg.svdvals(param.grad)
        assert spread.max() / spread.min() > 50  # the gradient itself was far from orthogonal
    torch.optim.AdamW([twin], **ADAMW).step()  # the embedding decays at AdamW's rate, the norm not at all
    torch.optim.AdamW([norm_twin], **{**ADAMW, "weight_decay": 0.0}).step()
    assert torch.equal(embedding.detach(), twin.detach()) and torch.equal(norm.detach(), norm_twin.detach())
    values = torch.linalg.svdvals(before["model.embed_tokens.weight"] - embedding.detach())
    assert values.max() / values.min() > 3  # AdamW's update is no orthogonal matrix


def test_the_schedule_scales_every_rule_and_a_state_dict_resumes_bit_for_bit():
    """LambdaLR's lr reaches Muon's and AdamW's groups (the same dictionaries); an optimizer loaded from a state dict
    after 2 steps continues as the uninterrupted one to the bit (red when the rules' optimizers keep their own state
    or groups after a load)."""
    whole_model = _model()
    whole = _muon(whole_model)
    schedule = cosine_with_warmup(whole, num_warmup_steps=2, num_training_steps=6)
    assert [g is h for g, h in zip(whole.rules["muon"].param_groups, whole.param_groups[:1])] == [True]
    resumed_model = copy.deepcopy(whole_model)
    for step in range(5):
        _spread_gradients(whole_model, seed=step)
        whole.step()
        schedule.step()
        if step == 1:
            state, lr_state = copy.deepcopy(whole.state_dict()), schedule.state_dict()
            resumed_model.load_state_dict(whole_model.state_dict())
    rates = {rule: optimizer.param_groups[0]["lr"] for rule, optimizer in whole.rules.items()}
    assert rates["muon"] == rates["adamw"] == whole.param_groups[0]["lr"] < 1e-3  # the schedule reached both
    resumed = _muon(resumed_model)
    again = cosine_with_warmup(resumed, num_warmup_steps=2, num_training_steps=6)
    resumed.load_state_dict(state)
    again.load_state_dict(lr_state)
    for step in range(2, 5):
        _spread_gradients(resumed_model, seed=step)
        resumed.step()
        again.step()
    for (name, a), b in zip(whole_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


def test_a_model_with_no_hidden_matrix_is_refused_by_name():
    model = _model()
    for name, param in model.named_parameters():
        param.requires_grad_("layers" not in name)  # only the embedding and the final norm train
    with pytest.raises(UserError, match="optimizer=muon updates the hidden layers' matrices, and this model has "
                                        "none that train .* Fix: "):
        HiddenMatrices()(model)


def _two_runs(ns_dtype: str, steps: int = 3):
    """The same matrix stepped by torch.optim.Muon and by rlhf's Muon with ``ns_dtype``; both parameters after."""
    from rlhf.optim.rules import Muon

    generator = torch.Generator().manual_seed(0)
    start = torch.randn(48, 24, generator=generator)
    grads = [torch.randn(48, 24, generator=generator) for _ in range(steps)]
    ours, torchs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    settings = {"lr": 1e-2, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    a, b = Muon([ours], ns_dtype=ns_dtype, **settings), torch.optim.Muon([torchs], **settings)
    for grad in grads:
        ours.grad, torchs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    return start, ours.detach(), torchs.detach(), a


def test_muon_in_bfloat16_is_torchs_own_step_bit_for_bit():
    """Red when the bfloat16 choice runs anything but torch.optim.Muon's step."""
    _, ours, torchs, _ = _two_runs("bfloat16")
    assert torch.equal(ours, torchs)


def test_muon_in_float32_takes_torchs_step_with_a_more_precise_iteration():
    """The float32 iteration: the same momentum, learning-rate scaling and weight decay as torch's (the updates
    agree to bf16's precision; red when the scaling, Nesterov or the decay differ: each moves the update by more
    than 5%), with singular values of the orthogonalized update near 1."""
    from rlhf.optim.rules import orthogonalize

    start, ours, torchs, optimizer = _two_runs("float32")
    moved = (torchs - start).norm()
    assert not torch.equal(ours, torchs) and (ours - torchs).norm() < 0.05 * moved
    update = orthogonalize(torch.randn(48, 24), (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.5 and singular.max() < 1.3
    assert set(optimizer.state[next(iter(optimizer.state))]) == {"momentum_buffer"}  # torch's key: checkpoints swap


def test_auto_iterates_in_float32_only_on_a_cpu_without_bf16_matrix_units(monkeypatch):
    """Red when auto ignores the CPU's bf16 units (float32 everywhere, or bfloat16 on an AVX2 CPU)."""
    from rlhf.optim import rules

    optimizer = rules.Muon([torch.nn.Parameter(torch.zeros(4, 4))])
    monkeypatch.setattr(rules, "cpu_has_bf16_matmul", lambda: False)
    assert optimizer.iteration_dtype(torch.device("cpu")) == torch.float32
    assert optimizer.iteration_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(rules, "cpu_has_bf16_matmul", lambda: True)
    assert optimizer.iteration_dtype(torch.device("cpu")) == torch.bfloat16
    with pytest.raises(UserError, match="ns_dtype='float16'.*Fix: optimizer.ns_dtype=auto"):
        rules.Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype="float16")
