"""Running a benchmark's plan with a launcher that writes run folders as train.py does (no training): crashed trials
are misses, a stopped benchmark continues where it stopped, a missed target is infinite, and the report says so."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from rlhf.core.errors import UserError
from rlhf.sweeps.bench import report, runner
from rlhf.sweeps.bench.plan import Bench
from rlhf.sweeps.points import FAILED

LR = {"low": 1e-5, "high": 1e-2, "scale": "log"}


def bench(**changes) -> Bench:
    config = {
        "workloads": {"dpo": {"overrides": ["algo=dpo"], "max_steps": 20, "eval_every_steps": 5,
                              "metric": "eval/exact_match", "direction": "maximize"}},
        "optimizers": {"adamw": {"space": {"optimizer.lr": LR}}, "slow": {"option": "sgd", "space": {
            "optimizer.lr": LR}}, "prodigy": {}},
        "trials": 3, "studies": 3, "confirm_seeds": 1,
    }
    config.update(changes)
    return Bench.from_config(config)


def score(job) -> float:
    """What a job reaches at its end: best at lr 3e-4 for adamw; the optimizer "slow" learns a tenth as much."""
    lr = job.point.get("optimizer.lr", 3e-4)
    best = 0.9 - 0.1 * abs(math.log10(lr) + 3.5)
    return best if job.optimizer != "slow" else 0.5 + (best - 0.5) / 10


def write_run(folder: Path, job, final: float) -> None:
    """A finished run's folder: metrics.jsonl (evaluations every 5 steps rising linearly from 0.5 to ``final``, a
    log window every 5 steps at 0.1 s a step), summary.json, environment.json, partition.json."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "eval/exact_match": 0.5}]
    for step in range(5, job.steps + 1, 5):
        lines.append({"step": step, "perf/step_time_s": 0.1, "train/loss": 1.0})
        lines.append({"step": step, "eval/exact_match": 0.5 + (final - 0.5) * step / job.steps})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({
        "final": {"eval/exact_match": final, "perf/peak_mem_mb": 100.0},
        "memory_predicted_mb": {"weights": 3.0, "gradients": 3.0, "frozen": 3.0},
        "memory_held_mb": {"optimizer_state": 6.0}}))
    (folder / "environment.json").write_text(json.dumps({"machine": "test", "tokenized_data": "abc"}))
    (folder / "partition.json").write_text(json.dumps({"partition": "rlhf.optim.partition.DecayMatrices", "parts": [
        {"part": "matrices", "tensors": 2, "parameters": 10, "rule": None}]}))


class Launcher:
    """Runs jobs as train.py would leave them: finished (summary.json), failed (failed.json: ``fail``), or dead with
    nothing written (``die``); ``stop_after``: the benchmark is killed once that many jobs have run."""

    def __init__(self, sweep_dir: Path, fail=(), die=(), stop_after=None):
        self.sweep_dir, self.fail, self.die, self.stop_after = sweep_dir, set(fail), set(die), stop_after
        self.launched: list[tuple[str, bool]] = []

    def __call__(self, jobs, resume):
        for job, again in zip(jobs, resume):
            if self.stop_after is not None and len(self.launched) >= self.stop_after:
                (self.sweep_dir / job.folder).mkdir(parents=True)  # started, then killed: no result
                raise KeyboardInterrupt
            self.launched.append((job.folder, again))
            folder = self.sweep_dir / job.folder
            if job.folder in self.fail:
                folder.mkdir(parents=True)
                (folder / FAILED).write_text(json.dumps({"error": "ValueError", "message": "Invalid lr"}))
            elif job.folder not in self.die:
                write_run(folder, job, score(job))


