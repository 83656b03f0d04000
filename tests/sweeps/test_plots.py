"""The report's figures (rlhf.sweeps.plots) read at a glance, checked on matplotlib's objects: a colour scale for a
searched number instead of a legend entry per trial, rounded legends outside the axes, identical curves that both
show, and no legend entry without its mark."""

from __future__ import annotations

import random
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from rlhf.sweeps import plots, report  # noqa: E402
from rlhf.sweeps.results import find  # noqa: E402
from tests.sweeps.test_report import _frontier_run  # noqa: E402

METRIC = "eval/exact_match"


def _report(rows: list[report.Row], metrics=(METRIC,)) -> report.Report:
    keys = list(rows[0].values)
    return report.Report(rows, keys, {key: key for key in keys}, list(metrics))


def _searched(values: dict, score: float, name: str = "") -> report.Row:
    return report.Row(name or str(values), values, report.FINISHED, {f"{METRIC} end": score}, [])


def _lines(axis) -> list:
    return [line for line in axis.get_lines() if len(line.get_xdata())]


def test_a_search_of_two_numbers_colours_its_trials_on_a_scale_with_no_legend_entry_per_trial():
    """Optuna's trials: learning rate and beta, 17-digit floats. Each panel colours its points by the other number,
    read on a colour bar; no legend at all (one series). Red with the colour scale removed (no colour bar)."""
    rng = random.Random(0)
    rows = [_searched({"lr": 10 ** rng.uniform(-6, -3), "beta": rng.uniform(0.05, 1.0), "seed": 0}, rng.random())
            for _ in range(12)]
    made = _report(rows)
    assert plots.searched_parameters(made) == (["lr", "beta"], [])
    figure = plots.objective_figure(made, METRIC)
    panels, bars = figure.axes[:2], figure.axes[2:]
    assert [bar.get_ylabel() for bar in bars] == ["beta (colour)", "lr (colour)"]
    assert not figure.legends and all(panel.get_legend() is None for panel in panels)
    for panel in panels:  # every trial a point, none joined (no two share the other number)
        assert sum(len(line.get_xdata()) for line in _lines(panel)) == 12
        assert {line.get_linestyle() for line in _lines(panel)} == {"None"}
    colour = {line.get_xdata()[0]: tuple(line.get_color()) for line in _lines(panels[0])}  # lr -> colour
    by_beta = sorted(rows, key=lambda row: row.values["beta"])  # the colour scale's ends: the lowest, highest beta
    viridis = plt.get_cmap("viridis")
    assert colour[by_beta[0].values["lr"]] == viridis(0.0) and colour[by_beta[-1].values["lr"]] == viridis(1.0)
    assert len(set(colour.values())) >= 10
    plt.close(figure)


