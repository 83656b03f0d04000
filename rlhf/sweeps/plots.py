"""The report's figures (:mod:`rlhf.sweeps.report`): the training and held-out curves of its rows, a search's objective
against each searched parameter, and the reward-KL frontier. They read a :class:`rlhf.sweeps.report.Report` by its
attributes only (rows, names, value_columns), so that this module does not import the report back.

Read at a glance: values rounded as the table shows them (:func:`rlhf.sweeps.tables.shown_values`); a marker of its
own for each line, and each line drawn thinner than the one before, so that identical curves both show
(:func:`line_style`); a colour scale, not a legend entry per point, for a searched number; legends outside the axes,
each entry drawn as the mark it names. ``*_figure`` return the open figure (for tests); ``plot_*`` write it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf.sweeps.tables import shown_values

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")  # one per line of a figure, in turn
MARKS_PER_LINE = 10  # at most this many markers along one curve; more steps get a marker every few


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_style(index: int, count: int) -> dict[str, Any]:
    """The marker, line width and marker size of the ``index``-th of ``count`` lines drawn on one panel: a marker
    of its own, and each line thinner, each marker smaller, than those drawn before it, so that a line drawn over an
    identical one (two optimizers that behave alike) leaves the earlier showing around it."""
    share = (count - 1 - index) / (count - 1) if count > 1 else 0.5
    return {"marker": MARKERS[index % len(MARKERS)], "linewidth": 1.0 + 2.0 * share, "markersize": 4.0 + 5.0 * share}


def label(row, shown: dict[str, str] | None = None) -> str:
    """The row's differing values (those it has; ``shown``: as the report shows them, rounded), or its name."""
    shown = shown if shown is not None else {key: str(value) for key, value in row.values.items()}
    return ", ".join(f"{key}={shown[key]}" for key, value in row.values.items() if value != "") or row.name


def mean_curve(histories: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float]]:
    """``(step, mean, standard deviation)`` over the runs' histories at the steps every one of them logged with a
    finite value (the seeds of one setting); the deviation is 0 for one run."""
    finite = [{step: value for step, value in history if math.isfinite(value)} for history in histories]
    if not finite or not all(finite):
        return []
    steps = sorted(set.intersection(*(set(h) for h in finite)))
    return [(step, sum(h[step] for h in finite) / len(finite), _sd([h[step] for h in finite])) for step in steps]


LOSS_CHOICES = ("algo", "algo/loss", "algo/loss_type")  # the groups that decide what a run's loss measures


def one_loss_scale(report) -> bool:
    """Whether the rows' losses are one quantity: every run that recorded its choices chose the same objective
    (``algo``, ``algo/loss``, ``algo/loss_type``). IPO's loss starts near 2.8 where DPO's starts at 0.69: on one
    axis their curves say nothing about which objective learns better."""
    chosen = {tuple(run.choices.get(g) for g in LOSS_CHOICES) for row in report.rows for run in row.runs
              if getattr(run, "choices", None)}
    return len(chosen) <= 1


