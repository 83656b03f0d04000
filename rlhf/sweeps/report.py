"""The comparison report of a sweep (``scripts/compare_runs.py``): one row per run, the curves as a PNG, the table
as Markdown and CSV.

A row holds the effective values that differ between the runs (read from each run's resolved ``.hydra/config.yaml``,
so that a preset's or a config group's values show, not only the command line's), the held-out metrics at step 0,
at the end and at their best (with the step), the final train loss, speed, peak memory, wall time and the run's
status. Runs that crashed or still run get a row with what they have. :func:`aggregate_seeds` folds runs that
differ only in ``seed`` into one row of mean and standard deviation. The text (numbers rounded to what they can
show, and a note above the table where the runs did not run alike: their ``environment.json``) is
:mod:`rlhf.sweeps.tables`; the figures, :mod:`rlhf.sweeps.plots`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rlhf.sweeps.caveats import LOAD_COLUMN, median_load
from rlhf.sweeps.plots import (  # noqa: F401  (the report's figures)
    KL,
    REWARD,
    mean_curve,
    plot_curves,
    plot_frontier,
    plot_objective,
    searched_parameters,
)
from rlhf.sweeps.points import FAILED
from rlhf.sweeps.results import Run, Status
from rlhf.sweeps.tables import (  # noqa: F401  (the report's text)
    csv_rows,
    markdown,
    number,
    run_name,
    table,
    text,
)

FINISHED, RUNNING, CRASHED = "finished", "running", "crashed"
IGNORED = ("output_dir", "resume", "resume_changes")  # differ by run folder or by attempt, not by setting
ACCURACY_LIKE = ("accurac", "exact_match", "win_rate")  # the held-out metrics shown by default, beside eval/loss
FRESH_S = 120.0  # metrics.jsonl written this recently, with no summary: a run still going (on another machine)
FILES = ("report.md", "report.csv", "report.png")
_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^]]*\]\[(\w+)\] - (.*)$")


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"optimizer.lr": 1e-4, ...}``; a node's ``_target_`` becomes the node's own value (its
    class or function name: ``optimizer: AdamW``), lists become their text."""
    if not isinstance(config, dict):
        return {prefix: str(config) if isinstance(config, list) else config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if key == "_target_":
            flat[prefix or key] = str(value).rpartition(".")[2]
        elif not str(key).startswith("_"):
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def differing(configs: Sequence[dict[str, Any]]) -> list[str]:
    """The flattened keys whose values are not the same in every config (a key some lack counts as differing), in
    the order they first appear; an empty config (a run folder without ``.hydra/``) takes no part."""
    flats = [flatten(config) for config in configs if config]
    keys = list(dict.fromkeys(key for flat in flats for key in flat))
    return [key for key in keys if key not in IGNORED
            and len({repr(flat.get(key, "<absent>")) for flat in flats}) > 1]


def short_names(keys: Sequence[str]) -> dict[str, str]:
    """Each dotted key shortened to its shortest ending (whole dotted parts) that no other key ends with:
    ``optimizer.lr`` -> ``lr``, but ``seed`` and ``data.seed`` stay apart."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            name = ".".join(parts[-n:])
            if not any(other != key and (other == name or other.endswith("." + name)) for other in keys):
                break
        names[key] = name
    return names


def default_metrics(runs: Iterable[Run]) -> list[str]:
    """``eval/loss``, the held-out accuracy-like metrics (exact match, accuracies, win rate) the runs logged, and
    the generation evaluation's reward and KL (``eval=generate``)."""
    logged = sorted({key for run in runs for record in run.metrics for key in record if key.startswith("eval/")})
    return ([m for m in logged if m == "eval/loss"] + [m for m in logged if any(word in m for word in ACCURACY_LIKE)]
            + [m for m in logged if m in (REWARD, KL)])


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or metric.endswith("/kl")


def status(run: Run, lines: list[tuple[datetime, str, str]], now: float | None = None) -> str:
    """finished (summary.json), running (a process holds the run's lock; or, with no error in train.log (its
    ``lines``), metrics.jsonl changed in the last :data:`FRESH_S` seconds: a process on another machine), else
    crashed."""
    where = run.status
    if (run.path / FAILED).is_file() and where != Status.RUNNING:  # a sweep point that failed: the run said why
        return CRASHED
    if where in (Status.FINISHED, Status.RUNNING):
        return FINISHED if where == Status.FINISHED else RUNNING
    metrics = run.path / "metrics.jsonl"
    recent = metrics.is_file() and (now if now is not None else time.time()) - metrics.stat().st_mtime < FRESH_S
    failed = any(level in ("ERROR", "CRITICAL") for _, level, _ in lines)
    return RUNNING if recent and not failed else CRASHED


def log_lines(run: Run) -> list[tuple[datetime, str, str]]:
    """``(time, level, message)`` of each line of ``train.log`` that starts a record."""
    file = run.path / "train.log"
    lines = file.read_text(errors="replace").splitlines() if file.is_file() else []
    return [(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f"), m[2], m[3]) for m in map(_LOG_LINE.match, lines) if m]


def wall_time_s(run: Run, lines: list[tuple[datetime, str, str]]) -> float | None:
    """From the first to the last line of ``train.log`` (a resumed run: including the time it lay stopped); without
    a log, from ``.hydra/config.yaml`` to the last write of ``metrics.jsonl``."""
    if len(lines) > 1:
        return (lines[-1][0] - lines[0][0]).total_seconds()
    start, end = run.path / ".hydra" / "config.yaml", run.path / "metrics.jsonl"
    return end.stat().st_mtime - start.stat().st_mtime if start.is_file() and end.is_file() else None


def why(lines: list[tuple[datetime, str, str]], folder: Path | None = None) -> str:
    """What ended a crashed run: the reason a failed sweep point recorded (``failed.json`` in ``folder``), else the
    last error (or, failing that, warning) of ``train.log``, on one line."""
    record = folder / FAILED if folder is not None else None
    if record is not None and record.is_file():
        try:
            failure = json.loads(record.read_text())
            return f"{failure['error']}: {failure['message']}".replace("\n", " ")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    for level in ("ERROR", "CRITICAL", "WARNING"):
        found = [message for _, lvl, message in lines if lvl == level]
        if found:
            return found[-1].strip()
    return ""


@dataclasses.dataclass
class Row:
    """One run (or, aggregated, one group of seeds): its differing values and its figures."""

    name: str
    values: dict[str, Any]  # short key -> value
    status: str
    figures: dict[str, float | None]  # column -> number
    runs: list[Run]
    note: str = ""
    spread: dict[str, float] = dataclasses.field(default_factory=dict)  # column -> standard deviation (aggregated)


def metric_columns(metric: str) -> list[str]:
    return [f"{metric} @0", f"{metric} end", f"{metric} best", f"{metric} best step"]


PERF_COLUMNS = ["train/loss end", "tokens/s", LOAD_COLUMN, "peak MB", "optimizer state MB", "wall s"]  # LOAD_COLUMN:
# other work's CPUs; optimizer state MB: what the optimizer held at the end (summary.json's memory_held_mb)


def figures(run: Run, metrics: Sequence[str], lines) -> dict[str, float | None]:
    """The row's numbers: each metric at step 0, at its last logging, at its best and that step; the last train
    loss; tokens/s (mean over the log windows) and beside it the CPUs other work kept busy (median over the log
    windows: :func:`rlhf.sweeps.caveats.median_load`), the peak memory, the optimizer's state at the end (one
    process's), the wall time."""
    row: dict[str, float | None] = {}
    for metric in metrics:
        history = run.history(metric)
        finite = [(step, value) for step, value in history if math.isfinite(value)]
        pick = min if lower_is_better(metric) else max
        best = pick(finite, key=lambda point: point[1]) if finite else None
        at_start = [value for step, value in history if step == 0]
        row.update(zip(metric_columns(metric), (
            at_start[0] if at_start else None, history[-1][1] if history else None,
            best[1] if best else None, best[0] if best else None)))
    speeds = [value for _, value in run.history("perf/tokens_per_s") if math.isfinite(value)]
    peaks = [value for _, value in run.history("perf/peak_mem_mb")] + [(run.final or {}).get("perf/peak_mem_mb")]
    peaks = [float(value) for value in peaks if value is not None]
    state = ((run.summary or {}).get("memory_held_mb") or {}).get("optimizer_state")
    row.update(zip(PERF_COLUMNS, (run.last("train/loss"), statistics.fmean(speeds) if speeds else None,
                                  median_load(run), max(peaks) if peaks else None, state, wall_time_s(run, lines))))
    return row


@dataclasses.dataclass
class Report:
    rows: list[Row]
    keys: list[str]  # the differing config keys (full dotted names), in order
    names: dict[str, str]  # full key -> its short column name
    metrics: list[str]
    aggregated: bool = False

    @property
    def value_columns(self) -> list[str]:
        return [self.names[key] for key in self.keys]

    @property
    def figure_columns(self) -> list[str]:
        return [column for metric in self.metrics for column in metric_columns(metric)] + PERF_COLUMNS


def build(runs: Sequence[Run], metrics: Sequence[str] | None = None, now: float | None = None) -> Report:
    """The report of ``runs``: one row each. ``metrics``: the held-out metrics to show (default
    :func:`default_metrics`)."""
    metrics = list(metrics) if metrics else default_metrics(runs)
    groups = chosen_groups(runs) if len(runs) > 1 else []
    keys = [*groups, *(key for key in (differing([run.config for run in runs]) if len(runs) > 1 else [])
                       if not implied(key, groups, runs))]
    names = {**{group: group for group in groups}, **short_names([key for key in keys if key not in groups])}
    short = [run_name(run) for run in runs]
    unique = len(set(short)) == len(short)
    rows = []
    for run, name in zip(runs, short):
        flat, lines = {**flatten(run.config), **run.choices}, log_lines(run)
        state = status(run, lines, now)
        rows.append(Row(name if unique else run.path.name, {names[key]: flat.get(key, "") for key in keys}, state,
                        figures(run, metrics, lines), [run], why(lines, run.path) if state == CRASHED else ""))
    return Report(rows, keys, names, metrics)


def chosen_groups(runs: Sequence[Run]) -> list[str]:
    """The config groups whose option differs between the runs (``algo``: ``dpo`` against ``ipo``), outermost only
    (``algo/loss`` goes with ``algo``): the report names the option the user chose, not the classes it expands to
    (:func:`implied`); the parameters that differ stay columns beside it."""
    recorded = [run.choices for run in runs if run.choices]
    names = list(dict.fromkeys(group for choices in recorded for group in choices))
    differ = [g for g in names if len({choices.get(g, "") for choices in recorded}) > 1]
    return [g for g in differ if not any(g.startswith(f"{outer}/") for outer in differ)]


def implied(key: str, groups: Sequence[str], runs: Sequence[Run]) -> bool:
    """Whether the flattened ``key`` lies inside a config group whose chosen option is a column already, every run
    with the same option has the same value there, and it is the option's own node (its class or loss,
    ``algo.loss: ipo_loss``) or a parameter with one value in every run that has it (IPO's and DPO's
    ``label_smoothing``; GRPO's ``num_generations``, which DPO lacks): the option names it. A parameter whose value
    differs between the runs that have it (each optimizer's ``lr``, DPO's and SimPO's β) or one a run set on its
    command line stays a column."""
    nodes = {name.replace("/", ".") for run in runs for name in run.choices}  # a group's own node: its option
    if key not in nodes:
        if any(key in {k.lstrip("+") for k in run.override_values} for run in runs):
            return False
        having = [repr(flatten(run.config)[key]) for run in runs if run.config and key in flatten(run.config)]
        if len(set(having)) > 1:  # it differs between the runs that have it (each optimizer's lr, DPO's and SimPO's β)
            return False
    for group in groups:
        prefix = group.replace("/", ".")
        if key != prefix and not key.startswith(prefix + "."):
            continue
        values: dict[str, set[str]] = {}
        for run in runs:
            if run.config:
                values.setdefault(run.choices.get(group, ""), set()).add(repr(flatten(run.config).get(key)))
        if all(len(v) == 1 for v in values.values()):
            return True
    return False


def seed_of(run: Run) -> Any:
    """The run's ``seed``: its config's, else its ``summary.json``'s; None where neither says (no ``.hydra/``)."""
    seed = (run.config or {}).get("seed")
    return seed if seed is not None else (run.summary or {}).get("seed")


def seeds_name(runs: Sequence[Run]) -> str:
    """An aggregated row's name, from its runs' own seeds (whether or not ``seed`` is a column): ``3 seeds (0,1,2)``,
    ``1 seed (1)``; where runs share a seed or do not say theirs, the runs counted too: ``2 runs, 1 seed (0)``,
    ``1 run (seed unknown)``."""
    count = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    seeds = list(dict.fromkeys(str(seed) for seed in map(seed_of, runs) if seed is not None))
    if not seeds:
        return f"{count(len(runs), 'run')} (seed unknown)"
    named = f"{count(len(seeds), 'seed')} ({','.join(seeds)})"
    return named if len(seeds) == len(runs) else f"{count(len(runs), 'run')}, {named}"


def aggregate_seeds(report: Report) -> Report:
    """Runs whose differing values are the same but for ``seed`` folded into one row each: every figure's mean over
    the group's finished runs that have it (over all its runs where none finished), and its standard deviation
    (:attr:`Row.spread`, over two or more), except a metric's best and best step: those of the seeds' mean curve
    (:func:`~rlhf.sweeps.plots.mean_curve`, at the steps every seed logged), without a spread; the status counts
    the runs by status; the name, their seeds (:func:`seeds_name`)."""
    keys = [key for key in report.keys if key != "seed"]
    groups: dict[tuple, list[Row]] = {}
    for row in report.rows:
        groups.setdefault(tuple(repr(row.values[report.names[key]]) for key in keys), []).append(row)
    rows = []
    for members in groups.values():
        figures_, spread = {}, {}
        counted = [row for row in members if row.status == FINISHED] or members
        for column in report.figure_columns:
            values = [row.figures[column] for row in counted if row.figures.get(column) is not None]
            values = [value for value in values if math.isfinite(value)]
            figures_[column] = statistics.fmean(values) if values else None
            if len(values) > 1:
                spread[column] = statistics.stdev(values)
        for metric in report.metrics:  # the best of the seeds' mean curve: a best step's mean over seeds means nothing
            curve = mean_curve([run.history(metric) for row in counted for run in row.runs])
            if curve:
                step, value, _ = (min if lower_is_better(metric) else max)(curve, key=lambda point: point[1])
                figures_.update({f"{metric} best": value, f"{metric} best step": step})
                spread.pop(f"{metric} best", None)
                spread.pop(f"{metric} best step", None)
        counts = {state: sum(row.status == state for row in members) for state in (FINISHED, RUNNING, CRASHED)}
        state = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
        runs = [run for row in members for run in row.runs]
        rows.append(Row(seeds_name(runs), {report.names[key]: members[0].values[report.names[key]] for key in keys},
                        state, figures_, runs, "; ".join(row.note for row in members if row.note), spread))
    return Report(rows, keys, {key: report.names[key] for key in keys}, report.metrics, aggregated=True)


def objective_of(runs: Sequence[Run]) -> str | None:
    """The ``objective.metric`` that every one of `runs` names (what a search optimized), else None."""
    from omegaconf import OmegaConf

    metrics = set()
    for run in runs:  # .hydra/config.yaml is unresolved: the default objective is the algorithm's (rlhf.sweeps.points)
        try:
            metrics.add(str(OmegaConf.select(OmegaConf.create(run.config or {}), "objective.metric", default=None)))
        except Exception:  # a config that no longer resolves (a renamed class): no objective to plot
            metrics.add("None")
    return metrics.pop() if len(metrics) == 1 and "None" not in metrics else None


def write(report: Report, out: Path, plot_metrics: Sequence[str] | None = None,
          objective: str | None = None) -> list[Path]:
    """``report.md``, ``report.csv`` and ``report.png`` in ``out``, and with an `objective` metric ``objective.png``
    where the runs searched a number (:func:`plot_objective`), and ``frontier.png`` where runs report the generation
    evaluation's reward and KL (:func:`plot_frontier`); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    md, table_csv, png = (out / name for name in FILES)
    md.write_text(markdown(report))
    with table_csv.open("w", newline="") as file:
        csv.writer(file).writerows(csv_rows(report))
    plot_curves(report, plot_metrics or ["train/loss", *report.metrics], png)
    written = [md, table_csv, png]
    if objective and plot_objective(report, objective, out / "objective.png"):
        written.append(out / "objective.png")
    if plot_frontier(report, out / "frontier.png"):
        written.append(out / "frontier.png")
    return written
