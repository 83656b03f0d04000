"""Choose settings on a validation split, then report fresh runs of the choice: the ``select_then_confirm`` sweeper.

    python train.py experiment=optimizer_comparison        # each optimizer at its own best learning rate

A search that scores and reports on the same rows flatters its winner (the best of N noisy scores is biased up).
This sweeper keeps the two apart, in one multirun under any launcher:

1. **search**: for each value of ``compare`` (e.g. ``optimizer=sgd,adamw``: each optimizer is searched on its own),
   every point of its ``search`` grid (Hydra's sweep syntax: ``optimizer.lr=0.01,0.03,0.1``), with the ``select_on``
   overrides (``data.evaluate_on=validation``: the validation rows, :class:`rlhf.data.source.DataSource`). One
   batch for all compared values: under ``launcher=slurm`` they run side by side.
2. **select**: per compared value, the point with the best final ``objective.metric`` (``objective.direction``);
   failed points (``failed.json``) are never chosen.
3. **confirm**: each choice again, from scratch, with the ``confirm_on`` overrides (``data.evaluate_on=held_out``
   and other seeds, ``seed=1,2,3``: one job each), in a second batch. These are the figures to report.

With ``confirm=every`` nothing is chosen: no search runs, and every point of each compared value's grid is run
with the ``confirm_on`` overrides (each objective at each strength over seeds: ``experiment=objective_frontier``).
With ``widen_edges=true``, a choice on the edge of its grid gets one more point searched beyond that edge, once,
before the choice is made again (:meth:`Study.widen`).

The sweep folder holds ``search/`` and ``confirm/`` (one run folder per job), ``selection.json`` and
``selection.md`` (each compared value: its searched points and scores, the choice, the confirmed figures as mean ±
std), and the reports of :mod:`rlhf.sweeps.report` (``search/report.*`` with ``objective.png``, the objective against each
searched parameter; ``confirm/report.*``, seeds folded). The Hydra plugin class is
``hydra_plugins/rlhf_sweepers.py``; the logic is here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf.core.errors import UserError

log = logging.getLogger(__name__)

SELECTION = "selection.json"
STAGES = ("search", "confirm")
CONFIRM = ("chosen", "every")  # hydra.sweeper.confirm: what the confirm stage runs


def grid(overrides: str | Sequence[str] | None) -> list[list[str]]:
    """Hydra sweep overrides (``"optimizer.lr=0.1,0.3 algo.beta=0.1"``, or a list of them) -> every combination, as
    lists of plain overrides, in Hydra's order (the basic sweeper's cartesian product)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if overrides is None:
        return [[]]
    items = overrides.split() if isinstance(overrides, str) else [str(item) for item in overrides]
    if not items:
        return [[]]
    parsed = OverridesParser.create().parse_overrides(items)
    return BasicSweeper.split_arguments(parsed, None)[0]


