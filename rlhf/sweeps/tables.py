"""The report's text (:mod:`rlhf.sweeps.report`): numbers rounded to what they can show, the table as Markdown,
aligned text and CSV, and a note on runs that did not run alike (their ``environment.json``). It reads a report by
its attributes only (rows, value_columns, figure_columns, aggregated), so that it does not import the report back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rlhf.sweeps import caveats

FIGURE_DIGITS = 4  # significant digits of a measured figure (a loss, an accuracy, tokens/s)
SPREAD_DIGITS = 2  # significant digits of a figure's standard deviation over seeds
VALUE_DIGITS = 3  # significant digits of a setting (a learning rate) at least; more where a column needs them
SETUP_KEYS = ("threads_per_process", "mixed_precision", "machine")  # of environment.json: numbers differ with them


def rounded(value: Any, digits: int = FIGURE_DIGITS) -> str:
    """A float to ``digits`` significant digits (``0.7294298980537985`` -> ``0.7294``; 1e-05 stays ``1e-05``), a
    whole part too long for them written out, not as an exponent (``12345.6`` -> ``12346``); anything else as
    ``str``."""
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    text = f"{value:.{digits}g}"
    return f"{value:.0f}" if "e+" in text and abs(value) < 1e7 else text


def digits_apart(values: Sequence[Any], least: int = VALUE_DIGITS) -> int:
    """The fewest significant digits, ``least`` or more, at which the different floats among ``values`` stay
    different (``0.1234`` and ``0.1236`` need 4)."""
    floats = {v for v in values if isinstance(v, float) and math.isfinite(v)}
    return next((d for d in range(least, 17) if len({rounded(v, d) for v in floats}) == len(floats)), 17)


def shown_values(report) -> list[dict[str, str]]:
    """Each row's values as the table and the figures' legends show them: a float to the fewest significant digits,
    :data:`VALUE_DIGITS` or more, that keep its column's values apart (:func:`digits_apart`)."""
    digits = {c: digits_apart([row.values.get(c) for row in report.rows]) for c in report.value_columns}
    return [{c: rounded(v, digits.get(c, VALUE_DIGITS)) for c, v in row.values.items()} for row in report.rows]


def number(value: float | None, spread: float | None = None) -> str:
    """A figure (:data:`FIGURE_DIGITS`), with ``± spread`` (:data:`SPREAD_DIGITS`) where given; ``""`` for None."""
    if value is None:
        return ""
    text = rounded(float(value))
    return text if spread is None else f"{text} ± {rounded(float(spread), SPREAD_DIGITS)}"


def run_name(run) -> str:
    """A multirun job's number (``3`` of ``3_optimizer=lion,...``: the values are columns), else the folder's name
    (:func:`rlhf.sweeps.report.build` keeps whole names where numbers would repeat)."""
    number_, _, rest = run.path.name.partition("_")
    return number_ if number_.isdigit() and rest else run.path.name


def named_runs(report) -> list[tuple[str, Any]]:
    """Every run of the report's rows with a name that tells it apart: its job number, else its folder's name, else
    its path."""
    runs = [run for row in report.rows for run in row.runs]
    for name in (run_name, lambda run: run.path.name, lambda run: str(run.path)):
        names = [name(run) for run in runs]
        if len(set(names)) == len(names):
            break
    return list(zip(names, runs))


def environment_note(runs: Sequence[tuple[str, Any]]) -> list[str]:
    """For each of :data:`SETUP_KEYS` whose value differs between the runs that recorded their ``environment.json``
    (``(name, run)`` pairs), one line naming the runs of each value: ``threads_per_process: 1 (runs 0, 2); 2 (run
    1)``; the thread count only among runs whose numbers depend on it (bf16 on a CPU). Runs without the file (older
    runs) take no part. Empty where they ran alike: their numbers then compare
    bit for bit as far as these settings go."""
    recorded = [(name, run.environment) for name, run in runs if getattr(run, "environment", None) is not None]
    lines = []
    for key in SETUP_KEYS:
        by_value: dict[str, list[str]] = {}
        for name, environment in recorded:
            if key == "threads_per_process" and not _threads_change_numbers(environment):
                continue  # float32 on a CPU, or a GPU: the same numbers at any thread count
            by_value.setdefault(str(environment.get(key, "not recorded")), []).append(name)
        if len(by_value) > 1:
            lines.append(f"{key}: " + "; ".join(f"{value} ({'runs' if len(names) > 1 else 'run'} {', '.join(names)})"
                                                 for value, names in by_value.items()))
    return lines


def _threads_change_numbers(environment: dict[str, Any]) -> bool:
    """Whether a run's numbers depend on its thread count (bf16 on a CPU), as its environment.json says (a file
    written before it said so: bf16 autocast)."""
    return bool(environment.get("threads_change_numbers", environment.get("mixed_precision") == "bf16"))


NOTE = ("Not comparable bit for bit: these runs did not run alike (their environment.json), which alone changes "
        "their numbers")


def note_markdown(lines: Sequence[str]) -> str:
    """:func:`environment_note`'s lines as a Markdown quote to put above a table (``""`` for none)."""
    if not lines:
        return ""
    head, _, rest = NOTE.partition(":")
    return f"> **{head}**:{rest}:\n" + "".join(f"> - {line}\n" for line in lines) + "\n"


def table(report) -> tuple[list[str], list[list[str]]]:
    """The header and the rows as text (mean ± std where aggregated), values and figures rounded
    (:func:`shown_values`, :func:`number`)."""
    header = ["run", *report.value_columns, *report.figure_columns, "status", "note"]
    rows = [[row.name, *(shown[c] for c in report.value_columns),
             *(number(row.figures.get(c), row.spread.get(c)) for c in report.figure_columns), row.status, row.note]
            for row, shown in zip(report.rows, shown_values(report))]
    return header, rows


def csv_rows(report) -> list[list[Any]]:
    """The table for CSV: plain numbers (repr, so exact), and for an aggregated report a ``<column> std`` column
    after each figure."""
    figure_header = [name for c in report.figure_columns for name in ((c, f"{c} std") if report.aggregated else (c,))]
    header = ["run", *report.value_columns, *figure_header, "status", "note"]
    rows = []
    for row in report.rows:
        cells = []
        for c in report.figure_columns:
            cells.append("" if row.figures.get(c) is None else repr(row.figures[c]))
            if report.aggregated:
                cells.append(repr(row.spread[c]) if c in row.spread else "")
        rows.append([row.name, *(row.values[c] for c in report.value_columns), *cells, row.status, row.note])
    return [header, *rows]


def markdown(report) -> str:
    """The table in Markdown, below the note on runs that did not run alike (:func:`environment_note`) and those on
    speeds and curves that could be misread (:mod:`rlhf.sweeps.caveats`), if any."""
    header, rows = table(report)
    escape = lambda cell: str(cell).replace("|", "\\|")  # noqa: E731
    lines = [header, ["---"] * len(header), *rows]
    return note_markdown(environment_note(named_runs(report))) + caveats.markdown(named_runs(report)) + "".join(
        "| " + " | ".join(map(escape, line)) + " |\n" for line in lines)


def text(report) -> str:
    """The table aligned in columns, for a terminal, below the note on runs that did not run alike, if any."""
    header, rows = table(report)
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    note = environment_note(named_runs(report))
    head = f"{NOTE}:\n" + "".join(f"  - {line}\n" for line in note) + "\n" if note else ""
    head += caveats.text(named_runs(report))  # speeds beside different loads, curves of too few points
    return head + "".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() + "\n"
                          for line in [header, ["-" * w for w in widths], *rows])
