"""optimizer=prodigy (rlhf/optim/prodigy.py): learning-rate free as Mishchenko & Defazio 2023 claim
(https://arxiv.org/abs/2306.06101): on a quadratic whose solution is at a known distance, the step size d grows
from d0 to that distance's scale, 100x apart for solutions 100x apart, with lr=1 and nothing tuned; a loss scaled
by 10 takes the same path; a run trains, keeps d and p0 in what it saves, and sharded strategies are refused."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf import train
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.run import checkpoint
from tests.conftest import FAST, ROOT, compose_config

pytest.importorskip("prodigyopt")
from rlhf.optim.prodigy import Prodigy  # noqa: E402  (after the skip: the package is an optional extra)


def _descend(distance: float, loss_scale: float = 1.0, steps: int = 200, **options) -> tuple[Prodigy, torch.Tensor, torch.Tensor]:
    """Prodigy from 0 on ``loss_scale x 0.5 ||x - x*||^2``, x* ~ N(0, distance^2) per entry."""
    generator = torch.Generator().manual_seed(0)
    solution = distance * torch.randn(64, 16, generator=generator)
    x = torch.nn.Parameter(torch.zeros(64, 16))
    optimizer = Prodigy([x], **options)
    for _ in range(steps):
        optimizer.zero_grad()
        (loss_scale * 0.5 * (x - solution).square().sum()).backward()
        optimizer.step()
    return optimizer, x.detach(), solution


@pytest.mark.parametrize("distance", [0.01, 1.0])
def test_d_grows_from_d0_to_the_distance_to_the_solution(distance):
    """Red when d cannot grow (growth_rate=1: d stays near d0 and x barely moves)."""
    optimizer, x, solution = _descend(distance)
    per_entry = solution.abs().mean().item()  # the step a tuned Adam-like lr would have to cover
    assert 0.1 * per_entry < optimizer.d < per_entry, (optimizer.d, per_entry)
    assert (x - solution).abs().mean().item() < 1e-3 * per_entry


def test_a_loss_scaled_by_ten_takes_the_same_path():
    """d is invariant to the loss's scale (both of d's sums scale alike) and so, but for the denominator term eps,
    are the iterates (Adam's ratio). Red when eps is not negligible (1e-2 in place of the configured 1e-8)."""
    one, x_one, solution = _descend(1.0, steps=50)
    ten, x_ten, _ = _descend(1.0, loss_scale=10.0, steps=50)
    assert ten.d == pytest.approx(one.d, rel=1e-5)
    assert (x_ten - x_one).abs().max().item() < 1e-2 * solution.abs().mean().item()


@pytest.mark.parametrize("hardware", ["fsdp", "zero1", "zero2", "zero3"])
def test_a_sharded_strategy_is_refused_with_the_reason(hardware):
    """Red when the refusal is gone: each process would estimate its own d from its shard."""
    with pytest.raises(UserError, match="estimates its step size d from sums over every parameter"):
        check_config(compose_config("optimizer=prodigy", f"hardware={hardware}", output_dir=ROOT / "outputs" / "unused"))


@pytest.mark.parametrize(("override", "message"), [("optimizer.d0=0", "optimizer.d0=0: the initial estimate of d"),
                                                   ("optimizer.growth_rate=0.5", "a factor >= 1"),
                                                   ("optimizer.slice_p=0", "a whole number >= 1")])
def test_its_fields_are_checked_before_anything_loads(override, message):
    with pytest.raises(UserError, match=message):
        check_config(compose_config("optimizer=prodigy", override, output_dir=ROOT / "outputs" / "unused"))


def test_a_run_trains_and_saves_d_and_the_initial_weights(tmp_path):
    """``algo=dpo optimizer=prodigy``: a finite loss, d grown from d0 in the saved groups (slowly on these noisy
    gradients: d_hat stays below d0 = 1e-6 for seven steps, and d passes it at the eighth), and the state the memory
    figures count: four float32 tensors per parameter (two moments, s, and p0, a copy of the initial weights)."""
    train(compose_config(*FAST, "algo=dpo", "optimizer=prodigy", "scheduler=constant",
                         "scheduler.num_warmup_steps=0", "train.max_steps=8", "train.save_every_steps=8", output_dir=tmp_path))
    saved = torch.load(tmp_path / checkpoint.FOLDER / f"{checkpoint.PREFIX}{8:08d}" / "optimizer.pt",
                       weights_only=True)
    assert saved["param_groups"][0]["d"] > saved["param_groups"][0]["d0"]
    numel = sum(state["exp_avg"].numel() for state in saved["state"].values())
    held = sum(t.numel() * t.element_size() for state in saved["state"].values() for t in state.values()
               if isinstance(t, torch.Tensor))
    assert held == 16 * numel and all(state["p0"].numel() == state["exp_avg"].numel() for state in saved["state"].values())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
