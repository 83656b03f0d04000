"""Running an optimizer benchmark's plan: launch what has not run, read every job's result from its folder, say the
cost as it goes, continue a stopped benchmark, and never end on a trial that failed.

:func:`run` is called by the Hydra sweeper (``hydra_plugins/rlhf_sweepers.py``) with a ``launch`` function that runs
a list of jobs (any launcher: in this process, submitit, Slurm) and returns when they have ended. Every result is
read back from the job's folder, whatever ran it (:func:`read`): ``summary.json`` (finished), ``failed.json`` (a
failed point: a miss), or neither (a job that died or was stopped). So a benchmark continues by running the same
command with the same ``hydra.sweep.dir``: finished and failed jobs are read, not run again; a stopped one continues
from its checkpoint, or starts again (``resume=auto``). The plan is saved as ``bench_plan.json``; a different plan
into the same folder is refused (it would mix two benchmarks).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rlhf.core.errors import UserError
from rlhf.run.checkpoint import complete
from rlhf.sweeps.bench.plan import Bench, Job
from rlhf.sweeps.points import FAILED

log = logging.getLogger(__name__)

PLAN = "bench_plan.json"
DIED = "ProcessDied"  # failed.json's error for a job whose process ended without a result (rlhf.launch.sweep_launchers)
Launch = Callable[[Sequence[Job], Sequence[bool]], None]  # jobs, and whether each continues its folder (resume=auto)


def read(job: Job, sweep_dir: Path) -> bool:
    """Fill ``job.value``/``job.reason`` from its folder; whether it has a result (finished or failed)."""
    folder = sweep_dir / job.folder
    summary, failed = folder / "summary.json", folder / FAILED
    if summary.is_file():
        final = json.loads(summary.read_text()).get("final", {})
        metric = next(part.partition("=")[2] for part in job.overrides if part.startswith("objective.metric="))
        value = final.get(metric)
        job.value = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        job.reason = "" if job.value is not None else (
            f"no {metric} in its summary.json" if value is None else f"{metric} is {value}")
        return True
    if failed.is_file():
        record = json.loads(failed.read_text())
        job.value, job.reason = None, f"{record.get('error')}: {record.get('message')}"
        if record.get("error") == DIED and complete(folder):  # stopped (a signal, a preemption)
            return False  # after its checkpoint: continued, not a result
        return True
    job.value, job.reason = None, "did not finish"
    return False


def check_plan(bench: Bench, sweep_dir: Path, arguments: Sequence[str] = ()) -> bool:
    """Save the plan (the command line's overrides but the launcher, every search job and every confirm job's
    template: its overrides but the chosen point), or compare it with the one saved in the folder; whether this
    continues an earlier start. A difference is refused, named. What only scores (a target, the reference, r_max)
    is no part of it: changed, the report is written again from the same runs."""
    plan = {"arguments": [a for a in arguments if not a.startswith("launcher=")],  # where it runs may change
            "jobs": [[j.folder, j.overrides] for j in [*bench.search_jobs(), *bench.confirm_jobs([])]]}
    file = sweep_dir / PLAN
    if file.is_file():
        saved = json.loads(file.read_text())
        differs = ("the command line's overrides", saved.get("arguments"), plan["arguments"])
        if saved.get("arguments") == plan["arguments"]:
            old = {f: tuple(o) for f, o in saved.get("jobs", [])}
            new = {f: tuple(o) for f, o in plan["jobs"]}
            folder = next((f for f in [*new, *old] if old.get(f) != new.get(f)), None)
            differs = None if folder is None else (f"the job {folder}", old.get(folder), new.get(folder))
        if differs is not None:
            what, was, now = differs
            raise UserError(f"{sweep_dir} holds a benchmark with another plan ({PLAN}): {what} was {was}, now "
                            f"{now}. Continuing it would mix two benchmarks. Fix: the same command as it was "
                            "started with, or a new hydra.sweep.dir")
        return True
    sweep_dir.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(plan, indent=1))
    return False


class Clock:
    """The cost estimate: seconds per training step per workload, measured from this machine's finished batches
    (a batch's wall time over its steps, start-up included), else the preset's figure."""

    def __init__(self, bench: Bench) -> None:
        self.preset = {w.name: w.seconds_per_step for w in bench.workloads}
        self.spent_s: dict[str, float] = {}
        self.steps: dict[str, int] = {}

    def add(self, workload: str, seconds: float, steps: int) -> None:
        self.spent_s[workload] = self.spent_s.get(workload, 0.0) + seconds
        self.steps[workload] = self.steps.get(workload, 0) + steps

    def per_step(self, workload: str) -> tuple[float | None, str]:
        if self.steps.get(workload):
            return self.spent_s[workload] / self.steps[workload], "measured"
        return self.preset.get(workload), "preset"

    def seconds(self, jobs: Sequence[Job]) -> float | None:
        total = 0.0
        for job in jobs:
            rate, _ = self.per_step(job.workload)
            if rate is None:
                return None
            total += rate * job.steps
        return total

    def line(self, left: Sequence[Job]) -> str:
        seconds = self.seconds(left)
        rates = ", ".join(f"{w} {r:.3g} s/step ({how})" for w in self.preset
                          for r, how in [self.per_step(w)] if r is not None)
        what = "unknown (a workload without a measured or preset s/step)" if seconds is None else _minutes(seconds)
        return f"{what} ({rates})" if rates else what


def _minutes(seconds: float) -> str:
    if seconds >= 7200:
        return f"about {seconds / 3600:.1f} h"
    return f"about {seconds / 60:.0f} min" if seconds >= 90 else f"about {seconds:.0f} s"


def _batches(jobs: Sequence[Job], size: int | None) -> list[list[Job]]:
    """The jobs by workload (so that each batch's time is one workload's), in chunks of ``size`` at most."""
    out = []
    for workload in dict.fromkeys(j.workload for j in jobs):
        own = [j for j in jobs if j.workload == workload]
        step = size or len(own)
        out += [own[i:i + step] for i in range(0, len(own), step)]
    return out


def stage(jobs: Sequence[Job], sweep_dir: Path, launch: Launch, clock: Clock, size: int | None,
          later: Sequence[Job] = ()) -> None:
    """Run the jobs without a result yet, batch by batch, reading every result from its folder; log progress and
    the time left (``later``: jobs of the next stage, counted in it)."""
    todo = [j for j in jobs if j.launched and not read(j, sweep_dir)]
    done = sum(j.launched for j in jobs) - len(todo)
    if done:
        log.info("bench: %d of the %s jobs already have a result in %s (read, not run again)", done,
                 jobs[0].stage, sweep_dir)
    left = list(todo)
    for batch in _batches(todo, size):
        resume = [(sweep_dir / j.folder).exists() for j in batch]
        for job in batch:  # a stopped job's record of its stop, set aside: its continuation writes its own result
            if (sweep_dir / job.folder / FAILED).is_file():
                os.replace(sweep_dir / job.folder / FAILED, sweep_dir / job.folder / f"stopped-{FAILED}")
        started = time.perf_counter()
        launch(batch, resume)
        clock.add(batch[0].workload, time.perf_counter() - started, sum(j.steps for j in batch))
        for job in batch:
            read(job, sweep_dir)
            left.remove(job)
        failed = sum(j.value is None for j in jobs if j.launched and j not in left)
        log.info("bench: %s %d of %d runs have a result (%d failed: misses); time left %s", jobs[0].stage,
                 len(jobs) - len(left), len(jobs), failed, clock.line([*left, *later]))


def run(bench: Bench, sweep_dir: Path, launch: Launch, size: int | None = None,
        arguments: Sequence[str] = ()) -> list[Job]:
    """The whole benchmark: the search, each study's choice, the confirm runs; returns every job with its result.
    ``arguments``: the command line's overrides (part of the plan a continued benchmark must keep)."""
    sweep_dir = Path(sweep_dir)
    again = check_plan(bench, sweep_dir, arguments)
    clock = Clock(bench)
    search = bench.search_jobs()
    counts = bench.counts()
    log.info("%s", bench.describe())
    log.info("bench: %s %d runs in %s; estimated %s", "continuing the" if again else "starting", counts["runs"],
             sweep_dir, clock.line([*search, *bench.confirm_jobs([])]))
    stage(search, sweep_dir, launch, clock, size, later=bench.confirm_jobs(search))
    confirm = bench.confirm_jobs(search)
    stage(confirm, sweep_dir, launch, clock, size)
    return [*search, *confirm]
