"""The optimizer benchmark's scores, as pure functions of numbers already read (no files, no runs).

Scored as MLCommons AlgoPerf scores training algorithms
(https://github.com/mlcommons/algorithmic-efficiency/blob/main/docs/DOCUMENTATION.md, "Benchmark score using
performance profiles"): a run's **time to target** (:func:`time_to_target`: steps and training seconds until its
first evaluation that meets the workload's target; infinite where it never does), summarized over seeds with a
**bootstrap interval** (:func:`bootstrap_interval`, :func:`summary`), and across workloads the **performance
profile** and its score (:func:`performance_profile`, after Dolan and Moré 2002, https://arxiv.org/abs/cs/0102001)
and the **geometric-mean speed-up** over a baseline optimizer (:func:`geometric_mean_speedup`).

A missed target is ``math.inf`` everywhere here, never None or NaN: a median, a ratio and a profile then treat it
as the slowest possible time without a special case.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from rlhf.core.errors import UserError
from rlhf.sweeps.points import DIRECTIONS

STEP_TIME = "perf/step_time_s"  # a log window's mean seconds per training step (rlhf.run.window.window_metrics)
MEETS = {"maximize": operator.ge, "minimize": operator.le}  # objective.direction -> (value, target) -> met?

Times = Mapping[str, Mapping[str, float]]  # {workload: {optimizer: seconds or steps to target (inf: missed)}}


class Reached(NamedTuple):
    """When a run first met its target: optimizer ``steps`` and training ``seconds`` (both ``inf``: never)."""

    steps: float
    seconds: float


MISSED = Reached(math.inf, math.inf)


def time_to_target(records: Sequence[Mapping[str, Any]] | None, metric: str, direction: str,
                   target: float) -> Reached:
    """Steps and training seconds until the run's first evaluation of ``metric`` that meets ``target``
    (``>=`` for ``direction="maximize"``, ``<=`` for ``"minimize"``).

    ``records``: the lines of the run's ``metrics.jsonl`` oldest first (:attr:`rlhf.sweeps.results.Run.metrics`);
    None for a run that left none (a failed trial: a miss). An evaluation is a line holding ``metric``; a log window
    is a line holding ``perf/step_time_s``, written every ``train.log_every_steps`` and at the last step, whose
    per-step time leaves out evaluation and checkpoint time and holds compile time and an online algorithm's
    generation (``rlhf.run.loop``). The seconds are the windows' per-step times, each times the steps it covers up
    to the evaluation's step (a window covers the steps after the window before it, up to its own), so that
    evaluation time is not counted (AlgoPerf's rule). A target met by the evaluation at step 0 is met in 0 steps
    and 0 seconds. A resumed run may log a step again (the steps after its checkpoint, run twice): the last line
    of each kind for a step counts. Steps past the last logged window (a run killed mid-window) are timed at that
    window's per-step time; with no window at all, the seconds are NaN (unmeasured).

    Never met, no evaluation of ``metric``, or no records: :data:`MISSED` (``inf`` steps and seconds)."""
    if direction not in MEETS:
        raise UserError(f"direction={direction!r} is not one of {', '.join(DIRECTIONS)}. Fix: say whether a "
                        f"larger {metric} is better (maximize) or a smaller one (minimize).")
    if not records:
        return MISSED
    evaluations = _last_per_step(records, metric)
    meets = MEETS[direction]
    reached = next((step for step, value in sorted(evaluations.items()) if meets(value, target)), None)
    if reached is None:
        return MISSED
    return Reached(float(reached), training_seconds(records, reached))


def training_seconds(records: Sequence[Mapping[str, Any]], step: float) -> float:
    """The training seconds of steps 1 to ``step``: each log window's ``perf/step_time_s`` times the steps it
    covers up to ``step`` (:func:`time_to_target`); 0 for step 0, NaN where no window was logged."""
    if step <= 0:
        return 0.0
    windows = sorted(_last_per_step(records, STEP_TIME).items())
    if not windows:
        return math.nan
    seconds, previous = 0.0, 0.0
    for end, seconds_per_step in windows:
        seconds += seconds_per_step * (min(end, step) - previous)
        if end >= step:
            return seconds
        previous = end
    return seconds + windows[-1][1] * (step - previous)  # past the last window: at its per-step time


def _last_per_step(records: Iterable[Mapping[str, Any]], key: str) -> dict[float, float]:
    """``{step: value}`` of the lines holding ``key``, the last line for a step repeated by a resume; a value
    written as a string (``"nan"``, ``"inf"``: metrics.jsonl's non-finite numbers) read as a float."""
    return {float(record["step"]): float(record[key]) for record in records if key in record}


def bootstrap_interval(values: Iterable[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0,
                       statistic: Callable[..., Any] = np.median) -> tuple[float, float]:
    """The percentile bootstrap interval (Efron and Tibshirani 1993, ch. 13) of ``statistic`` over ``values``:
    ``resamples`` resamples of ``len(values)`` drawn with replacement (``numpy.random.default_rng(seed)``: the same
    seed, the same interval), ``statistic(resamples, axis=1)`` of each, and the order statistics of those at
    ``(1 - confidence) / 2`` (rounded down) and ``(1 + confidence) / 2`` (rounded up), so that no end is
    interpolated between a finite value and ``inf``.

    ``values`` may hold ``inf`` (missed targets): the median of a resample is ``inf`` where half or more of it is
    (its middle value, or one of its two, is ``inf``), so an interval's upper end is ``inf`` where the runs miss
    often enough. NaN is refused: a miss is ``inf``.

    With 3 values the interval says little: a resample's median is the smallest value with probability 7/27, the
    middle one 13/27, the largest 7/27, so the 95% interval is exactly [min, max] of the three, i.e. only that the
    median lies between the extremes seen. It narrows as values are added (about as 1/sqrt(n) for values close
    together)."""
    array = _finite_or_inf(values, "bootstrap_interval")
    if not 0.0 < confidence < 1.0:
        raise UserError(f"confidence={confidence} is not between 0 and 1. Fix: give e.g. 0.95 for a 95% interval.")
    if resamples < 1:
        raise UserError(f"resamples={resamples}: at least 1 is needed. Fix: use the default, 10000.")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(array), size=(resamples, len(array)))
    estimates = np.asarray(statistic(array[picks], axis=1), dtype=float)
    tail = (1.0 - confidence) / 2.0
    return (float(np.quantile(estimates, tail, method="lower")),
            float(np.quantile(estimates, 1.0 - tail, method="higher")))


def summary(values: Iterable[float], confidence: float = 0.95, seed: int = 0) -> dict[str, float]:
    """``values`` over seeds, summarized: their ``median``, the bootstrap interval of the median (``low``,
    ``high``: :func:`bootstrap_interval`), ``min``, ``max`` and ``n`` (how many values)."""
    array = _finite_or_inf(values, "summary")
    low, high = bootstrap_interval(array, confidence=confidence, seed=seed)
    return {"median": float(np.median(array)), "low": low, "high": high, "min": float(array.min()),
            "max": float(array.max()), "n": len(array)}


def _finite_or_inf(values: Iterable[float], where: str) -> np.ndarray:
    array = np.asarray(list(values), dtype=float)
    if array.size == 0:
        raise UserError(f"{where}: no values. Fix: give at least one run's value (a missed target as inf).")
    if np.isnan(array).any():
        raise UserError(f"{where}: NaN among {array.tolist()}. Fix: give a missed target or a failed run as inf "
                        "(math.inf), not NaN.")
    return array


@dataclasses.dataclass(frozen=True)
class Profile:
    """A performance profile over workloads (:func:`performance_profile`).

    ``ratios``: ``{workload: {optimizer: r}}``, each time over the workload's best (1 for the best, ``inf`` for a
    miss). ``curves``: ``{optimizer: (taus, rhos)}``, the step function ``rho(tau)`` (the fraction of workloads
    with ``r <= tau``) as its values from each ``tau`` in ``taus`` up to the next (draw with
    ``drawstyle="steps-post"``): 1, each ratio between 1 and ``r_max``, then ``r_max``. ``scores``: ``{optimizer: score}`` in [0, 1], the area
    under ``rho`` from 1 to ``r_max`` over ``r_max - 1`` (1: the best on every workload)."""

    ratios: dict[str, dict[str, float]]
    curves: dict[str, tuple[list[float], list[float]]]
    scores: dict[str, float]
    r_max: float

    @property
    def optimizers(self) -> list[str]:
        return list(self.scores)

    @property
    def workloads(self) -> list[str]:
        return list(self.ratios)


def performance_profile(times: Times, r_max: float = 4.0) -> Profile:
    """AlgoPerf's performance profile of ``times`` (``{workload: {optimizer: seconds or steps to target}}``,
    ``inf`` for a miss) and each optimizer's benchmark score.

    Per workload, ``r = t / min over optimizers of t``: 1 for the fastest (for each of them, on a tie), ``inf``
    for a miss, and ``inf`` for every optimizer on a workload that every one missed (it counts as a miss for all,
    not as a tie). ``rho(tau)`` is the fraction of workloads with ``r <= tau``; the score is
    ``1 / (r_max - 1)`` times the integral of ``rho`` from 1 to ``r_max``. ``rho`` is a step function, so the
    integral is exact: each workload adds ``max(0, r_max - r)`` over the number of workloads (a ratio above
    ``r_max`` adds nothing, as AlgoPerf's r_max = 4 cut-off says)."""
    if not r_max > 1.0:
        raise UserError(f"r_max={r_max}: the profile runs from 1 to r_max, so r_max must exceed 1. Fix: use "
                        "AlgoPerf's 4.")
    optimizers = _checked(times)
    ratios = {}
    for workload, row in times.items():
        best = min(float(row[name]) for name in optimizers)
        ratios[workload] = {name: float(row[name]) / best if math.isfinite(best) else math.inf
                            for name in optimizers}
    count = len(ratios)
    curves, scores = {}, {}
    for name in optimizers:
        within = sorted(row[name] for row in ratios.values() if row[name] <= r_max)
        taus = [1.0] + [r for r in dict.fromkeys(within) if 1.0 < r < r_max] + [float(r_max)]
        curves[name] = (taus, [sum(r <= tau for r in within) / count for tau in taus])
        scores[name] = sum(r_max - r for r in within) / (count * (r_max - 1.0))
    return Profile(ratios, curves, scores, float(r_max))


class Speedup(NamedTuple):
    """An optimizer's geometric-mean speed-up over the baseline (:func:`geometric_mean_speedup`): ``speedup``
    (NaN where no workload counts), the workloads counted (both reached the target), and those left out because
    the optimizer missed (the baseline did not) or because the baseline missed."""

    speedup: float
    workloads_counted: int
    optimizer_missed: int
    baseline_missed: int


def geometric_mean_speedup(times: Times, baseline: str = "adamw") -> dict[str, Speedup]:
    """Per optimizer, the geometric mean over workloads of ``t_baseline / t_optimizer`` (above 1: faster than the
    baseline), over the workloads where both reached the target; the rest are counted apart, by who missed
    (:class:`Speedup`). A workload every optimizer missed counts under ``baseline_missed``. The baseline's own
    row is 1 over the workloads it reached."""
    optimizers = _checked(times)
    if baseline not in optimizers:
        raise UserError(f"the baseline {baseline!r} is not among the compared optimizers ({', '.join(optimizers)})."
                        " Fix: name one of them as the baseline, or compare it too.")
    result = {}
    for name in optimizers:
        logs, optimizer_missed, baseline_missed = [], 0, 0
        for row in times.values():
            mine, base = float(row[name]), float(row[baseline])
            if not math.isfinite(base):
                baseline_missed += 1
            elif not math.isfinite(mine):
                optimizer_missed += 1
            else:
                logs.append(math.log(base / mine))
        speedup = math.exp(sum(logs) / len(logs)) if logs else math.nan
        result[name] = Speedup(speedup, len(logs), optimizer_missed, baseline_missed)
    return result


def _checked(times: Times) -> list[str]:
    """The optimizers of ``times``, once every workload is checked to time the same ones with positive numbers
    or ``inf``."""
    if not times:
        raise UserError("no workloads to score. Fix: give {workload: {optimizer: time to target}}.")
    optimizers = list(next(iter(times.values())))
    for workload, row in times.items():
        if set(row) != set(optimizers):
            raise UserError(f"workload {workload!r} times {sorted(row)}, another {sorted(optimizers)}. Fix: time "
                            "every optimizer on every workload (a failed or missing trial as inf).")
        for name, time in row.items():
            if not float(time) > 0.0:  # also NaN
                problem = ("met the target before training (time 0): the target ranks nothing" if time == 0
                           else f"has time {time}")
                raise UserError(f"workload {workload!r}: {name} {problem}. Fix: a time to target is positive, inf "
                                "for a miss; set a target the start model does not meet (e.g. the tuned AdamW's "
                                "median final score).")
    return optimizers
