"""Optimizers with a train and an eval mode (schedule-free AdamW): the evaluation weights wherever the model is
evaluated, sampled from or saved, the training weights for every step and after a resume (rlhf/run/optimizer_modes.py
and its uses in the loop and in rlhf/algos/online.py)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.core.errors import UserError
from rlhf.run import checkpoint, optimizer_modes
from tests.conftest import FAST, assert_equal_trees, compose_config, installed

pytestmark = pytest.mark.skipif(not installed("schedulefree"), reason="needs the [optimizers] extra (schedulefree)")

SCHEDULE_FREE = ["optimizer=schedule_free_adamw", "optimizer.lr=1e-3", "scheduler=constant",
                 "scheduler.num_warmup_steps=0"]


def _trained(optimizer, steps: int = 3) -> torch.nn.Parameter:
    """Take ``steps`` steps on a 4x4 matrix so that ``z`` and the parameters (``y``) differ; return the matrix."""
    (param,) = optimizer_modes.innermost(optimizer).param_groups[0]["params"]
    for _ in range(steps):
        param.grad = torch.randn_like(param)
        optimizer.step()
    return param


class _Forgetful:
    """A wrapper whose ``train``/``eval`` do not reach the optimizer it wraps (accelerate PR#4161's bug)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def train(self) -> None:
        pass

    def eval(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()


def test_evaluation_weights_reach_the_optimizer_below_its_wrappers_and_the_training_weights_come_back():
    """Accelerate's ``AcceleratedOptimizer`` and DeepSpeed's wrappers keep the optimizer in ``.optimizer``, as
    ``_Forgetful`` does. Break: ``innermost`` returning the outer wrapper (its eval() does nothing) leaves the training weights."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 4))
    inner = optimizer_modes.schedule_free_adamw([param], lr=0.1)
    wrapped = _Forgetful(_Forgetful(inner))  # as Accelerate's wrapper around DeepSpeed's
    _trained(wrapped)
    y = param.detach().clone()
    z = inner.state[param]["z"]
    x = torch.lerp(y, z, 1 - 1 / 0.9)  # the average the package evaluates: y = (1-beta1) z + beta1 x
    assert not torch.allclose(x, y)
    with optimizer_modes.evaluation_weights(wrapped):
        torch.testing.assert_close(param.detach(), x)
    torch.testing.assert_close(param.detach(), y)
    wrapped.step()  # the package refuses a step in eval mode: the block left it in train mode


def test_an_optimizer_without_modes_is_left_alone():
    param = torch.nn.Parameter(torch.ones(2, 2))
    adamw = torch.optim.AdamW([param], lr=0.1)
    _trained(adamw, 1)
    before = param.detach().clone()
    assert not optimizer_modes.has_modes(adamw)
    with optimizer_modes.evaluation_weights(adamw):
        assert torch.equal(param, before)
    optimizer_modes.training_weights(adamw)
    optimizer_modes.check_reaches(adamw, torch.nn.Linear(2, 2))
    assert torch.equal(param, before)


def test_copies_of_the_parameters_are_refused():
    """Break: ``check_reaches`` returning early: a ZeRO-like optimizer over float32 copies would never move the
    model's weights to the evaluation point."""
    model = torch.nn.Linear(3, 3)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    with pytest.raises(UserError, match="copies of the model's parameters.*Fix: hardware=cpu"):
        optimizer_modes.check_reaches(optimizer_modes.schedule_free_adamw(copies), model)
    optimizer_modes.check_reaches(optimizer_modes.schedule_free_adamw(model.parameters()), model)


def test_a_missing_package_names_the_extra(monkeypatch):
    """Break: importing schedulefree without the try: a bare ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "schedulefree", None)  # import schedulefree raises ImportError
    with pytest.raises(UserError, match=r"pip install 'rlhf\[optimizers\]'"):
        optimizer_modes.schedule_free_adamw([torch.nn.Parameter(torch.ones(2))])


def test_a_decaying_schedule_is_warned_about_and_a_warmup_is_not():
    """Break: the check always returning None (or warning for a warmup)."""
    from rlhf.optim import constant_with_warmup, cosine_with_warmup

    def line(make, steps=30):
        return optimizer_modes.decaying_schedule_warning(optimizer, make(optimizer), steps)

    optimizer = optimizer_modes.schedule_free_adamw([torch.nn.Parameter(torch.ones(2))])
    assert "scheduler=constant" in line(lambda o: cosine_with_warmup(o, 10, num_training_steps=30))
    assert line(lambda o: constant_with_warmup(o, 10)) is None
    assert line(lambda o: torch.optim.lr_scheduler.StepLR(o, 10, gamma=0.5)) is not None
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert optimizer_modes.decaying_schedule_warning(adamw, cosine_with_warmup(adamw, 10, num_training_steps=30), 30) is None


@pytest.fixture
def modes_seen(monkeypatch):
    """Record the optimizer's mode at each evaluation, checkpoint, final save and rollout of a run: ``(where,
    train_mode)`` pairs, and the mode at every optimizer step."""
    from rlhf.algos.online import OnlineAlgorithm
    from rlhf.run.components import BuiltRun

    seen: list[tuple[str, bool]] = []
    holder = {}

    def mode() -> bool:
        return optimizer_modes.innermost(holder["optimizer"]).param_groups[0]["train_mode"]

    def spy(where, function):
        def call(*args, **kwargs):
            seen.append((where, mode()))
            return function(*args, **kwargs)
        return call

    def keep(optimizer):
        holder["optimizer"] = optimizer
        return training_weights(optimizer)

    training_weights = optimizer_modes.training_weights
    monkeypatch.setattr(optimizer_modes, "training_weights", keep)  # before_training calls it with the optimizer
    monkeypatch.setattr(BuiltRun, "evaluate", spy("evaluate", BuiltRun.evaluate))
    monkeypatch.setattr(checkpoint, "save", spy("checkpoint", checkpoint.save))
    monkeypatch.setattr(checkpoint, "save_pretrained_atomically", spy("final", checkpoint.save_pretrained_atomically))
    sample = OnlineAlgorithm.sample

    def sampled(self, model, prompts, num_generations, seed):  # seed None: the greedy evaluation's
        seen.append(("rollout" if seed is not None else "evaluate", mode()))
        return sample(self, model, prompts, num_generations, seed)

    monkeypatch.setattr(OnlineAlgorithm, "sample", sampled)
    return seen


def test_dpo_evaluates_checkpoints_and_saves_the_evaluation_weights(fast_config, modes_seen):
    """Break: any one ``with evaluation_weights`` taken out of the loop (_evaluate, _save_checkpoint, _finish)."""
    train(fast_config("algo=dpo", *SCHEDULE_FREE, "train.eval_every_steps=2", "train.save_every_steps=2",
                      "train.eval_at_start=false"))
    wheres = [where for where, _ in modes_seen]
    assert {"evaluate", "checkpoint", "final"} <= set(wheres), wheres
    assert [where for where, train_mode in modes_seen if train_mode] == []  # all in eval mode


def test_grpo_rollouts_sample_with_the_evaluation_weights(fast_config, modes_seen):
    """Break: ``Rollouts.next`` calling ``algo.collect`` outside ``self.sampling_weights()``, or the loop not setting it."""
    train(fast_config("algo=grpo", *SCHEDULE_FREE, "algo/reward_funcs=similarity", "algo.num_generations=4",
                      "algo.max_completion_length=4", "train.max_steps=2", "train.eval_at_start=false"))
    rollouts = [train_mode for where, train_mode in modes_seen if where == "rollout"]
    assert rollouts and not any(rollouts)


def test_a_resume_continues_on_the_training_weights_bit_for_bit(tmp_path, caplog):
    """A run of 6 steps against one resumed from its checkpoint at step 3: the checkpoint holds the evaluation
    weights, the resume rebuilds the training weights from them and ``z``. Break: the resume marking the optimizer
    as in train mode without moving the weights (training on from x): the final weights and the optimizer differ."""
    overrides = [*FAST, "algo=dpo", *SCHEDULE_FREE, "train.max_steps=6", "train.save_every_steps=3",
                 "train.keep_last=null", "train.eval_every_steps=2"]
    train(compose_config(*overrides, output_dir=tmp_path / "whole"))
    step_3 = tmp_path / "whole" / checkpoint.FOLDER / f"{checkpoint.PREFIX}{3:08d}"
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        train(compose_config(*overrides, f"resume={step_3}", output_dir=tmp_path / "resumed"))
    assert not [r for r in caplog.records if "schedule-free" in r.getMessage()]  # scheduler=constant: no warning
    whole, resumed = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("whole", "resumed"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    last = f"{checkpoint.FOLDER}/{checkpoint.PREFIX}{6:08d}/optimizer.pt"
    x, y = (torch.load(tmp_path / r / last, weights_only=True) for r in ("whole", "resumed"))
    assert_equal_trees(x, y, "optimizer.pt")
    assert not x["param_groups"][0]["train_mode"]  # saved with the evaluation weights
