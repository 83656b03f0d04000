"""The report's figures (:mod:`rlhf.sweeps.report`): the training and held-out curves of its rows, and a search's objective
against each searched parameter. They read a :class:`rlhf.sweeps.report.Report` by its attributes only (rows, names,
value_columns), so that this module does not import the report back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def label(row) -> str:
    """The row's differing values (those it has), or its name."""
    return ", ".join(f"{key}={value}" for key, value in row.values.items() if value != "") or row.name


def plot_curves(report, metrics: Sequence[str], path: Path) -> None:
    """One panel per metric name (``loss``, ``exact_match``...): its training curve solid and its held-out curve
    dashed, one colour per row (an aggregated row: each of its seeds in its colour), the legend from the values
    that differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(metric.partition("/")[2] or metric for metric in metrics))
    columns = min(len(names), 3)
    grid = (math.ceil(len(names) / columns), columns)
    figure, axes = plt.subplots(*grid, figsize=(5.5 * grid[1], 3.2 * grid[0] + 0.3 * len(report.rows) + 0.5),
                                squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for panel, name in zip(axes.flat, names):
        for index, row in enumerate(report.rows):
            colour, labelled = colours[index % len(colours)], False
            for run in row.runs:
                for split, style in (("train", "-"), ("eval", "--")):
                    points = run.history(f"{split}/{name}")
                    if points:
                        panel.plot(*zip(*points), style, color=colour, marker="." if len(points) < 30 else None,
                                   label=None if labelled else label(row))
                        labelled = True
        panel.set_title(f"{name} (solid: train, dashed: held-out)", fontsize=9)
        panel.set_xlabel("step")
    for panel in list(axes.flat)[len(names):]:
        panel.set_visible(False)
    legend = {}  # label -> line, over every panel (a run may lack a metric)
    for panel in axes.flat:
        legend.update(zip(*reversed(panel.get_legend_handles_labels())))
    if legend:
        figure.legend(legend.values(), legend.keys(), loc="outside lower center", fontsize=8)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def searched_parameters(report) -> tuple[list[str], list[str]]:
    """The axes of a search and the columns naming its series: a differing value that is a number in every row
    that has it (not ``seed``) is searched where it takes two or more values among rows that agree on everything
    that is not a number (``lr`` within ``optimizer=SGD``; not ``weight_decay``, which only follows the optimizer);
    the series are named by the fewest non-number columns that tell them apart (``optimizer``)."""
    seed = report.names.get("seed")
    present = {c: [row.values[c] for row in report.rows if row.values[c] != ""] for c in report.value_columns}
    numbers = [c for c in report.value_columns if c != seed and present[c] and all(map(is_number, present[c]))]
    others = [c for c in report.value_columns if c != seed and c not in numbers]
    groups: dict[tuple, list] = {}
    for row in report.rows:
        groups.setdefault(tuple(repr(row.values[c]) for c in others), []).append(row)
    searched = [c for c in numbers if any(len({row.values[c] for row in rows} - {""}) > 1 for rows in groups.values())]
    naming = next(([c] for c in others if len({repr(rows[0].values[c]) for rows in groups.values()}) == len(groups)),
                  others)
    return searched, naming


def plot_objective(report, metric: str, path: Path) -> bool:
    """``metric``'s final value against each searched parameter (:func:`searched_parameters`), one panel each, one
    line per combination of the other values (``optimizer``, the other searched parameters); a log axis where the
    values span 10x or more. Runs without the value (crashed) are left out. False (nothing written) when nothing
    was searched."""
    columns, naming = searched_parameters(report)
    if not columns:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(columns), figsize=(5.5 * len(columns), 3.8), squeeze=False,
                                layout="constrained")
    for panel, column in zip(axes.flat, columns):
        series: dict[str, list[tuple[float, float]]] = {}
        for row in report.rows:
            x, y = row.values[column], row.figures.get(f"{metric} end")
            if is_number(x) and y is not None and math.isfinite(y):
                name = ", ".join(f"{c}={row.values[c]}" for c in [*naming, *(c for c in columns if c != column)]
                                 if row.values[c] != "")
                series.setdefault(name or metric, []).append((x, y))
        for name, points in series.items():
            panel.plot(*zip(*sorted(points)), marker="o", label=name)
        xs = [x for points in series.values() for x, _ in points]
        if xs and min(xs) > 0 and max(xs) >= 10 * min(xs):
            panel.set_xscale("log")
        panel.set_xlabel(column)
        panel.set_ylabel(f"{metric} (end)")
        panel.set_title(f"{metric} against {column}", fontsize=9)
        if len(series) > 1:
            panel.legend(fontsize=7)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
