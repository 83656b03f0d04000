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
from tests.conftest import FAST, ROOT, compose_config

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


# --- the verdict kept on the device (train.nonfinite_on_device; torch's fused AdamW, conf/optimizer/adamw.yaml) -----
ON_DEVICE = "train.nonfinite_on_device=true"


def _lines(run) -> list[dict]:
    """metrics.jsonl without the timings (perf/*), which differ between any two runs."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in lines]


def _optimizer_state(run) -> list[torch.Tensor]:
    """Every parameter, and every tensor of the optimizer's state (moments, step count), copied."""
    inner = run.optimizer.optimizer  # inside Accelerate's wrapper
    return [p.detach().clone() for p in run.model.parameters()] + [
        v.clone() for p in run.model.parameters() for v in inner.state.get(p, {}).values()]


def test_on_the_device_a_skipped_step_leaves_parameters_and_optimizer_state_as_they_were(fast_config, monkeypatch):
    """Step 2's loss is NaN: the fused kernel leaves every parameter, moment and the step count as they were, bit
    for bit; the host reads it only at the log window (after step 3, which updates again); the schedule moves on as
    it does when the verdict is read at once."""
    from rlhf.run import loop

    seen = []
    real_step = loop.train_step

    def recorded(run, state, batches, stop, accumulation=None, **options):
        before = _optimizer_state(run)
        outcome = real_step(run, state, batches, stop, accumulation, **options)
        after = _optimizer_state(run)
        same = len(before) == len(after) and all(torch.equal(b, a) for b, a in zip(before, after))
        steps = {float(s["step"]) for s in run.optimizer.optimizer.state.values()}
        seen.append((state.step, same, steps, state.nonfinite_steps, run.scheduler.get_last_lr()[0],
                     run.verdicts is not None))
        return outcome

    monkeypatch.setattr(loop, "train_step", recorded)
    common = [*NAN, "+algo.calls=[1]", "train.max_steps=3", "scheduler.num_warmup_steps=1", "train.log_every_steps=3"]
    assert train(fast_config(*common, ON_DEVICE))["train/nonfinite_steps"] == 1
    assert [step[:4] for step in seen] == [(1, False, {1.0}, 0), (2, True, {1.0}, 0), (3, False, {2.0}, 0)]
    assert all(step[5] for step in seen), "the run read the verdict every step"
    on_device_lrs = [step[4] for step in seen]
    seen.clear()
    train(fast_config(*common, "train.nonfinite_on_device=false"))
    assert [step[3] for step in seen] == [0, 1, 1]  # read at once: counted at its step
    assert [step[4] for step in seen] == on_device_lrs  # the schedule as when the verdict is read at once


def test_on_the_device_the_same_steps_are_skipped_and_the_others_are_the_same_bit_for_bit(tmp_path):
    """NaN at steps 2, 3 and 4 of 6, log windows of 2 steps: the first window's means leave step 2 out (on the
    device), the second window (both skipped) has none, the skips are counted at the windows, and every logged value
    and the final model are those of the run that reads the verdict every step."""
    common = [*NAN, "+algo.calls=[1,2,3]", "train.max_steps=6", "train.log_every_steps=2"]
    runs = {}
    for name, option in (("device", ON_DEVICE), ("host", "train.nonfinite_on_device=false")):
        runs[name] = tmp_path / name
        train(compose_config(*FAST, *common, option, output_dir=runs[name]))
    logged = _lines(runs["device"])
    assert logged == _lines(runs["host"])
    windows = {line["step"]: line for line in logged if "train/lr" in line}
    assert [windows[step].get("train/nonfinite_steps") for step in (2, 4, 6)] == [1, 3, 3]
    assert "train/loss" not in windows[4] and all(windows[s]["train/loss"] == windows[s]["train/loss"] for s in (2, 6))
    device, host = (load_file(runs[name] / "final" / "model.safetensors") for name in ("device", "host"))
    assert device.keys() == host.keys() and all(torch.equal(device[k], host[k]) for k in device)


def test_on_the_device_stop_acts_before_a_checkpoint_is_saved(fast_config, tmp_path):
    """train.on_nonfinite=stop with NaN at step 1: the verdict is read before step 2's checkpoint (the log window
    is at step 4), the run stops naming step 1, and nothing was saved."""
    with pytest.raises(NonFinite, match=r"step 1: .*not finite.*read at step 2.*stopping \(train.on_nonfinite=stop\)"):
        train(fast_config(*NAN, "+algo.calls=[0]", ON_DEVICE, "train.on_nonfinite=stop", "train.max_steps=6",
                          "train.log_every_steps=4", "train.save_every_steps=2"))
    run = tmp_path / "run"
    assert not checkpoint.complete(run) and not (run / "final").exists()


def test_on_the_device_too_many_in_a_row_stop_at_the_log_window(fast_config, tmp_path):
    """Every loss NaN, train.max_nonfinite_in_row=2, a log window of 3 steps: read at step 3, the run stops naming
    step 2, the second in a row, before the window's line or any checkpoint is written."""
    with pytest.raises(NonFinite, match=r"step 2: .*read at step 3.*2 steps in a row \(train.max_nonfinite_in_row=2\)"):
        train(fast_config(*NAN, ON_DEVICE, "train.max_nonfinite_in_row=2", "train.max_steps=6",
                          "train.log_every_steps=3", "train.save_every_steps=3"))
    run = tmp_path / "run"
    assert not checkpoint.complete(run) and not (run / "final").exists()
    lines = _lines(run) if (run / "metrics.jsonl").exists() else []
    assert not any("train/lr" in line for line in lines)  # nor the window's line
