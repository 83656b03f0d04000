"""Sweeps: what a job returns to Hydra (``objective``), and points that fail without ending the sweep.

The objective. ``objective: {metric: eval/loss, direction: minimize}`` in ``conf/config.yaml`` names the final metric
a job returns to Hydra, the value a sweeper (Optuna, ...) optimizes; ``direction`` says which way is better, for the
sweepers that read it (``hydra.sweeper.direction: ${objective.direction}``): the job returns the metric as it is.
:func:`check_objective` refuses, with the rest of the config and before any run or sweep starts, a metric that the
run does not produce: the metrics a run reports at its end are the algorithm's held-out metrics, declared by its
class (``Algorithm.eval_metrics``: every evaluation reports them, whatever the batch or option; a test holds each
class to its list), as ``eval/<name>``, plus the loop's own :data:`LOOP_METRICS`. Training metrics (``train/*``) are
not among them: a run whose logged steps were all skipped (non-finite) or that trains no step has none.

Failing points. In a sweep (``-m``), a point that fails (a :class:`~rlhf.core.errors.UserError`, a non-finite stop, an
exception in the run) is recorded in its folder, ``failed.json`` (:data:`FAILED`: the error's type and message),
and ``train.py`` hands Hydra a :class:`FailedPoint` instead of ending the process: the sweep goes on to its other
points. A search sweeper counts it as a failed trial (it cannot be read as a number). When the sweep ends,
:class:`SweepSummary` logs ``N of M points failed: ...``, and ``train.py`` exits with 1. A stop signal or Ctrl-C still
ends the whole sweep: that is what they ask for. A point that kills its process (out of memory, a segfault) ends an
in-process (``launcher=local``) sweep; ``launcher=submitit_local`` or ``slurm`` run each point in a process of its own,
and record one whose process died as a failed point, from the sweep's process (:mod:`rlhf.launch.sweep_launchers`).
"""

from __future__ import annotations

import difflib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf.core.errors import UserError
from rlhf.core.instantiate import in_a_sweep  # noqa: F401  (train.py and the sweeps read it here)
from rlhf.data.paths import one_answer_per_prompt

log = logging.getLogger(__name__)

FAILED = "failed.json"  # in a failed point's run folder: {"error": <type>, "message": <message>}
DIRECTIONS = ("minimize", "maximize")
LOOP_METRICS = ("perf/peak_mem_mb",)  # every run's final metrics have these, whatever the algorithm


def produced_metrics(algo_class: type) -> list[str]:
    """The final metrics every run of `algo_class` reports (see the module docstring)."""
    names = getattr(algo_class, "eval_metrics", ())
    return [*(f"eval/{n}" for n in names), *LOOP_METRICS]


def default_objective(target: str | None, part: str) -> str:
    """The objective of a run whose config leaves it to the algorithm (``${rlhf.objective:<algo target>,metric}``):
    the class's ``objective`` (``Algorithm.objective``: ``eval/loss``, minimize; an online algorithm's
    ``eval/reward``, maximize); ``part`` is ``metric`` or ``direction``."""
    from hydra.utils import get_object

    objective = ("eval/loss", "minimize")
    if isinstance(target, str):
        try:
            objective = getattr(get_object(target), "objective", objective)
        except Exception:  # a target that does not import: check_config names it
            pass
    return objective[0] if part == "metric" else objective[1]


OmegaConf.register_new_resolver("rlhf.objective", default_objective, replace=True)


