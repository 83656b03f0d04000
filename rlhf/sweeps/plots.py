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


def plot_curves(report, metrics: Sequence[str], path: Path) -> list[str]:
    """One panel per metric name (``loss``, ``exact_match``...): its training curve solid and its held-out curve
    dashed, one colour per row (an aggregated row: the mean over its seeds with a band of one standard deviation),
    the legend from the values that differ. The loss panel only where the losses are one quantity
    (:func:`one_loss_scale`). Returns the panels' names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(metric.partition("/")[2] or metric for metric in metrics))
    if not one_loss_scale(report):
        names = [name for name in names if name != "loss"] or names
    columns = min(len(names), 3)
    grid = (math.ceil(len(names) / columns), columns)
    figure, axes = plt.subplots(*grid, figsize=(5.5 * grid[1], 3.2 * grid[0] + 0.3 * len(report.rows) + 0.5),
                                squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for panel, name in zip(axes.flat, names):
        for index, row in enumerate(report.rows):
            colour, labelled = colours[index % len(colours)], False
            for split, style in (("train", "-"), ("eval", "--")):
                histories = [run.history(f"{split}/{name}") for run in row.runs]
                curve = mean_curve(histories) if len(histories) > 1 else [(s, v, 0.0) for h in histories for s, v in h]
                if curve:
                    steps, means, spreads = zip(*curve)
                    panel.plot(steps, means, style, color=colour, marker="." if len(steps) < 30 else None,
                               label=None if labelled else label(row))
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
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return names


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
    ``objective`` (:func:`objective_name`), ``label`` (what varies within its objective), ``runs`` (the row's runs),
    ``trajectories`` (each run's (KL, reward) at every evaluation that has both) and ``front`` (whether no other
    point has at least its reward for at most its KL, one of them strictly)."""
    points = []
    for row in report.rows:
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
                       "label": "", "trajectories": trajectories, "values": row.values, "runs": row.runs})
    for point in points:
        siblings = [other["values"] for other in points if other["objective"] == point["objective"]]
        point["label"] = _point_label(point["values"], siblings)
    for point in points:
        del point["values"]
    for point in points:
        point["front"] = not any(
            other is not point and other["kl"] <= point["kl"] and other["reward"] >= point["reward"]
            and (other["kl"] < point["kl"] or other["reward"] > point["reward"]) for other in points)
    return points


def _point_label(values: dict[str, Any], siblings: list[dict[str, Any]]) -> str:
    """A frontier point's annotation: the values that differ between the rows of its objective (``beta=0.1``), not
    the objective itself (its colour says it) nor what is the same for all of its rows (its batch size)."""
    varying = [key for key in values if key != "algo" and len({repr(s.get(key)) for s in siblings}) > 1]
    return ", ".join(f"{key}={values[key]}" for key in varying if values[key] != "")


def _sd(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def plot_frontier(report, path: Path) -> bool:
    """The reward-KL frontier (``eval=generate``'s ``eval/gen/reward`` against ``eval/gen/kl``): a point per row at
    its end (seeds as error bars), one colour per objective, the non-dominated front as a line, and each run's
    trajectory over its evaluations, faint. False (nothing written) when no run has both metrics."""
    points = frontier_points(report)
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    objectives = list(dict.fromkeys(point["objective"] for point in points))
    figure, axis = plt.subplots(figsize=(7, 4.8), layout="constrained")
    for point in points:
        colour = colours[objectives.index(point["objective"]) % len(colours)]
        for trajectory in point["trajectories"]:
            axis.plot(*zip(*trajectory), "-", color=colour, alpha=0.25, linewidth=1)
        axis.errorbar(point["kl"], point["reward"], xerr=point["kl_sd"] or None, yerr=point["reward_sd"] or None,
                      fmt="o", color=colour, capsize=3, markersize=6)
        axis.annotate(point["label"], (point["kl"], point["reward"]), fontsize=6, xytext=(4, 3),
                      textcoords="offset points")
    front = sorted((p for p in points if p["front"]), key=lambda p: p["kl"])
    axis.plot([p["kl"] for p in front], [p["reward"] for p in front], "k--", linewidth=1, label="non-dominated")
    for index, objective in enumerate(objectives):
        axis.plot([], [], "o", color=colours[index % len(colours)], label=objective)
    axis.set_xlabel("KL(policy || reference) per sequence (eval/gen/kl)")
    axis.set_ylabel("reward of sampled completions (eval/gen/reward)")
    axis.set_title("reward against KL: each point a run's end (error bars: seeds), faint: its evaluations", fontsize=9)
    axis.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
