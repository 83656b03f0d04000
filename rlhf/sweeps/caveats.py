"""What a report says above its table where its figures could be misread (:mod:`rlhf.sweeps.tables`): speeds of runs
that ran beside different loads of other work on the machine (or did not record theirs), and curves drawn through
too few points. Each note reads the runs as ``(name, run)`` pairs (:func:`rlhf.sweeps.tables.named_runs`).

- :func:`load_note`: tokens/s and wall s compare the machine's load as much as the settings where the runs' other work
  (``perf/busy_cpus_other``, :mod:`rlhf.telemetry.load`: CPUs busy with work other than the run's, at each log
  window) differs by more than :data:`LOAD_MARGIN_CPUS` in median; runs that did not record it (older ones) are named
  as such wherever speeds are compared.
- :func:`points_note`: finished runs whose training curve has fewer than :data:`MIN_POINTS` points (a 6-step run
  with ``train.log_every_steps=10`` logs one), with the setting that draws more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rlhf.sweeps.bf16_note import bf16_note
from rlhf.telemetry.load import OTHER, summarise

LOAD_MARGIN_CPUS = 0.5  # runs whose median other-work CPUs differ by more than this ran beside different loads
MIN_POINTS = 3  # a curve of fewer points is a dot or a straight line, whatever the training did
SPEED = "perf/tokens_per_s"  # a run that logged this compares speeds (tokens/s, wall s) with the others
LOAD_COLUMN = "other work (CPUs)"  # the report's column beside tokens/s: the median of perf/busy_cpus_other
LOAD_HEAD = (f"Speeds not comparable: tokens/s and wall s of these runs were measured beside different loads of "
             f"other work: the CPUs busy with work other than the run's ({OTHER}), median over the run's log windows "
             f"(min–max), differ by more than {LOAD_MARGIN_CPUS} CPU")
UNRECORDED_HEAD = (f"Speeds may not compare: tokens/s and wall s depend on other work on the machine, which some of "
                   f"these runs did not record ({OTHER})")
NONE_RECORDED_HEAD = (f"Speeds may not compare: tokens/s and wall s depend on other work on the machine, which none "
                      f"of these runs recorded ({OTHER})")
POINTS_HEAD = (f"Too few points: these runs logged fewer than {MIN_POINTS} training points, so their curves "
               f"(report.png) are a dot or a straight line whatever the training did. Fix: a train.log_every_steps "
               f"of at most a third of the run's steps")


def run_load(run: Any) -> dict[str, Any] | None:
    """Other work's busy CPUs over the run's log windows (``{"busy_cpus_other": {"min", "median", "max"},
    "windows", "cpus"}``: :func:`rlhf.telemetry.load.summarise`), from its metrics.jsonl (every attempt of a resumed
    run, and a run still going), else its summary.json; None for a run that recorded none (older than the metric)."""
    values = [value for _, value in run.history(OTHER) if math.isfinite(value)]
    cpus = (getattr(run, "environment", None) or {}).get("cpus")
    return summarise(values, cpus) if values else ((run.summary or {}).get("load") or None)


def median_load(run: Any) -> float | None:
    """The median of the run's ``perf/busy_cpus_other`` (the report's :data:`LOAD_COLUMN`), or None."""
    load = run_load(run)
    return None if load is None else float(load["busy_cpus_other"]["median"])


def _runs(names: Sequence[str]) -> str:
    return f"{'runs' if len(names) > 1 else 'run'} {', '.join(names)}"


def load_note(runs: Sequence[tuple[str, Any]]) -> tuple[str, list[str]]:
    """(head, lines) where two or more of ``runs`` logged speeds and their loads differ (medians more than
    :data:`LOAD_MARGIN_CPUS` apart) or some did not record one: a line per recorded run, ``run 1: 1.6 of 2 CPUs
    (1.2–1.9 over 12 windows)``, and ``load not recorded: runs 2, 3``; ``("", [])`` where the speeds compare."""
    timed = [(name, run) for name, run in runs if any(math.isfinite(value) for _, value in run.history(SPEED))]
    if len(timed) < 2:
        return "", []
    loads = [(name, run_load(run)) for name, run in timed]
    medians = [load["busy_cpus_other"]["median"] for _, load in loads if load]
    missing = [name for name, load in loads if not load]
    differ = len(medians) > 1 and max(medians) - min(medians) > LOAD_MARGIN_CPUS
    if not differ and not missing:
        return "", []
    lines = []
    for name, load in loads:
        if load:
            other, cpus = load["busy_cpus_other"], load.get("cpus")
            lines.append(f"run {name}: {other['median']:.1f}{f' of {cpus} CPUs' if cpus else ' CPUs'} "
                         f"({other['min']:.1f}–{other['max']:.1f} over {load['windows']} "
                         f"window{'s' if load['windows'] != 1 else ''})")
    if missing:
        lines.append(f"load not recorded: {_runs(missing)}")
    head = LOAD_HEAD if differ else UNRECORDED_HEAD if medians else NONE_RECORDED_HEAD
    return head, lines


def points_note(runs: Sequence[tuple[str, Any]]) -> tuple[str, list[str]]:
    """(head, lines) naming each finished run whose training curve has 1 to :data:`MIN_POINTS` − 1 points: ``run 0:
    1 training point in 6 steps (train.log_every_steps=10; held-out: 2 points, train.eval_every_steps=0)``;
    ``("", [])`` where every curve has enough."""
    lines = []
    for name, run in runs:
        if run.summary is None:  # a run still going (or crashed): its curve is what it logged so far
            continue
        windows = sorted({step for step, _ in run.history(SPEED)}) or sorted({step for step, _ in run.history(
            "train/loss")})
        if not 0 < len(windows) < MIN_POINTS:
            continue
        train = {**((run.config or {}).get("train") or {}), **((run.summary or {}).get("train") or {})}
        held_out = {record["step"] for record in run.metrics if any(key.startswith("eval/") for key in record)}
        steps = max(record.get("step", 0) for record in run.metrics)
        line = (f"run {name}: {len(windows)} training point{'s' if len(windows) > 1 else ''} in {steps} step"
                f"{'s' if steps != 1 else ''} (train.log_every_steps={train.get('log_every_steps', '?')}")
        if 0 < len(held_out) < MIN_POINTS:
            line += (f"; held-out: {len(held_out)} point{'s' if len(held_out) > 1 else ''}, "
                     f"train.eval_every_steps={train.get('eval_every_steps', '?')}")
        lines.append(line + ")")
    return (POINTS_HEAD, lines) if lines else ("", [])


def notes(runs: Sequence[tuple[str, Any]]) -> list[tuple[str, list[str]]]:
    """Every note that applies to ``runs``, as (head, lines)."""
    return [note for note in (load_note(runs), points_note(runs), bf16_note(runs)) if note[1]]


def markdown(runs: Sequence[tuple[str, Any]]) -> str:
    """:func:`notes` as Markdown quotes to put above a table (``""`` for none)."""
    text = ""
    for head, lines in notes(runs):
        title, _, rest = head.partition(":")
        text += f"> **{title}**:{rest}:\n" + "".join(f"> - {line}\n" for line in lines) + "\n"
    return text


def text(runs: Sequence[tuple[str, Any]]) -> str:
    """:func:`notes` for a terminal, above the printed table (``""`` for none)."""
    return "".join(f"{head}:\n" + "".join(f"  - {line}\n" for line in lines) + "\n" for head, lines in notes(runs))