def check_arguments(arguments: Sequence[str], where: str = "hydra.sweeper.search",
                    fix: str = "hydra.sweeper.search='<key>=<v1>,<v2>' (or drop the override)") -> None:
    """Command-line overrides apply to every job; a sweep among them (``a=1,2``) is refused: the grid is
    ``hydra.sweeper.search`` (``fix``: where it goes for another sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(arguments))
    sweeps = [text for text, override in zip(arguments, parsed) if override.is_sweep_override()]
    if sweeps:
        raise UserError(f"{' '.join(sweeps)}: this sweeper takes its grid from {where}, not from the command line. "
                        f"Fix: {fix}")


def as_overrides(values: Mapping[str, Any] | None) -> list[str]:
    """``{data.evaluate_on: validation, seed: "1,2,3"}`` -> ``["data.evaluate_on=validation", "seed=1,2,3"]``."""
    return [f"{key}={value}" for key, value in (values or {}).items()]


def compared_values(compare: str | None) -> list[list[str]]:
    """``"optimizer=sgd,adamw"`` -> ``[["optimizer=sgd"], ["optimizer=adamw"]]``; ``None``: one group, no override."""
    return grid(compare) if compare else [[]]


def search_space(search: Any, compared: Sequence[str]) -> list[list[str]]:
    """The grid searched for one compared value: ``search`` itself (a string or list of overrides, the same for
    every value), or ``search[<value>]`` for a mapping keyed by the compared value (``sgd`` of ``optimizer=sgd``)."""
    if isinstance(search, Mapping):
        key = ",".join(override.partition("=")[2] for override in compared)
        if key not in search:
            raise UserError(f"hydra.sweeper.search has no grid for {key!r} (it has {', '.join(map(str, search))}). "
                            f"Fix: add hydra.sweeper.search.{key}: '<key>=<v1>,<v2>,...'")
        search = search[key]
    return grid(search)


@dataclasses.dataclass
class Point:
    """One job: the compared value, its own overrides (a searched point, or a confirm seed), where it ran and what
    it returned (``None``: it failed)."""

    compared: list[str]
    overrides: list[str]
    folder: str = ""
    value: float | None = None
    reason: str = ""
    source: list[str] | None = None  # a confirm job's search point (its overrides)


@dataclasses.dataclass
class Study:
    """The plan and the results of one select-then-confirm sweep."""

    metric: str
    direction: str
    search: list[Point]
    confirm: list[Point] = dataclasses.field(default_factory=list)
    every: bool = False  # confirm every point of the grids (nothing is chosen; no search runs)
    widened: list[Point] = dataclasses.field(default_factory=list)  # points added beyond a chosen edge (:meth:`widen`)

    @classmethod
    def plan(cls, compare: str | None, search: Any, objective: Mapping[str, str], confirm: str = "chosen") -> Study:
        if confirm not in CONFIRM:
            raise UserError(f"hydra.sweeper.confirm={confirm!r} is not one of {', '.join(CONFIRM)}. Fix: "
                            "hydra.sweeper.confirm=chosen (search, then confirm each choice) or every (confirm every "
                            "point of the grids: a frontier or a curve over a parameter)")
        points = [Point(list(compared), point) for compared in compared_values(compare)
                  for point in search_space(search, compared)]
        return cls(objective["metric"], objective["direction"], points, every=confirm == "every")

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b

    def groups(self) -> list[list[str]]:
        return list({tuple(p.compared): p.compared for p in self.search}.values())

    def chosen(self, compared: Sequence[str]) -> Point | None:
        """The best search point of a compared value that returned a number; ``None`` when every one failed."""
        best = None
        for point in self.search:
            if point.compared == list(compared) and point.value is not None:
                if best is None or self.better(point.value, best.value):
                    best = point
        return best

    def on_edge(self, compared: Sequence[str]) -> list[str]:
        """The searched numbers whose chosen value is the lowest or the highest of the compared value's grid (its
        points that returned a number), each as ``"optimizer.lr=1e-4 (the lowest of 3)"``: the best may lie outside
        what was searched."""
        choice = self.chosen(compared)
        if choice is None:
            return []
        edges = []
        for override in choice.overrides:
            key, _, value = override.partition("=")
            values = {float(v) for p in self.search if p.compared == list(compared) and p.value is not None
                      for k, _, v in (o.partition("=") for o in p.overrides) if k == key and _number(v)}
            if len(values) > 1 and _number(value) and float(value) in (min(values), max(values)):
                side = "lowest" if float(value) == min(values) else "highest"
                edges.append(f"{override} (the {side} of {len(values)})")
        return edges

    def widen(self) -> list[Point]:
        """One more search point per compared value whose choice sits on the edge of its grid: the chosen point with
        that number moved one step further out (the grid's own step beyond the edge: ×(edge/neighbour) where both
        are positive, else +(edge − neighbour)). Added to the search and returned, for the sweeper to run before it
        chooses again (``hydra.sweeper.widen_edges``: once, so a sweep cannot walk off without end)."""
        added = []
        for compared in self.groups():
            choice = self.chosen(compared)
            for edge in self.on_edge(compared):
                key, _, value = edge.split(" ")[0].partition("=")
                texts = {v for p in self.search if p.compared == compared and p.value is not None
                         for k, _, v in (o.partition("=") for o in p.overrides) if k == key and _number(v)}
                tried = {float(v) for p in self.search if p.compared == compared
                         for k, _, v in (o.partition("=") for o in p.overrides) if k == key and _number(v)}
                values = sorted(float(v) for v in texts)
                edge_value = float(value)
                neighbour = values[1] if edge_value == values[0] else values[-2]
                if edge_value > 0 and neighbour > 0:  # a geometric grid: the same ratio once more
                    beyond = edge_value * edge_value / neighbour
                else:
                    beyond = edge_value + (edge_value - neighbour)
                integers = all(float(t).is_integer() and "." not in t and "e" not in t.lower() for t in texts)
                if integers and round(beyond) not in (0, edge_value) and (round(beyond) > 0) == (edge_value > 0):
                    beyond = round(beyond)  # a grid written in whole numbers stays so where it can
                else:
                    integers = False
                if edge_value == 0 or (beyond > 0) != (edge_value > 0) or beyond == 0 or beyond in tried:
                    log.warning("%s: %s is on the edge of its grid next to 0 or a point already tried; not widened "
                                "(across or onto 0 is no setting for a strength or a rate): widen it by hand",
                                " ".join(compared) or "search", edge)
                    continue
                text = str(int(beyond)) if integers else f"{beyond:.6g}"
                overrides = [f"{key}={text}" if o.partition("=")[0] == key else o for o in choice.overrides]
                added.append(Point(list(compared), overrides))
        self.search += added
        self.widened += added
        return added

    def plan_confirm(self, confirm_on: str | Sequence[str] | None) -> list[Point]:
        """The confirm jobs: each compared value's choice (with ``every``: each point of its grid) with each
        combination of ``confirm_on`` (a key in both: ``confirm_on``'s value, so that a searched ``seed`` gives way
        to the confirm seeds). A choice on the edge of its grid is logged as a warning (:meth:`on_edge`)."""
        self.confirm = []
        for compared in self.groups():
            if self.every:
                sources = [p for p in self.search if p.compared == compared]
            else:
                choice = self.chosen(compared)
                if choice is None:
                    continue
                widened = any(p.compared == compared for p in self.widened)
                for edge in self.on_edge(compared):
                    log.warning("%s: the chosen %s is on the edge of its grid%s: the best value may lie beyond it; "
                                "widen the grid (hydra.sweeper.search%s) and search again", " ".join(compared)
                                or "search", edge, " (widened once already)" if widened else "",
                                "" if widened else ", or once by itself: hydra.sweeper.widen_edges=true")
                sources = [choice]
            for source in sources:
                for extra in grid(confirm_on):
                    keys = {override.partition("=")[0] for override in extra}
                    kept = [o for o in source.overrides if o.partition("=")[0] not in keys]
                    self.confirm.append(Point(list(compared), [*kept, *extra], source=source.overrides))
        return self.confirm

    def summary(self) -> dict[str, Any]:
        """What ``selection.json`` holds."""
        groups = {}
        for compared in self.groups():
            choice = self.chosen(compared)
            confirmed = [p for p in self.confirm if p.compared == compared]
            values = [p.value for p in confirmed if p.value is not None]
            groups[" ".join(compared) or "all"] = {
                "search": [dataclasses.asdict(p) for p in self.search if p.compared == compared],
                "chosen": None if self.every or choice is None else choice.overrides,
                "on_edge": [] if self.every else self.on_edge(compared),
                "widened": [p.overrides for p in self.widened if p.compared == compared],
                "confirm": [dataclasses.asdict(p) for p in confirmed],
                "mean": statistics.fmean(values) if values and not self.every else None,
                "std": statistics.stdev(values) if len(values) > 1 and not self.every else None,
                "points": [_spread(point.overrides, [p.value for p in confirmed if p.source == point.overrides])
                           for point in self.search if point.compared == compared] if self.every else [],
            }
        return {"objective": {"metric": self.metric, "direction": self.direction},
                "confirm": "every" if self.every else "chosen", "compared": groups}


def _spread(overrides: list[str], values: list[float | None]) -> dict[str, Any]:
    """A grid point's confirmed figures: its overrides, the mean and standard deviation of the runs that returned
    a number, and how many did of how many."""
    got = [v for v in values if v is not None]
    return {"overrides": overrides, "mean": statistics.fmean(got) if got else None,
            "std": statistics.stdev(got) if len(got) > 1 else None, "runs": len(got), "jobs": len(values)}


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def outcome(job_return: Any) -> tuple[float | None, str]:
    """A Hydra JobReturn -> (the objective's value, or None with the reason): a failed point (``FailedPoint``), a
    job whose process failed, or a run that did not report the metric."""
    from hydra.core.utils import JobStatus

    if job_return.status != JobStatus.COMPLETED:
        return None, f"{type(job_return._return_value).__name__}: {job_return._return_value}"
    value = job_return.return_value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value), ""
    return None, "no value" if value is None else str(value)


def markdown(summary: Mapping[str, Any]) -> str:
    """``selection.md``: one row per compared value: the search's range of scores, the choice, the confirmed
    figure."""
    metric = summary["objective"]["metric"]
    if summary.get("confirm") == "every":
        lines = [f"Every point of the grids, run on the held-out rows over fresh seeds (nothing chosen). {metric}:",
                 "", f"| compared | point | {metric}: mean ± std (runs of jobs) |", "|---|---|---|"]
        for name, group in summary["compared"].items():
            for point in group["points"]:
                mean = "failed" if point["mean"] is None else f"{point['mean']:.4g}" + (
                    f" ± {point['std']:.2g}" if point["std"] is not None else "")
                lines.append(f"| {name} | {' '.join(point['overrides']) or '-'} | {mean} "
                             f"({point['runs']} of {point['jobs']}) |")
        return "\n".join(lines) + "\n"
    lines = [f"Objective: {metric} ({summary['objective']['direction']}). Search: validation rows; confirm: fresh "
             "runs of the choice on the held-out rows.", "",
             f"| compared | searched points (failed) | search {metric}: range | chosen | confirm {metric}: mean ± std "
             "(runs) |", "|---|---|---|---|---|"]
    for name, group in summary["compared"].items():
        scores = [p["value"] for p in group["search"] if p["value"] is not None]
        failed = len(group["search"]) - len(scores)
        span = f"{min(scores):.4g} – {max(scores):.4g}" if scores else "none"
        chosen = " ".join(group["chosen"]) if group["chosen"] else "nothing (every point failed)"
        if group.get("widened"):
            chosen += " (the grid widened once: " + "; ".join(" ".join(w) for w in group["widened"]) + ")"
        if group.get("on_edge"):
            chosen += " — **on the grid's edge**: " + ", ".join(group["on_edge"])
        runs = len([p for p in group["confirm"] if p["value"] is not None])
        mean = ("" if group["mean"] is None else f"{group['mean']:.4g}"
                + (f" ± {group['std']:.2g}" if group["std"] is not None else "") + f" ({runs})")
        lines.append(f"| {name} | {len(group['search'])} ({failed}) | {span} | {chosen} | {mean} |")
    return "\n".join(lines) + "\n"


def write(study: Study, sweep_dir: Path) -> list[Path]:
    """``selection.json`` and ``selection.md`` in the sweep folder (below a note where the runs of the two stages did
    not run alike, :func:`rlhf.sweeps.tables.environment_note`), and the reports of its two stages."""
    from rlhf.sweeps import report, tables
    from rlhf.sweeps.results import find

    summary = study.summary()
    staged = {stage: find([sweep_dir / stage]) if (sweep_dir / stage).is_dir() else [] for stage in STAGES}
    note = tables.environment_note([(f"{stage}/{tables.run_name(run)}", run) for stage, runs in staged.items()
                                    for run in runs])
    written = [sweep_dir / SELECTION, sweep_dir / "selection.md"]
    written[0].write_text(json.dumps(summary, indent=2))
    written[1].write_text(tables.note_markdown(note) + markdown(summary))
    for stage, runs in staged.items():
        folder = sweep_dir / stage
        if not runs:
            continue
        made = report.build(runs, sorted({study.metric} | set(report.default_metrics(runs))))
        if stage == "confirm":
            made = report.aggregate_seeds(made)
        written += report.write(made, folder, objective=study.metric if stage == "search" else None)
    return written