def test_a_grid_per_optimizer_names_the_optimizers_below_the_panel_with_a_marker_each():
    """A learning-rate grid per optimizer, AdamW and Adam8bit scoring alike: one line per optimizer, each with its
    own marker and each thinner than the one before (Adam8bit's drawn over AdamW's leaves AdamW's showing); the
    legend below the axes (over no point), one entry per optimizer, the values rounded. Red with one marker for
    every line."""
    rows = [_searched({"optimizer": name, "lr": lr * 1.0000000000000002}, 0.6 + (lr in (0.01, 1e-4)) * 0.09, name)
            for name, grid in (("sgd", (0.003, 0.01, 0.03)), ("adamw", (3e-5, 1e-4, 3e-4)),
                               ("adam8bit", (3e-5, 1e-4, 3e-4))) for lr in grid]
    made = _report(rows)
    figure = plots.objective_figure(made, METRIC)
    (panel,) = figure.axes
    lines = _lines(panel)
    assert len(lines) == 3 and len({line.get_marker() for line in lines}) == 3
    assert lines[1].get_ydata().tolist() == lines[2].get_ydata().tolist()  # AdamW's and Adam8bit's: identical
    widths, sizes = [line.get_linewidth() for line in lines], [line.get_markersize() for line in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3 and sizes[1] > sizes[2]
    assert panel.get_legend() is None and len(figure.legends) == 1
    legend = figure.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["optimizer=sgd", "optimizer=adamw", "optimizer=adam8bit"]
    assert [h.get_marker() for h in legend.legend_handles] == [line.get_marker() for line in lines]
    plt.close(figure)


def _curve_run(losses: list[float]) -> SimpleNamespace:
    history = {"train/loss": list(enumerate(losses))}
    return SimpleNamespace(history=lambda metric: history.get(metric, []), choices={})


def test_identical_curves_both_show_and_the_legend_is_rounded():
    """AdamW and Adam8bit with the same 40-step loss curve: different markers, placed at different steps, the
    second line thinner; the legend says lr=0.000729, not its 17 digits. Red with one style for every row."""
    losses = [0.7 - 0.005 * step for step in range(40)]
    rows = [report.Row(name, {"optimizer": name, "lr": 0.0007294298980537985}, report.FINISHED, {},
                       [_curve_run(losses)]) for name in ("adamw", "adam8bit")]
    figure, names = plots.curves_figure(_report(rows, ["train/loss"]), ["train/loss"])
    assert names == ["loss"]
    first, second = _lines(figure.axes[0])
    assert first.get_ydata().tolist() == second.get_ydata().tolist()
    assert first.get_marker() != second.get_marker() and first.get_linewidth() > second.get_linewidth()
    assert first.get_markevery() != second.get_markevery()  # their markers at steps of their own
    assert 40 / first.get_markevery()[1] <= plots.MARKS_PER_LINE  # a marker every few steps, not at each of 40
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["optimizer=adamw, lr=0.000729",
                                                          "optimizer=adam8bit, lr=0.000729"]
    plt.close(figure)


@pytest.mark.parametrize("fronts", [1, 2])
def test_every_legend_entry_of_the_frontier_is_drawn_as_its_mark(tmp_path, fronts):
    """One non-dominated point (DPO beta=0.1 beats all): it is ringed, and its legend entry is the ring with no line
    (red with the front drawn as a dashed line alone: an entry with nothing to see); two: the ring and the line
    between them. Each objective's entry is its marker; the legend lies outside the axes."""
    points = [("dpo", 0.1, 1.0, 0.8), ("dpo", 0.3, 1.5, 0.7), ("ipo", 0.1, 2.0, 0.6 if fronts == 1 else 0.9)]
    for i, (objective, beta, kl, reward) in enumerate(points):
        _frontier_run(tmp_path / f"{i}_algo={objective}", objective, 1, [(0.0, 0.5), (kl, reward)],
                      f"  beta: {beta}\n")
    made = report.aggregate_seeds(report.build(find([tmp_path])))
    assert [row.name for row in made.rows] == ["1 seed (1)"] * 3
    figure = plots.frontier_figure(made)
    (axis,) = figure.axes
    assert axis.get_legend() is None and len(figure.legends) == 1
    legend = figure.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["non-dominated", "dpo", "ipo"]
    for handle in legend.legend_handles:
        assert handle.get_marker() not in ("None", "", None)
    ring = legend.legend_handles[0]
    assert ring.get_linestyle() == ("None" if fronts == 1 else "--") and ring.get_markerfacecolor() == "none"
    drawn = [line for line in _lines(axis) if line.get_markerfacecolor() == "none"]  # the rings on the axes
    assert len(drawn) == 1 and len(drawn[0].get_xdata()) == fronts
    assert drawn[0].get_linestyle() == ring.get_linestyle()
    markers = {legend.get_texts()[i].get_text(): h.get_marker() for i, h in enumerate(legend.legend_handles)}
    assert markers["dpo"] != markers["ipo"]
    plt.close(figure)
