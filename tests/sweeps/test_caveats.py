"""rlhf/sweeps/caveats.py: the notes above a report's table on speeds measured beside different loads (or none
recorded) and on curves of too few points, from run folders written here."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlhf.sweeps import caveats, report, tables
from rlhf.sweeps.results import find


def _run(folder: Path, loads: list[float] | None, steps: int = 30, log_every: int = 10, finished: bool = True,
         cpus: int = 2, seed: int = 0) -> Path:
    """A run folder of ``steps`` steps logged every ``log_every``, each log window with its tokens/s and, unless
    ``loads`` is None (a run older than the metric), its perf/busy_cpus_other in turn."""
    (folder / ".hydra").mkdir(parents=True)
    train = {"max_steps": steps, "log_every_steps": log_every, "eval_every_steps": 0}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"train": train, "seed": seed}))
    windows = sorted({*range(log_every, steps + 1, log_every), steps})
    lines = [{"step": 0, "eval/loss": 0.7}]
    for index, step in enumerate(windows):
        line = {"step": step, "train/loss": 0.6, "perf/tokens_per_s": 100.0}
        if loads is not None:
            line["perf/busy_cpus_other"] = loads[index % len(loads)]
        lines.append(line)
    lines.append({"step": steps, "eval/loss": 0.5})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "environment.json").write_text(json.dumps({"mixed_precision": "no", "machine": "cpu", "cpus": cpus}))
    if finished:
        (folder / "summary.json").write_text(json.dumps({"final": {"eval/loss": 0.5}, "train": train}))
    return folder


def _markdown(folder: Path) -> str:
    return report.markdown(report.build(find([folder])))


def test_speeds_measured_beside_different_loads_say_so_with_the_figures(tmp_path):
    """AdamW beside an idle machine, Lion beside 1.6 CPUs of other work: a note above the table gives each run's
    median (min–max) of its windows, and the column beside tokens/s their medians (red without the note)."""
    _run(tmp_path / "0_optimizer=adamw", [0.1, 0.0, 0.3])
    _run(tmp_path / "1_optimizer=lion", [1.6, 1.2, 1.9], seed=1)
    made = report.build(find([tmp_path]))
    md = report.markdown(made)
    note, table = md.split("\n\n", 1)
    assert note.splitlines() == [
        "> **Speeds not comparable**: tokens/s and wall s of these runs were measured beside different loads of "
        "other work: the CPUs busy with work other than the run's (perf/busy_cpus_other), median over the run's log "
        "windows (min–max), differ by more than 0.5 CPU:",
        "> - run 0: 0.1 of 2 CPUs (0.0–0.3 over 3 windows)",
        "> - run 1: 1.6 of 2 CPUs (1.2–1.9 over 3 windows)"]
    header = table.splitlines()[0].split(" | ")
    assert header[header.index("tokens/s") + 1] == caveats.LOAD_COLUMN
    assert [row.figures[caveats.LOAD_COLUMN] for row in made.rows] == [0.1, 1.6]
    printed = report.text(made)
    assert printed.startswith("Speeds not comparable: tokens/s") and "  - run 1: 1.6 of 2 CPUs" in printed


def test_loads_within_the_margin_get_no_note(tmp_path):
    """Medians 0.1 and 0.5 apart by 0.4 CPU: alike (red with any difference noted)."""
    _run(tmp_path / "0_seed=0", [0.1, 0.9])
    _run(tmp_path / "1_seed=1", [0.5, 0.4, 0.6], seed=1)
    assert _markdown(tmp_path).startswith("| run |")


def test_runs_that_did_not_record_their_load_are_named_where_speeds_are_compared(tmp_path):
    """An older run beside a new one, and two older runs: 'load not recorded' rather than silence (red where runs
    without the metric are left out); one run alone compares no speeds."""
    _run(tmp_path / "mixed" / "0_seed=0", [0.2])
    _run(tmp_path / "mixed" / "1_seed=1", None, seed=1)
    lines = _markdown(tmp_path / "mixed").split("\n\n", 1)[0].splitlines()
    assert lines == ["> **Speeds may not compare**: tokens/s and wall s depend on other work on the machine, which "
                     "some of these runs did not record (perf/busy_cpus_other):",
                     "> - run 0: 0.2 of 2 CPUs (0.2–0.2 over 3 windows)", "> - load not recorded: run 1"]
    _run(tmp_path / "old" / "0_seed=0", None)
    _run(tmp_path / "old" / "1_seed=1", None, seed=1)
    old = _markdown(tmp_path / "old").split("\n\n", 1)[0].splitlines()
    assert old[1:] == ["> - load not recorded: runs 0, 1"] and "which none of these runs did not record" not in old[0]
    assert old[0].endswith("which none of these runs recorded (perf/busy_cpus_other):")  # not "some of"
    assert _markdown(tmp_path / "mixed" / "1_seed=1").startswith("| run |")


def test_a_run_shorter_than_its_log_windows_says_its_curve_has_too_few_points(tmp_path):
    """6 steps logged every 10: one training point, two held-out ones (step 0 and 6): the note names
    train.log_every_steps; 30 steps every 10 (3 points) and a run still going are not named (red without the
    note)."""
    _run(tmp_path / "0_seed=0", [0.1], steps=6)
    _run(tmp_path / "1_seed=1", [0.1], steps=30, seed=1)
    _run(tmp_path / "2_seed=2", [0.1], steps=6, finished=False, seed=2)
    assert caveats.points_note(tables.named_runs(report.build(find([tmp_path])))) == (caveats.POINTS_HEAD, [
        "run 0: 1 training point in 6 steps (train.log_every_steps=10; held-out: 2 points, "
        "train.eval_every_steps=0)"])
    md = _markdown(tmp_path)
    assert md.startswith("> **Too few points**: these runs logged fewer than 3 training points, so their curves "
                         "(report.png) are a dot or a straight line whatever the training did. Fix: a "
                         "train.log_every_steps of at most a third of the run's steps:\n> - run 0: 1 training point")
    assert report.text(report.build(find([tmp_path / "1_seed=1"]))).startswith("run ")