def curves_figure(report, metrics: Sequence[str]):
    """:func:`plot_curves`' figure (open: the caller closes it) and its panels' names."""
    plt = pyplot()
    names = list(dict.fromkeys(metric.partition("/")[2] or metric for metric in metrics))
    if not one_loss_scale(report):
        names = [name for name in names if name != "loss"] or names
    columns = min(len(names), 3)
    grid = (math.ceil(len(names) / columns), columns)
    figure, axes = plt.subplots(*grid, figsize=(5.5 * grid[1], 3.2 * grid[0] + 0.3 * len(report.rows) + 0.5),
                                squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    shown = shown_values(report)
    for panel, name in zip(axes.flat, names):
        for index, row in enumerate(report.rows):
            colour, labelled = colours[index % len(colours)], False
            style = line_style(index, len(report.rows))
            for split, dashes in (("train", "-"), ("eval", "--")):
                histories = [run.history(f"{split}/{name}") for run in row.runs]
                curve = mean_curve(histories) if len(histories) > 1 else [(s, v, 0.0) for h in histories for s, v in h]
                if curve:
                    steps, means, spreads = zip(*curve)
                    every = math.ceil(len(steps) / MARKS_PER_LINE)  # each line's markers at steps of their own
                    panel.plot(steps, means, dashes, color=colour, markevery=(index % every, every),
                               label=None if labelled else label(row, shown[index]), **style)
                    if len(row.runs) > 1:
                        panel.fill_between(steps, [m - d for m, d in zip(means, spreads)],
                                           [m + d for m, d in zip(means, spreads)], color=colour, alpha=0.2,
                                           linewidth=0)
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
    return figure, names


def plot_curves(report, metrics: Sequence[str], path: Path) -> list[str]:
    """One panel per metric name (``loss``, ``exact_match``...): its training curve solid and its held-out curve
    dashed, one colour and one marker per row (an aggregated row: the mean over its seeds with a band of one
    standard deviation; each row's line thinner than the one before, :func:`line_style`), the legend below the
    panels from the values that differ, rounded. The loss panel only where the losses are one quantity
    (:func:`one_loss_scale`). Returns the panels' names."""
    figure, names = curves_figure(report, metrics)
    _save(figure, path)
    return names


def _save(figure, path: Path) -> None:
    figure.savefig(path, dpi=110)
    pyplot().close(figure)


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


def objective_figure(report, metric: str):
    """:func:`plot_objective`'s figure (open: the caller closes it), or None where nothing was searched."""
    columns, naming = searched_parameters(report)
    if not columns:
        return None
    plt = pyplot()
    from matplotlib.cm import ScalarMappable
    from matplotlib.lines import Line2D

    shown = shown_values(report)
    names = [", ".join(f"{c}={shown[i][c]}" for c in naming if row.values[c] != "") or metric
             for i, row in enumerate(report.rows)]
    series = list(dict.fromkeys(names))  # one marker (and, without a colour scale, one colour) each
    colours, colour_map = plt.rcParams["axes.prop_cycle"].by_key()["color"], plt.get_cmap("viridis")
    figure, axes = plt.subplots(1, len(columns), figsize=(6 * len(columns), 4.2), squeeze=False,
                                layout="constrained")
    for panel, column in zip(axes.flat, columns):
        others = [c for c in columns if c != column]  # the first of them as a colour scale
        scale = _norm([row.values[others[0]] for row in report.rows]) if others else None
        lines: dict[tuple, list[tuple[float, float]]] = {}  # (series, the other searched values) -> points
        for i, row in enumerate(report.rows):
            x, y = row.values[column], row.figures.get(f"{metric} end")
            if is_number(x) and y is not None and math.isfinite(y):
                lines.setdefault((names[i], *(row.values[c] for c in others)), []).append((x, y))
        for (name, *rest), points in lines.items():
            index = series.index(name)
            if scale is None:
                colour = colours[index % len(colours)]
            else:  # the colour scale's value; grey for a row without it
                colour = colour_map(scale(rest[0])) if is_number(rest[0]) else "0.5"
            panel.plot(*zip(*sorted(points)), linestyle="-" if len(points) > 1 else "none", color=colour,
                       markeredgecolor=colour if scale is None else "black", markeredgewidth=0.5,
                       **line_style(index, len(series)))
        xs = [x for points in lines.values() for x, _ in points]
        if xs and min(xs) > 0 and max(xs) >= 10 * min(xs):
            panel.set_xscale("log")
        if scale is not None:
            figure.colorbar(ScalarMappable(scale, colour_map), ax=panel, label=f"{others[0]} (colour)")
        panel.set_xlabel(column)
        panel.set_ylabel(f"{metric} (end)")
        panel.set_title(f"{metric} against {column}" + (f", colour: {others[0]}" if others else ""), fontsize=9)
    if len(series) > 1:  # the series by marker (and colour): few entries, below the panels, over no point
        scaled = len(columns) > 1  # each panel coloured by another searched parameter: the series by marker alone
        handles = [Line2D([], [], color="0.4" if scaled else colours[i % len(colours)],
                          linestyle="none" if scaled else "-", **line_style(i, len(series)))
                   for i in range(len(series))]
        figure.legend(handles, series, loc="outside lower center", fontsize=8, ncols=min(len(series), 4))
    return figure


def _norm(values: Sequence[Any]):
    """A colour scale over the numbers among ``values``: logarithmic where they are positive and span 10x or
    more."""
    from matplotlib.colors import LogNorm, Normalize

    numbers = [float(v) for v in values if is_number(v)] or [0.0]
    low, high = min(numbers), max(numbers)
    if low > 0 and high >= 10 * low:
        return LogNorm(low, high)
    return Normalize(low, high if high > low else low + (abs(low) or 1.0))


def plot_objective(report, metric: str, path: Path) -> bool:
    """``metric``'s final value against each searched parameter (:func:`searched_parameters`), one panel each; a
    log axis where the values span 10x or more. Each series (the values not searched: ``optimizer``) has its own
    marker; where another parameter was searched too (a learning rate and a beta), its value is the points' colour,
    read on a colour bar, and the points that share it are joined; else each series is one line of its own colour.
    The legend, below the panels, names the series only (none for one). Runs without the value (crashed) are left
    out. False (nothing written) when nothing was searched."""
    figure = objective_figure(report, metric)
    if figure is None:
        return False
    _save(figure, path)
    return True


REWARD, KL = "eval/gen/reward", "eval/gen/kl"  # the generation evaluation's (rlhf.evaluation.generated)


def objective_name(run) -> str:
    """The objective as the user chose it: the ``algo=`` override (``algo=ipo``, not its expansion into DPO with
    an IPO loss), else the algorithm's class name."""
    chosen = run.override_values.get("algo")
    if chosen:
        return chosen
    target = ((run.config or {}).get("algo") or {}).get("_target_", "?")
    return str(target).rpartition(".")[2]


def frontier_points(report) -> list[dict[str, Any]]:
    """One point per row with both metrics at its end: ``kl`` and ``reward`` (means over the row's runs, the seeds
    of an aggregated row), their standard deviations over those runs (``kl_sd``, ``reward_sd``: 0 for one run),
    ``objective`` (:func:`objective_name`), ``label`` (what varies within its objective, rounded as the report
    shows it), ``runs`` (the row's runs), ``trajectories`` (each run's (KL, reward) at every evaluation that has
    both) and ``front`` (whether no other point has at least its reward for at most its KL, one of them
    strictly)."""
    points = []
    for row, shown in zip(report.rows, shown_values(report)):
        ends, trajectories = [], []
        for run in row.runs:
            rewards, kls = dict(run.history(REWARD)), dict(run.history(KL))
            steps = sorted(set(rewards) & set(kls))
            if steps:
                trajectories.append([(kls[s], rewards[s]) for s in steps])
                ends.append(trajectories[-1][-1])
        if not ends:
            continue
        kls, rewards = [k for k, _ in ends], [r for _, r in ends]
        points.append({"kl": sum(kls) / len(kls), "reward": sum(rewards) / len(rewards),
                       "kl_sd": _sd(kls), "reward_sd": _sd(rewards), "objective": objective_name(row.runs[0]),
                       "label": "", "trajectories": trajectories, "values": row.values, "shown": shown,
                       "runs": row.runs})
    for point in points:
        siblings = [other["values"] for other in points if other["objective"] == point["objective"]]
        point["label"] = _point_label(point["values"], point["shown"], siblings)
    for point in points:
        del point["values"], point["shown"]
    for point in points:
        point["front"] = not any(
            other is not point and other["kl"] <= point["kl"] and other["reward"] >= point["reward"]
            and (other["kl"] < point["kl"] or other["reward"] > point["reward"]) for other in points)
    return points


def _point_label(values: dict[str, Any], shown: dict[str, str], siblings: list[dict[str, Any]]) -> str:
    """A frontier point's annotation: the values (as ``shown``) that differ between the rows of its objective
    (``beta=0.1``), not the objective itself (its colour says it) nor what is the same for all of its rows (its
    batch size)."""
    varying = [key for key in values if key != "algo" and len({repr(s.get(key)) for s in siblings}) > 1]
    return ", ".join(f"{key}={shown[key]}" for key in varying if values[key] != "")


def _sd(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def frontier_figure(report):
    """:func:`plot_frontier`'s figure (open: the caller closes it), or None where no run has both metrics."""
    points = frontier_points(report)
    if not points:
        return None
    plt = pyplot()
    from matplotlib.lines import Line2D

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    objectives = list(dict.fromkeys(point["objective"] for point in points))
    figure, axis = plt.subplots(figsize=(8, 4.8), layout="constrained")
    for point in points:
        index = objectives.index(point["objective"])
        colour = colours[index % len(colours)]
        for trajectory in point["trajectories"]:
            axis.plot(*zip(*trajectory), "-", color=colour, alpha=0.25, linewidth=1)
        axis.errorbar(point["kl"], point["reward"], xerr=point["kl_sd"] or None, yerr=point["reward_sd"] or None,
                      fmt=MARKERS[index % len(MARKERS)], color=colour, capsize=3, markersize=6)
        axis.annotate(point["label"], (point["kl"], point["reward"]), fontsize=6, xytext=(4, 3),
                      textcoords="offset points")
    front = sorted((p for p in points if p["front"]), key=lambda p: p["kl"])
    ring = {"color": "black", "marker": "o", "markersize": 12, "markerfacecolor": "none", "markeredgewidth": 1.2,
            "linewidth": 1, "linestyle": "--" if len(front) > 1 else "none"}  # a line only between two points or more
    axis.plot([p["kl"] for p in front], [p["reward"] for p in front], zorder=3, **ring)
    handles = [Line2D([], [], label="non-dominated", **ring)]
    handles += [Line2D([], [], linestyle="none", marker=MARKERS[i % len(MARKERS)], color=colours[i % len(colours)],
                       label=objective) for i, objective in enumerate(objectives)]
    axis.set_xlabel("KL(policy || reference) per sequence (eval/gen/kl)")
    axis.set_ylabel("reward of sampled completions (eval/gen/reward)")
    axis.set_title("reward against KL: each point a run's end (error bars: seeds), faint: its evaluations", fontsize=9)
    figure.legend(handles=handles, loc="outside right upper", fontsize=8)
    return figure


def plot_frontier(report, path: Path) -> bool:
    """The reward-KL frontier (``eval=generate``'s ``eval/gen/reward`` against ``eval/gen/kl``): a point per row at
    its end (seeds as error bars), one colour and one marker per objective, the non-dominated points ringed (and
    joined by a dashed line where there are two or more), each run's trajectory over its evaluations, faint; the
    legend beside the axes, over no point, each entry drawn as its mark. False (nothing written) when no run has
    both metrics."""
    figure = frontier_figure(report)
    if figure is None:
        return False
    _save(figure, path)
    return True
