"""``experiment=optimizer_bench`` as a user runs it, cut to seconds: real runs through train.py, one optimizer whose
every trial crashes, the report, and the same command again continuing (here: finding everything done)."""

from __future__ import annotations

import csv
import json

import pytest

from rlhf.sweeps.bench.plan import SET_PER_JOB
from tests.conftest import FAST
from tests.test_train_cli import run

SMALL = [  # one workload of 4 SFT steps; adamw (tuned), "broken" (an SGD whose lr makes its first step non-finite,
    # set to stop there: every trial fails as it runs, not at the config's check), prodigy
    "experiment=optimizer_bench", *(o for o in FAST if o.partition("=")[0] not in SET_PER_JOB),
    "data.validation_size=0.5", "~hydra.sweeper.workloads.dpo", "~hydra.sweeper.workloads.grpo",
    "hydra.sweeper.workloads.sft.max_steps=4", "hydra.sweeper.workloads.sft.eval_every_steps=2",
    "hydra.sweeper.workloads.sft.metric=eval/loss", "hydra.sweeper.workloads.sft.direction=minimize",  # it moves
    "~hydra.sweeper.optimizers.sgd", "~hydra.sweeper.optimizers.muon", "~hydra.sweeper.optimizers.schedule_free_adamw",
    "+hydra.sweeper.optimizers.broken={option:sgd,overrides:['train.on_nonfinite=stop'],"
    "space:{optimizer.lr:{low:1e30,high:1e31,scale:log}}}",
    "hydra.sweeper.trials=2", "hydra.sweeper.studies=1",
]


@pytest.mark.slow
def test_the_bench_runs_counts_a_crashed_optimizer_as_misses_reports_and_continues(tmp_path):
    """~40 s. Every trial of "broken" fails (a non-finite step): the bench still exits 0 and writes its report,
    where "broken" reached nothing; adamw's confirm run reached its own target. Run again into the same folder,
    nothing runs again and the report is the same."""
    out = run(*SMALL, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 of 6 points failed (counted as misses in the benchmark's report)" in out.stderr
    assert "# Optimizer benchmark" in out.stdout
    rows = {r["optimizer"]: r for r in csv.DictReader(open(tmp_path / "report" / "results.csv"))}
    assert set(rows) == {"adamw", "broken", "prodigy"}
    assert rows["broken"]["runs"] == "0" and rows["broken"]["reached"] == "0"
    assert rows["adamw"]["reached"] == "1" and float(rows["adamw"]["steps_to_target"]) <= 4
    assert rows["prodigy"]["steps"] == "6"  # the self-tuning budget: 1.5x
    for job in csv.DictReader(open(tmp_path / "report" / "runs.csv")):
        if job["optimizer"] == "broken" and job["stage"] == "search":
            assert job["reason"].startswith("NonFinite: step "), job["reason"]
        elif job["stage"] == "confirm" and job["optimizer"] != "broken":
            summary = json.loads((tmp_path / job["folder"] / "summary.json").read_text())
            assert float(job["value"]) == summary["final"]["eval/loss"]
            config = (tmp_path / job["folder"] / ".hydra" / "config.yaml").read_text()
            assert "evaluate_on: held_out" in config and f"seed: {job['seed']}" in config
    manifest = json.loads((tmp_path / "report" / "manifest.json").read_text())
    assert manifest["versions"]["torch"] and manifest["data_fingerprints"]["sft"]
    assert (tmp_path / "report" / "profile.png").stat().st_size > 10_000
    first = (tmp_path / "report" / "results.csv").read_text()
    again = run(*SMALL, f"hydra.sweep.dir={tmp_path}")
    assert again.returncode == 0, again.stderr[-3000:]
    logged = again.stdout + again.stderr  # Hydra's own log lines go to stdout
    assert "4 of the search jobs already have a result" in logged and "2 of the confirm jobs" in logged
    assert "bench: continuing the 7 runs" in logged and "bench: starting" not in logged
    assert (tmp_path / "report" / "results.csv").read_text() == first


def test_a_refusal_that_does_not_depend_on_the_point_stops_the_bench_before_it_runs(tmp_path):
    """A workload's metric its algorithm does not report would fail every job: refused at once, naming the workload
    and the optimizer (red: the bench ran and reported every job failed). A key every job sets itself, given on the
    command line, is refused too. ~10 s."""
    out = run(*SMALL, "hydra.sweeper.workloads.sft.metric=eval/reward", "hydra.sweeper.workloads.sft.direction=maximize",
              f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 1
    assert "error: workload sft with adamw: objective.metric=eval/reward" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "search").exists()
    for argument in ("seed=3", "optimizer.lr=0.001"):  # the second one would reach the self-tuning entries only
        out = run(*SMALL, argument, f"hydra.sweep.dir={tmp_path}")
        key = argument.partition("=")[0]
        assert out.returncode == 1, out.stderr[-2000:]
        assert f"error: {argument}: the benchmark's jobs set {key} themselves" in out.stderr, out.stderr[-2000:]