def test_a_crashed_or_dead_trial_is_a_miss_and_the_benchmark_still_chooses_confirms_and_reports(tmp_path):
    """One trial fails (failed.json), one dies without a trace, and every trial of one study of "slow" fails: the
    benchmark finishes, each study chooses among what returned, the failed study's confirm run is a miss, and the
    report counts it. Red if a failed trial could be chosen or ended the benchmark."""
    plan = bench()
    search = plan.search_jobs()
    adamw0 = [j for j in search if (j.optimizer, j.study) == ("adamw", 0)]
    best = max(adamw0, key=score)
    slow2 = [j.folder for j in search if (j.optimizer, j.study) == ("slow", 2)]
    launch = Launcher(tmp_path, fail=[best.folder, *slow2[:2]], die=[slow2[2]])
    jobs = runner.run(plan, tmp_path, launch)
    search = [j for j in jobs if j.stage == "search"]
    assert next(j for j in search if j.folder == best.folder).value is None
    assert "Invalid lr" in next(j for j in search if j.folder == best.folder).reason
    assert next(j for j in search if j.folder == slow2[2]).reason == "did not finish"
    assert plan.choice(search, "dpo", "adamw", 0).folder == max(
        (j for j in adamw0 if j is not best), key=score).folder  # the next best that returned
    confirm = [j for j in jobs if j.stage == "confirm"]
    lost = next(j for j in confirm if (j.optimizer, j.study) == ("slow", 2))
    assert not lost.launched and lost.value is None and not (tmp_path / lost.folder).exists()
    written = report.write(plan, jobs, tmp_path)
    rows = {r["optimizer"]: r for r in csv.DictReader(open(tmp_path / "report" / "results.csv"))}
    assert rows["slow"]["runs"] == "2" and rows["slow"]["jobs"] == "3"
    text = (tmp_path / report.MARKDOWN).read_text()
    assert "4 failed (misses): search/dpo/adamw/s0_t" in text and "1 confirm runs not run" in text
    assert {p.name for p in written} >= {"report.md", "results.csv", "runs.csv", "manifest.json", "profile.png",
                                         "profile_self_tuning.png"}


def test_a_missed_target_is_infinite_steps_and_seconds_and_scores_nothing_in_the_profile(tmp_path):
    """"slow" never reaches the tuned AdamW's median: inf steps and seconds, 0 of 3 reached, profile score 0 and no
    speed-up; AdamW reaches it (the median run at its last evaluation). Red if a miss were timed at the budget."""
    plan = bench()
    jobs = runner.run(plan, tmp_path, Launcher(tmp_path))
    table = {r["optimizer"]: r for r in report.rows(plan, jobs, tmp_path)}
    adamw_finals = sorted(j.value for j in jobs if j.stage == "confirm" and j.optimizer == "adamw")
    assert table["adamw"]["target"] == adamw_finals[1]
    assert table["slow"]["reached"] == 0 and table["slow"]["steps_to_target"] == math.inf
    assert table["slow"]["seconds_to_target"] == math.inf
    assert table["adamw"]["reached"] >= 2 and math.isfinite(table["adamw"]["seconds_to_target"])
    assert table["adamw"]["seconds_to_target"] == pytest.approx(0.1 * table["adamw"]["steps_to_target"])
    assert table["adamw"]["optimizer_state_mb"] == 6.0 and table["adamw"]["rest_mb"] == pytest.approx(85.0)
    profiles = report.profiles(plan, report.rows(plan, jobs, tmp_path), 4.0)
    assert profiles["tuned"].scores == {"adamw": 1.0, "slow": 0.0}
    text = report.markdown(plan, report.rows(plan, jobs, tmp_path), profiles, {}, jobs, 4.0, tmp_path)
    assert "| slow | tuned | 20 |" in text and "| 0 of 3 | inf | inf [inf, inf] |" in text
    assert "Seconds depend on where the runs ran: test, ? thread(s) (9 runs)." in text


def test_a_stopped_benchmark_continues_what_it_had_not_finished_and_a_different_plan_is_refused(tmp_path):
    """Killed after 7 jobs (the 8th started, nothing written): the same plan again reads the 7, runs the rest, and
    continues the started one in its folder (resume=auto). Red if finished jobs ran again or the started one were
    not resumed."""
    plan = bench()
    first = Launcher(tmp_path, stop_after=7)
    with pytest.raises(KeyboardInterrupt):
        runner.run(plan, tmp_path, first)
    again = Launcher(tmp_path)
    jobs = runner.run(bench(), tmp_path, again)
    done = {folder for folder, _ in first.launched}
    rerun = {folder for folder, _ in again.launched}
    assert not done & rerun
    assert len(done) + len(rerun) == len([j for j in jobs if j.launched])
    resumed = [folder for folder, resume in again.launched if resume]
    assert len(resumed) == 1 and resumed[0] == plan.search_jobs()[7].folder
    assert all(j.value is not None for j in jobs if j.launched)
    with pytest.raises(UserError, match="holds a benchmark with another plan"):
        runner.run(bench(trials=2), tmp_path, Launcher(tmp_path))


