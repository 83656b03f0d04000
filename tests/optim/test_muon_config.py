"""optimizer=muon's config checks before anything loads (rlhf/config/checks.py, MuonWithAdamW.check_options): a
sharding strategy refused with the reason, DDP accepted, the AdamW rule's fields and ranges checked like any
optimizer's."""

from __future__ import annotations

import pytest

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from tests.conftest import ROOT, compose_config


def _check(*overrides: str) -> None:
    check_config(compose_config("optimizer=muon", *overrides, output_dir=ROOT / "outputs" / "unused"))


@pytest.mark.parametrize("hardware", ["fsdp", "zero1", "zero2", "zero3"])
def test_a_strategy_that_shards_the_matrices_is_refused_with_the_reason(hardware):
    """Red when the check is gone: the run would start and Muon would see shards (or raise on flat ones)."""
    with pytest.raises(UserError) as error:
        _check(f"hardware={hardware}")
    message = str(error.value)
    assert message.startswith("optimizer=MuonWithAdamW orthogonalizes each hidden matrix whole")
    assert f"hardware={hardware}" in message and "Fix: hardware=cpu_ddp or ddp" in message


@pytest.mark.parametrize("hardware", ["cpu", "cpu_ddp", "ddp", "auto"])
def test_strategies_that_hold_whole_matrices_are_accepted(hardware):
    _check(f"hardware={hardware}")


@pytest.mark.parametrize(("override", "message"), [
    ("+optimizer.adamw.lrr=1e-3", "optimizer.adamw.lrr: torch.optim.AdamW has no argument 'lrr'. Fix: optimizer.adamw.lr"),
    ("optimizer.adamw.lr=0", "optimizer.adamw.lr=0 must be > 0 (peak learning rate)"),
    ("optimizer.adamw.betas=[0.9,1.0]", "optimizer.adamw.betas[1]=1.0 must be in [0, 1)"),
    ("optimizer.lr=-1", "optimizer.lr=-1 must be > 0 (peak learning rate). Fix: optimizer.lr=0.0001"),
    ("optimizer.momentum=1", "optimizer.momentum=1 must be in [0, 1)"),
    ("optimizer.ns_steps=0", "optimizer.ns_steps=0: Newton-Schulz iterations, a whole number in [1, 100)"),
    ("optimizer.adjust_lr_fn=match_rms", "optimizer.adjust_lr_fn='match_rms' is not one of torch.optim.Muon's"),
    ("optimizer.partition._target_=rlhf.optim.partition.Hidden", "optimizer.partition._target_=rlhf.optim.partition.Hidden"),
    ("+optimizer.partition.matrices=muon", "optimizer.partition.matrices: rlhf.optim.partition.HiddenMatrices has no argument 'matrices'. It takes none. Fix: leave optimizer.partition.matrices out."),
])
def test_its_fields_are_checked_before_anything_loads(override, message):
    with pytest.raises(UserError) as error:
        _check(override)
    assert message in str(error.value)


def test_a_torch_without_muon_is_told_the_version_it_needs(monkeypatch):
    """Red when the check lets a torch without torch.optim.Muon through (an AttributeError at the build)."""
    import torch

    from rlhf.optim.rules import MuonWithAdamW

    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(UserError, match=r"torch.optim.Muon.*torch 2.9.*Fix: pip install -U torch"):
        MuonWithAdamW.check_options({"adamw": {}}, "optimizer")