def check_objective(container: dict) -> None:
    """``objective.metric`` among the metrics the run produces and ``objective.direction`` one of
    :data:`DIRECTIONS`, else a UserError naming the fix."""
    from hydra.utils import get_object

    objective = container.get("objective")
    if objective is None:
        return
    if not isinstance(objective, dict) or set(objective) - {"metric", "direction"}:
        raise UserError(f"objective={objective!r}: expected {{metric: <name>, direction: minimize or maximize}}. "
                        "Fix: e.g. objective.metric=eval/loss objective.direction=minimize")
    direction = objective.get("direction")
    if direction not in DIRECTIONS:
        raise UserError(f"objective.direction={direction!r} must be minimize or maximize. Fix: "
                        "objective.direction=maximize (for a metric where higher is better, e.g. eval/exact_match)")
    algo = container.get("algo")
    if not (isinstance(algo, dict) and isinstance(algo.get("_target_"), str)):
        return
    algo_class = get_object(algo["_target_"])
    produced = produced_metrics(algo_class)
    data = container.get("data")
    answers = getattr(algo_class, "answer_metrics", ())
    metric = objective.get("metric")
    if isinstance(data, dict) and not one_answer_per_prompt(data.get("path"), data.get("task")) and \
            str(metric).removeprefix("eval/") in answers:
        raise UserError(f"objective.metric={metric}: on data.path={data.get('path')} (data of one's own) it is not "
                        "logged: it counts a completion right only when it is the embedded task's one answer. Fix: "
                        "objective.metric=eval/loss objective.direction=minimize, or eval=generate with a reward for "
                        "this data and objective.metric=eval/gen/reward (docs/how-to/your-reward.md)")
    evaluation = container.get("eval")
    if isinstance(evaluation, dict) and isinstance(evaluation.get("_target_"), str):  # eval=generate: eval/gen/*
        produced += list(getattr(get_object(evaluation["_target_"]), "produced", lambda options: ())(evaluation))
    if metric not in produced:
        close = difflib.get_close_matches(str(metric), produced, n=1)
        fix = f"objective.metric={close[0]}" if close else f"one of {', '.join(produced)}"
        if str(metric).startswith("eval/gen/") and not any(m.startswith("eval/gen/") for m in produced):
            fix = "eval=generate (the generation evaluation reports eval/gen/*)"
        raise UserError(f"objective.metric={metric}: runs of {algo['_target_']} do not report it, so a sweep could "
                        f"not optimize it. Fix: {fix}")



def objective_value(cfg: Any, metrics: dict[str, float]) -> float | None:
    """What the job returns to Hydra: the final value of ``objective.metric`` (``eval/loss`` without an
    objective)."""
    objective = cfg.get("objective") if hasattr(cfg, "get") else None
    metric = objective.get("metric", "eval/loss") if objective is not None else "eval/loss"
    return metrics.get(metric)


class FailedPoint:
    """A failed sweep point's return value: not a number, so that a search sweeper counts a failed trial (Optuna:
    "Return value must be float-castable", within ``max_failure_rate``); its text is the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"failed: {self.reason}"

    __str__ = __repr__


_failures: list[str] = []  # this process's failed points (the in-process launcher): "<folder name>: <reason>"
_jobs = 0  # points started in this process
_misses = False  # the sweep counts a failed point as a result (a benchmark's miss), not as its own failure


def record_failure(run_dir: Path, error: BaseException) -> FailedPoint:
    """Write ``failed.json`` in the point's folder; return the :class:`FailedPoint` to hand to Hydra."""
    reason = f"{type(error).__name__}: {error}" if not isinstance(error, UserError) else str(error)
    folder = Path(run_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FAILED).write_text(json.dumps({"error": type(error).__name__, "message": str(error)}, indent=2))
    except OSError as write_error:  # a full disk, say: the sweep's summary still counts the point
        log.warning("could not write %s: %s", folder / FAILED, write_error)
    _failures.append(f"{folder.name}: {reason}")
    return FailedPoint(reason)


def failed_points() -> int:
    """How many points of this process's sweep failed (read by ``train.py`` for its exit code): 0 where the sweep
    counts them as results (:func:`count_failures_as_misses`)."""
    return 0 if _misses else len(_failures)


def count_failures_as_misses() -> None:
    """Failed points are this sweep's results (an optimizer benchmark's misses, in its report): still counted in the
    closing line, but the sweep exits 0."""
    global _misses
    _misses = True


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra is a dependency
    Callback = object  # type: ignore[misc,assignment]


class SweepSummary(Callback):
    """Hydra callback: counts a sweep's points and, at its end, logs how many failed and why. Under a launcher
    that runs the points in other processes (submitit), it reads their ``failed.json`` files in the sweep folder."""

    def on_job_start(self, config, **kwargs: Any) -> None:
        global _jobs
        _jobs += 1

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if _jobs:  # the points ran in this process
            points, failures = _jobs, list(_failures)
        else:
            sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
            folders = sorted({p.parent for p in sweep_dir.rglob(".hydra")} | {p.parent for p in sweep_dir.rglob(FAILED)})
            points = len(folders)
            failures = [f"{f.name}: {json.loads((f / FAILED).read_text()).get('message')}"
                        for f in folders if (f / FAILED).is_file()]
            _failures[:] = failures
        # printed, not logged: after an in-process sweep, logging still writes to the last point's train.log
        if not points:  # nothing ran (a sweeper that only printed its plan)
            return
        if failures:
            counted = " (counted as misses in the benchmark's report)" if _misses else ""
            print(f"{len(failures)} of {points} points failed{counted}: " + "; ".join(failures), file=sys.stderr)
        else:
            print(f"all {points} points finished", file=sys.stderr)
