"""Reading run folders (rlhf.sweeps.results) built by hand, and the scripts that read them through it."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import runpy
import sys
from pathlib import Path

import pytest

from rlhf.core.errors import UserError
from rlhf.run import checkpoint
from rlhf.run.folder import LOCK, claim
from rlhf.sweeps.results import Run, Status, find, is_locked
from tests.conftest import ROOT

LINES = [{"step": 0, "eval/exact_match": 0.5, "eval/loss": 2.0}, {"step": 1, "train/loss": 1.5},
         {"step": 2, "train/loss": "nan"}, {"step": 2, "eval/exact_match": 0.75, "eval/loss": 1.0}]


def make_run(folder: Path, *, overrides=("algo=dpo", "optimizer=lion"), final: dict | None = None,
             checkpoints: tuple[int, ...] = (), cut_short: bool = True) -> Path:
    """A run folder as the loop leaves it: .hydra/, metrics.jsonl (its last line cut short by a kill, unless told),
    complete checkpoints (meta.json written), and summary.json when `final` is given."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("algo:\n  beta: 0.1\noutput_dir: ${hydra:runtime.output_dir}\n")
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    text = "".join(json.dumps(line) + "\n" for line in LINES)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 3, "train/lo' if cut_short else ""))
    for step in checkpoints:
        saved = folder / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"
        saved.mkdir(parents=True)
        (saved / checkpoint.META).write_text(json.dumps({"format": checkpoint.FORMAT, "step": step}))
    if final is not None:
        (folder / "summary.json").write_text(json.dumps({"final": final, "seed": 0}))
    return folder


def test_metrics_skip_a_last_line_cut_short_and_read_non_finite_values_back(tmp_path):
    run = Run(make_run(tmp_path / "run"))
    assert len(run.metrics) == len(LINES) and run.metrics[0] == LINES[0]
    assert run.history("eval/exact_match") == [(0, 0.5), (2, 0.75)]
    assert run.first("eval/loss") == 2.0 and run.last("eval/loss") == 1.0 and run.last("eval/nothing") is None
    assert math.isnan(run.last("train/loss")) and math.isnan(run.metrics[2]["train/loss"])
    assert run.at(0) == LINES[0] and run.at(2) == {"step": 2, "train/loss": run.metrics[2]["train/loss"],
                                                   "eval/exact_match": 0.75, "eval/loss": 1.0}
    assert run.at(7) == {}
    whole = Run(make_run(tmp_path / "whole", cut_short=False))
    assert len(whole.metrics) == len(LINES)


