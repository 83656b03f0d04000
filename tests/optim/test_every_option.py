"""Every option of ``conf/optimizer`` in a real run (``algo=dpo optimizer=<name>`` on the tiny model), held to the
project's promises whatever the optimizer's library does inside ``step()``:

- a run resumed from its step-2 checkpoint ends as the uninterrupted run, bit for bit: weights and the
  optimizer's whole state (bitsandbytes' 8-bit states and code books, heavyball's nested state, Prodigy's estimate);
- the first step's logged gradient norm is every option's same number (the same model, data and seed: an optimizer
  that cleared or changed the gradients before the loop measured them shows), and finite clipping runs with it;
- a step whose loss is not finite is skipped: the weights and the optimizer's state after it are those before it;
- the memory preflight's optimizer bytes are the state the optimizer holds after its steps (within 5%).

The options are read from the folder, so an option added later is held to the same promises without a new test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.run import checkpoint
from tests.conftest import FAST, ROOT, assert_equal_trees, compose_config

OPTIONS = sorted(path.stem for path in (ROOT / "conf" / "optimizer").glob("*.yaml"))
RUN = [*FAST, "algo=dpo", "scheduler=constant", "train.eval_at_start=false", "train.save_every_steps=2",
       "train.keep_last=null", "train.max_grad_norm=0.01"]  # clipping active: DPO's first gradient norm is ~0.05
NAN = [*FAST, "algo=sft", "algo._target_=tests.nonfinite_loss.NaNAt", "+algo.calls=[1]", "scheduler=constant",
       "train.eval_at_start=false", "train.save_every_steps=1", "train.keep_last=null", "train.max_steps=2"]


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _step(run: Path, step: int) -> Path:
    return run / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"


@pytest.fixture(scope="module")
def first_grad_norm(tmp_path_factory) -> float:
    """The first step's gradient norm of the same run with plain SGD (one step): what every option must log."""
    run = tmp_path_factory.mktemp("sgd")
    train(compose_config(*RUN, "optimizer=sgd", "train.max_steps=1", output_dir=run))
    return next(line["train/grad_norm"] for line in _lines(run) if "train/grad_norm" in line)


@pytest.mark.parametrize("option", OPTIONS)
def test_resume_is_bit_identical_and_the_gradient_norm_and_memory_are_the_loops(option, tmp_path, first_grad_norm):
    """Red when an optimizer's state is not all in its state_dict (a resumed run diverges), when its step clears or
    changes the gradients before the norm is taken, or when the preflight counts its state wrong by more than 5%."""
    whole = tmp_path / "whole"
    train(compose_config(*RUN, f"optimizer={option}", "train.max_steps=4", output_dir=whole))
    train(compose_config(*RUN, f"optimizer={option}", "train.max_steps=4", f"resume={_step(whole, 2)}",
                         output_dir=tmp_path / "resumed"))  # the same run, from its step-2 checkpoint
    left, right = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("whole", "resumed"))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left), "parameters differ"
    x, y = (torch.load(_step(tmp_path / r, 4) / "optimizer.pt", weights_only=True) for r in ("whole", "resumed"))
    assert x["state"], f"optimizer={option} saved no state"
    assert_equal_trees(x, y, "optimizer.pt")
    first = next(line for line in _lines(whole) if "train/grad_norm" in line)
    assert first["step"] == 1 and first["train/grad_norm"] == first_grad_norm, "the first gradient norm differs"
    summary = json.loads((whole / "summary.json").read_text())
    held, predicted = summary["memory_held_mb"]["optimizer_state"], summary["memory_held_mb"]["optimizer_state_predicted"]
    assert held == pytest.approx(predicted, rel=0.05), f"optimizer state {held:.4f} MB against {predicted:.4f} predicted"


@pytest.mark.parametrize("option", OPTIONS)
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_they_were(option, tmp_path):
    """Red when an optimizer is stepped (or counts a step) on a step whose loss is not finite."""
    run = tmp_path / "run"
    metrics = train(compose_config(*NAN, f"optimizer={option}", output_dir=run))
    assert metrics["train/nonfinite_steps"] == 1
    before, after = _step(run, 1), _step(run, 2)
    assert_equal_trees(load_file(before / "model.safetensors"), load_file(after / "model.safetensors"), "weights")
    x, y = (torch.load(folder / "optimizer.pt", weights_only=True) for folder in (before, after))
    for groups in (x["param_groups"], y["param_groups"]):  # the schedule moves on over a skipped step, as it counts
        for group in groups:
            group.pop("lr")
    assert_equal_trees(x, y, "optimizer.pt")  # the state and every other group setting (Prodigy's d, its sums)