def test_a_job_stopped_after_its_checkpoint_is_continued_not_counted_as_a_miss(tmp_path):
    """Under submitit a job stopped by a signal (after writing its checkpoint) is recorded as ProcessDied: the next
    start continues it (resume=auto) and sets the record aside. A job that died without a checkpoint stays a miss.
    Red if failed.json alone decided."""
    plan = bench(trials=1, studies=1)
    runner.run(plan, tmp_path, Launcher(tmp_path))
    stopped, dead = plan.search_jobs()[0], plan.search_jobs()[1]
    for job in (stopped, dead):
        folder = tmp_path / job.folder
        (folder / "summary.json").unlink()
        (folder / FAILED).write_text(json.dumps({"error": runner.DIED, "message": "the job's process ended"}))
    meta = tmp_path / stopped.folder / "checkpoints" / "step_00000010"
    meta.mkdir(parents=True)
    (meta / "meta.json").write_text("{}")
    again = Launcher(tmp_path)
    jobs = runner.run(plan, tmp_path, again)
    assert again.launched == [(stopped.folder, True)]
    assert (tmp_path / stopped.folder / f"stopped-{FAILED}").is_file()
    assert next(j for j in jobs if j.folder == dead.folder).value is None


def test_a_change_to_the_confirm_runs_or_the_command_line_is_refused_naming_it(tmp_path):
    runner.run(bench(trials=1, studies=1), tmp_path, Launcher(tmp_path), arguments=["data.validation_size=0.5"])
    with pytest.raises(UserError, match=r"the job confirm/dpo/prodigy/s0_c0 was .*train.max_steps=30.* now "
                                        r".*train.max_steps=40"):
        runner.run(bench(trials=1, studies=1, self_tuning_budget=2.0), tmp_path, Launcher(tmp_path),
                   arguments=["data.validation_size=0.5"])
    with pytest.raises(UserError, match=r"the command line's overrides was \['data.validation_size=0.5'\], now "
                                        r"\['data.validation_size=0.25'\]"):
        runner.run(bench(trials=1, studies=1), tmp_path, Launcher(tmp_path), arguments=["data.validation_size=0.25"])
    runner.run(bench(trials=1, studies=1, r_max=2.0), tmp_path, Launcher(tmp_path),  # where it runs, how it scores
               arguments=["data.validation_size=0.5", "launcher=slurm"])


def test_a_target_met_before_training_leaves_the_workload_out_of_the_profile_and_says_so(tmp_path):
    """A target at or below the start score: every run meets it at step 0, and the workload ranks nothing."""
    plan = bench(workloads={"dpo": {"max_steps": 20, "eval_every_steps": 5, "metric": "eval/exact_match",
                                    "direction": "maximize", "target": 0.4},
                            "sft": {"overrides": ["algo=sft"], "max_steps": 20, "eval_every_steps": 5,
                                    "metric": "eval/exact_match", "direction": "maximize"}})
    jobs = runner.run(plan, tmp_path, Launcher(tmp_path))
    table = report.rows(plan, jobs, tmp_path)
    assert report.ranked(plan, table) == ["sft"]
    assert list(report.profiles(plan, table, 4.0)["tuned"].ratios) == ["sft"]
    text = report.markdown(plan, table, report.profiles(plan, table, 4.0), {}, jobs, 4.0, tmp_path)
    assert "**Not ranked**: the target was met before training by adamw (3), slow (3), prodigy (3)" in text


def test_the_target_counts_a_failed_reference_run_as_the_worst():
    """3 reference runs, one failed: the lower median of (-inf, a, b) is a, the worse one; 2 of 3 failed: none."""
    plan = bench(trials=1)
    jobs = plan.confirm_jobs([])
    finals = iter([0.7, None, 0.9])
    for job in jobs:
        if job.optimizer == "adamw":
            job.value = next(finals)
    assert report.target(plan, jobs, "dpo") == 0.7
    next(j for j in jobs if j.optimizer == "adamw" and j.value == 0.7).value = None
    assert report.target(plan, jobs, "dpo") is None