def test_a_line_cut_short_before_the_last_is_an_error_naming_it(tmp_path):
    folder = make_run(tmp_path / "run")
    (folder / "metrics.jsonl").write_text('{"step": 0, "eval/loss": 1.0}\n{"step": 1, "tr\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl, line 2, is not JSON .*Fix: repair or remove that line"):
        _ = Run(folder).metrics


def test_config_and_overrides(tmp_path):
    run = Run(make_run(tmp_path / "run", overrides=("algo=dpo", "data.path=a=b.jsonl", "+train.extra=1", "~logger")))
    assert run.config == {"algo": {"beta": 0.1}, "output_dir": "${hydra:runtime.output_dir}"}
    assert run.overrides == ["algo=dpo", "data.path=a=b.jsonl", "+train.extra=1", "~logger"]
    assert run.override_values == {"algo": "dpo", "data.path": "a=b.jsonl", "+train.extra": "1"}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text("")
    assert Run(bare).config == {} and Run(bare).overrides == [] and Run(bare).metrics == []


def test_the_four_statuses(tmp_path):
    folder = make_run(tmp_path / "run")
    (folder / checkpoint.FOLDER / f".tmp-{checkpoint.PREFIX}00000004").mkdir(parents=True)  # a save cut short
    (folder / checkpoint.FOLDER / f"{checkpoint.PREFIX}00000002").mkdir()  # no meta.json: not a checkpoint
    assert Run(folder).status == Status.FAILED and Run(folder).final is None
    saved = folder / checkpoint.FOLDER / f"{checkpoint.PREFIX}00000002"
    (saved / checkpoint.META).write_text("{}")
    assert Run(folder).status == Status.STOPPED
    with pytest.raises(UserError, match="has no final metrics: the run is stopped .*Fix: .*resume=auto"):
        Run(folder).final_metrics()
    (folder / "summary.json").write_text(json.dumps({"final": {"eval/loss": 1.0}}))
    assert Run(folder).status == Status.FINISHED and Run(folder).final_metrics() == {"eval/loss": 1.0}
    with claim(folder):  # held by this process, through its own open file: a new open of .lock sees it
        assert Run(folder).status == Status.RUNNING  # checked first: a resumed run may still have its summary
        assert is_locked(folder / LOCK)
    assert (folder / LOCK).exists() and Run(folder).status == Status.FINISHED  # a lock file left, nobody holding it


def test_a_status_check_leaves_the_lock_free_for_the_writer(tmp_path):
    folder = make_run(tmp_path / "run")
    assert Run(folder).status == Status.FAILED and not is_locked(folder / LOCK)  # no .lock file at all
    with claim(folder):
        pass
    assert Run(folder).status == Status.FAILED
    with claim(folder):  # would raise "another run is writing the run folder" if the check had kept a lock
        assert Run(folder).status == Status.RUNNING


def test_summary_cut_short_is_an_error_naming_the_file(tmp_path):
    folder = make_run(tmp_path / "run")
    (folder / "summary.json").write_text('{"final": {"eval/lo')
    with pytest.raises(UserError, match=r"summary.json is not JSON .*Fix: .*resume=auto"):
        _ = Run(folder).final


def test_find_runs_under_folders_sorted_and_not_inside_a_run(tmp_path):
    sweep = tmp_path / "multirun"
    for name in ("1_b", "0_a", "2_c"):
        make_run(sweep / name, final={"eval/loss": 1.0} if name != "1_b" else None)
    (sweep / ".submitit" / "123").mkdir(parents=True)  # not a run folder
    (sweep / "multirun.yaml").write_text("{}")
    (sweep / "0_a" / "final").mkdir()
    (sweep / "0_a" / "final" / "summary.json").write_text("{}")  # inside a run folder: not searched
    single = make_run(tmp_path / "single")
    found = find([sweep, single])
    assert [run.path for run in found] == [sweep / "0_a", sweep / "1_b", sweep / "2_c", single]
    assert [run.status for run in found] == ["finished", "failed", "finished", "failed"]
    assert find([single]) == [Run(single)] and find([tmp_path / "single" / ".hydra"]) == []
    with pytest.raises(UserError, match="does not exist. Fix: give run folders"):
        find([tmp_path / "nowhere"])


@pytest.mark.parametrize(("name", "message"), [
    ("nowhere", "nowhere does not exist. Fix: give the folder of one run"),
    ("file.txt", "file.txt is a file, not a run folder. Fix"),
    ("multirun", r"multirun is not a run folder \(it has none of metrics.jsonl, summary.json, .hydra\); it holds "
                 r"run folders such as .*0_a and .*1_b\. Fix: give the folder of one run"),
    ("empty", r"empty is not a run folder \(it has none of .*\)\. Fix"),
])
def test_a_path_that_is_not_a_run_folder_is_refused_with_the_fix(tmp_path, name, message):
    for job in ("0_a", "1_b", "2_c"):
        make_run(tmp_path / "multirun" / job)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(UserError, match=message):
        Run(tmp_path / name)


# --- the scripts, run in this process (their own imports would take seconds) -----------------------------------------
def script(name: str, *args: str, monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
    code = runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name="script")["main"]()
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_run_prints_each_bound_and_fails_below_one(tmp_path, monkeypatch, capsys):
    folder = make_run(tmp_path / "run", final={"eval/exact_match": 0.75, "eval/loss": 1.0})
    code, out, _ = script("check_run", folder, "--min", "eval/loss=0.5", "--min-of-start", "eval/exact_match=0.3",
                          monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and out == ("ok   eval/loss = 1.0000 (step 0: 2.0000), required >= 0.5000\n"
                                 "FAIL eval/exact_match = 0.7500 (step 0: 0.5000), required >= 0.8000\n")
    (folder / "summary.json").unlink()
    code, out, err = script("check_run", folder, "--min", "eval/loss=0.5", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and out == "" and "has no final metrics: the run is failed" in err


def test_compare_runs_shows_every_run_with_its_status(tmp_path, monkeypatch, capsys):
    """The report's own tests are tests/sweeps/test_report.py (a real sweep); here, runs built by hand."""
    for name, accuracy in (("0_a", 0.5), ("1_b", 0.75)):
        make_run(tmp_path / name, final={"eval/exact_match": accuracy, "train/loss": 1.0})
    make_run(tmp_path / "2_c")  # not finished and nothing written for a while: crashed
    old = 1e9
    os.utime(tmp_path / "2_c" / "metrics.jsonl", (old, old))
    code, out, _ = script("compare_runs", tmp_path, "--csv", "--metrics", "eval/exact_match",
                          monkeypatch=monkeypatch, capsys=capsys)
    rows = list(csv.reader(io.StringIO(out)))
    assert code == 0 and rows[0][:3] == ["run", "eval/exact_match @0", "eval/exact_match end"]
    assert [(row[0], row[2], row[-2]) for row in rows[1:]] == [("0", "0.75", "finished"), ("1", "0.75", "finished"),
                                                                ("2", "0.75", "crashed")]
    code, out, err = script("compare_runs", tmp_path / "nothing", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "does not exist" in err


def test_a_resumed_run_reads_its_latest_resumed_attempts_config(tmp_path):
    """A resume records its attempt in .hydra/attempt-<time>/ (the run's original record stays): the run's config
    and overrides are those of its latest attempt that resumed; one refused by the resume check does not count."""
    folder = make_run(tmp_path / "run", overrides=("algo=dpo",))
    for name, overrides, resumed in (("attempt-2024-01-01_00-00-00", ["algo=dpo", "train.max_steps=9"], True),
                                     ("attempt-2024-01-02_00-00-00", ["algo=dpo", "seed=5"], False)):
        attempt = folder / ".hydra" / name
        attempt.mkdir()
        (attempt / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (attempt / "config.yaml").write_text(f"seed: {5 if not resumed else 0}\n")
        if resumed:
            (attempt / "resumed_from.txt").write_text("checkpoints/step_00000002\n")
    assert Run(folder).overrides == ["algo=dpo", "train.max_steps=9"] and Run(folder).config == {"seed": 0}
