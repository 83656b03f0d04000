"""A run that computes in bf16 says how many steps its updates stay hidden from the forward pass, records the
figure, and warns where the run is too short for it (rlhf/telemetry/bf16_updates.py, called by the loop)."""

from __future__ import annotations

import json

from rlhf import train
from rlhf.run import checkpoint
from rlhf.telemetry.bf16_updates import METRIC
from tests.conftest import FAST, compose_config


def _lines(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_short_bf16_run_at_a_tiny_learning_rate_is_warned_and_records_the_figure(fast_config, tmp_path, caplog):
    """3 steps at lr 1e-7 in bf16 autocast: the tiny model's weights (~0.02: half a bf16 step ~4e-5) need hundreds
    of steps; warned with the fix, the figure in metrics.jsonl at the first step with half the peak learning rate
    or more (step 2 of a 2-step warmup: the first is at 0) and in summary.json. The same run in float32 says nothing (red without the watch)."""
    caplog.set_level("INFO", logger="rlhf")
    final = train(fast_config("hardware.mixed_precision=bf16", "optimizer.lr=1e-7", "scheduler.num_warmup_steps=2"))
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "bf16 hides" in r.getMessage()]
    assert len(warning) == 1 and "and the run has 3" in warning[0]
    assert "Fix: hardware.mixed_precision=no (the forward pass in float32)" in warning[0]
    assert final[METRIC] > 100
    assert [line["step"] for line in _lines(tmp_path / "run") if METRIC in line] == [2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final"][METRIC] == final[METRIC]
    caplog.clear()
    final = train(fast_config("hardware.mixed_precision=no", "optimizer.lr=1e-7"))
    assert "bf16:" not in caplog.text and "bf16 hides" not in caplog.text and METRIC not in final


def test_a_bf16_run_whose_updates_show_at_once_is_told_so_without_a_warning(fast_config, caplog):
    caplog.set_level("INFO", logger="rlhf")
    final = train(fast_config("hardware.mixed_precision=bf16", "optimizer.lr=1e-2"))
    assert final[METRIC] < 0.75 and "bf16: a typical weight that trains needs" in caplog.text
    assert "bf16 hides" not in caplog.text


def test_a_resume_measures_the_figure_only_where_its_run_had_not(fast_config, tmp_path, caplog):
    """Checkpoints at steps 1 and 2 of a 3-step bf16 run, measured at step 2: resumed from step 1 it measures at
    step 2 as the uninterrupted run did, to the bit; resumed from step 2 it keeps the checkpoint's figure (red:
    measured on every attempt, or never on a resume)."""
    settings = ["hardware.mixed_precision=bf16", "optimizer.lr=1e-7", "scheduler.num_warmup_steps=2", "train.save_every_steps=1",
                "train.keep_last=null", "hardware.threads_per_process=1"]
    whole = train(fast_config(*settings))[METRIC]
    for step in (1, 2):
        caplog.clear()
        caplog.set_level("INFO", logger="rlhf")
        folder = tmp_path / "run" / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"
        resumed = train(compose_config(*FAST, *settings, f"resume={folder}", output_dir=tmp_path / f"from{step}"))
        assert resumed[METRIC] == whole
        assert ("bf16: a typical weight that trains needs" in caplog.text) == (step == 1)
