"""Non-finite losses and gradients: detected on the step they appear, skipped or stopped, never saved."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.run import checkpoint
from rlhf.run.nonfinite import NonFinite
from tests.conftest import FAST, ROOT

NAN = ["algo=sft", "algo._target_=tests.nonfinite_loss.NaNAt"]


def _finite_folder(folder) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(folder / "model.safetensors").values())


def test_a_real_divergence_stops_with_the_step_and_causes_and_saves_nothing_nonfinite(fast_config, tmp_path):
    cfg = fast_config("algo=sft", "optimizer=sgd", "optimizer.lr=1e12", "train.max_grad_norm=null",
                      "train.on_nonfinite=stop", "train.max_steps=30", "train.save_every_steps=1")
    with pytest.raises(NonFinite, match=r"step \d+: .*not finite.*Likely causes: a learning rate too high") as stopped:
        train(cfg)
    run = tmp_path / "run"
    assert not (run / "final").exists() and not (run / "summary.json").exists()
    saved = checkpoint.complete(run)  # the steps before the divergence (the first is at lr 0: warmup)
    assert saved and checkpoint.step_of(saved[-1]) < int(re.search(r"step (\d+)", str(stopped.value)).group(1))
    assert all(_finite_folder(c) for c in saved)


def test_skipped_steps_are_counted_and_leave_the_model_finite(fast_config, tmp_path):
    metrics = train(fast_config(*NAN, "+algo.calls=[1,2]", "train.max_steps=5"))
    assert metrics["train/nonfinite_steps"] == 2 and metrics["train/loss"] == metrics["train/loss"]  # not NaN
    assert _finite_folder(tmp_path / "run" / "final")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = {line["step"]: line.get("train/nonfinite_steps", 0) for line in lines if "train/lr" in line}
    assert skipped == {1: 0, 2: 1, 3: 2, 4: 2, 5: 2}  # detected on the step it appeared
    assert all("train/loss" not in line for line in lines if line["step"] in (2, 3))  # NaN never averaged in


def test_too_many_in_a_row_stops(fast_config, tmp_path):
    with pytest.raises(NonFinite, match=r"step 3: .*3 steps in a row \(train.max_nonfinite_in_row=3\)"):
        train(fast_config(*NAN, "train.max_nonfinite_in_row=3", "train.max_steps=10"))
    assert not (tmp_path / "run" / "final").exists()


def test_under_gradient_accumulation_one_nan_micro_batch_skips_the_whole_step(fast_config, tmp_path):
    metrics = train(fast_config(*NAN, "+algo.calls=[3]", "train.grad_accumulation_steps=2", "train.max_steps=3"))
    assert metrics["train/nonfinite_steps"] == 1  # call 3 is the 2nd micro-batch of step 2


def test_the_cli_exits_non_zero_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "train.py", *FAST, *NAN, "train.on_nonfinite=stop", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "error: step 1: the loss or the gradient norm" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "final").exists()


@pytest.mark.serial
def test_a_nonfinite_loss_on_one_process_skips_the_step_on_both(fast_config, tmp_path):
    """Rank 1's loss is NaN but its gradients are finite, so DDP's all-reduce spreads nothing: only the vote over
    the processes makes rank 0 skip the step too. Each rank's parameters are read back from its own checkpoint
    file (the test algorithm saves them) and must be the same."""
    metrics = train(fast_config(*NAN, "+algo.calls=[1]", "+algo.rank=1", "+algo.nan_gradients=false",
                                "hardware=cpu_ddp", "train.per_device_batch_size=2", "train.max_steps=4",
                                "train.save_every_steps=4", "hardware.timeout_s=60"))  # a rank left waiting fails
    assert metrics["train/nonfinite_steps"] == 1  # both ranks skipped step 2 together: the DDP run finished
    run = tmp_path / "run"
    assert _finite_folder(run / "final")
    ranks = [torch.load(run / "checkpoints" / "step_00000004" / f"rank_{r}.pt", weights_only=True)["algo"]
             for r in (0, 1)]
    assert [r["count"] for r in ranks] == [4, 4]
    assert torch.equal(ranks[0]["parameters"], ranks[1]["parameters"]), "the ranks' models diverged"
