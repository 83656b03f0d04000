"""The select-then-confirm sweeper: a search scored on validation rows, each choice run again on the held-out rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlhf.core.errors import UserError
from rlhf.sweeps.points import FAILED
from rlhf.sweeps.search import Study, as_overrides, check_arguments, grid, search_space
from tests.conftest import FAST
from tests.test_train_cli import run


def test_a_grid_is_every_combination_in_hydras_order():
    assert grid("optimizer.lr=0.1,0.3 algo.beta=1,2") == [
        ["optimizer.lr=0.1", "algo.beta=1"], ["optimizer.lr=0.1", "algo.beta=2"],
        ["optimizer.lr=0.3", "algo.beta=1"], ["optimizer.lr=0.3", "algo.beta=2"]]
    assert grid(["seed=range(2)"]) == [["seed=0"], ["seed=1"]]
    assert grid(None) == grid("") == [[]]
    assert as_overrides({"data.evaluate_on": "held_out", "seed": "1,2"}) == ["data.evaluate_on=held_out", "seed=1,2"]


def test_a_search_space_per_compared_value_names_the_value_it_lacks():
    spaces = {"sgd": "optimizer.lr=0.1,0.3", "lion": "optimizer.lr=1e-5"}
    assert search_space(spaces, ["optimizer=sgd"]) == [["optimizer.lr=0.1"], ["optimizer.lr=0.3"]]
    assert search_space("optimizer.lr=1", ["optimizer=adamw"]) == [["optimizer.lr=1"]]  # one grid for every value
    with pytest.raises(UserError, match=r"no grid for 'adamw' \(it has sgd, lion\). Fix: add "
                                        r"hydra.sweeper.search.adamw"):
        search_space(spaces, ["optimizer=adamw"])


@pytest.mark.parametrize(("direction", "best"), [("minimize", "lr=0.3"), ("maximize", "lr=0.1")])
def test_the_choice_is_the_best_point_that_returned_a_number_and_confirm_seeds_replace_the_searched_seed(
        direction, best):
    study = Study.plan("optimizer=sgd,lion", "lr=0.1,0.3,1 seed=0", {"metric": "eval/loss", "direction": direction})
    assert [p.compared for p in study.search] == [["optimizer=sgd"]] * 3 + [["optimizer=lion"]] * 3
    for point, value in zip(study.search, [0.5, 0.2, None, None, None, None]):  # lion: every point failed
        point.value = value
    assert study.chosen(["optimizer=sgd"]).overrides == [best, "seed=0"]
    assert study.chosen(["optimizer=lion"]) is None
    confirm = study.plan_confirm(["data.evaluate_on=held_out", "seed=1,2"])
    assert [(p.compared, p.overrides) for p in confirm] == [
        (["optimizer=sgd"], [best, "data.evaluate_on=held_out", "seed=1"]),
        (["optimizer=sgd"], [best, "data.evaluate_on=held_out", "seed=2"])]
    for point, value in zip(confirm, [0.25, 0.35]):
        point.value = value
    summary = study.summary()["compared"]
    assert summary["optimizer=sgd"]["mean"] == pytest.approx(0.3) and summary["optimizer=sgd"]["std"] > 0
    assert summary["optimizer=lion"]["chosen"] is None and summary["optimizer=lion"]["confirm"] == []


def test_a_choice_on_the_edge_of_its_grid_is_warned_and_marked(caplog):
    """The lowest learning rate of three chosen: a warning and a mark in selection.md; a choice inside the grid, or a
    key that is not a number, is not (red when the edge is read from the whole search instead of the compared
    value's own grid: lion's 1e-5 is inside the union of both grids)."""
    from rlhf.sweeps.search import markdown

    study = Study.plan("optimizer=sgd,lion", {"sgd": "optimizer.lr=0.01,0.1,1 scheduler=cosine",
                                              "lion": "optimizer.lr=1e-6,1e-5,1e-4 scheduler=cosine"},
                       {"metric": "eval/loss", "direction": "minimize"})
    for point, value in zip(study.search, [0.2, 0.3, 0.4, 0.5, 0.1, 0.6]):  # sgd: its lowest; lion: its middle
        point.value = value
    assert study.on_edge(["optimizer=sgd"]) == ["optimizer.lr=0.01 (the lowest of 3)"]
    assert study.on_edge(["optimizer=lion"]) == []
    with caplog.at_level("WARNING", logger="rlhf.sweeps.search"):
        study.plan_confirm("seed=1")
    assert [r.getMessage() for r in caplog.records] == [
        "optimizer=sgd: the chosen optimizer.lr=0.01 (the lowest of 3) is on the edge of its grid: the best value "
        "may lie beyond it; widen the grid (hydra.sweeper.search) and search again"]
    table = markdown(study.summary())
    assert "optimizer.lr=0.01 scheduler=cosine — **on the grid's edge**: optimizer.lr=0.01 (the lowest of 3)" in table
    assert table.count("on the grid's edge") == 1


def final(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["final"]


def test_a_comparison_searches_on_validation_rows_and_confirms_the_choice_on_held_out_rows_over_seeds(tmp_path):
    """Two optimizers, two learning rates each (one refused: a failed point), then the choices over 2 seeds: the
    selection is read back against the runs' own summaries. ~15 s."""
    out = run("experiment=optimizer_comparison", *FAST, "data.validation_size=0.5", f"hydra.sweep.dir={tmp_path}",
              "hydra.sweeper.compare='optimizer=sgd,adamw'", "objective.metric=eval/loss",
              "objective.direction=minimize", "hydra.sweeper.search.sgd='optimizer.lr=0.05,-1'",
              "hydra.sweeper.search.adamw='optimizer.lr=1e-3,1e-2'", "hydra.sweeper.confirm_on.seed='1,2'")
    assert out.returncode == 1, out.stderr[-3000:]  # a point failed: the sweep finished, and says so
    assert out.stderr.strip().splitlines()[-1].startswith("1 of 8 points failed: 1_optimizer=sgd,optimizer.lr=-1: "
                                                          "optimizer.lr=-1 must be > 0")
    selection = json.loads((tmp_path / "selection.json").read_text())
    assert selection["objective"] == {"metric": "eval/loss", "direction": "minimize"}
    for group in selection["compared"].values():
        scored = [p for p in group["search"] if p["value"] is not None]
        for point in scored:  # what each job returned to Hydra is its run's final objective
            assert point["value"] == final(tmp_path / point["folder"])["eval/loss"]
            config = yaml.safe_load((tmp_path / point["folder"] / ".hydra" / "config.yaml").read_text())
            assert config["data"]["evaluate_on"] == "validation" and config["seed"] == 0
        assert group["chosen"] == min(scored, key=lambda p: p["value"])["overrides"]
        assert [p["overrides"][-1] for p in group["confirm"]] == ["seed=1", "seed=2"]
        for point in group["confirm"]:
            config = yaml.safe_load((tmp_path / point["folder"] / ".hydra" / "config.yaml").read_text())
            assert config["data"]["evaluate_on"] == "held_out" and config["optimizer"]["lr"] == float(
                group["chosen"][0].partition("=")[2])
            assert point["value"] == final(tmp_path / point["folder"])["eval/loss"]
        values = [p["value"] for p in group["confirm"]]
        assert group["mean"] == pytest.approx(sum(values) / 2)
    failed = selection["compared"]["optimizer=sgd"]["search"][1]
    assert failed["value"] is None and (tmp_path / failed["folder"] / FAILED).is_file()
    assert selection["compared"]["optimizer=sgd"]["chosen"] == ["optimizer.lr=0.05"]
    # the reports of both stages, and the objective against the searched learning rate
    assert {p.name for p in (tmp_path / "search").iterdir() if p.is_file()} == {
        "report.md", "report.csv", "report.png", "objective.png"}
    assert "2 seeds (1,2)" in (tmp_path / "confirm" / "report.md").read_text()
    assert "| optimizer=adamw | 2 (0) |" in (tmp_path / "selection.md").read_text()


def test_a_grid_on_the_command_line_is_refused_with_the_place_it_goes():
    check_arguments(["train.max_steps=3", "hydra.sweeper.search.sgd='optimizer.lr=1,2'"])  # quoted: one value
    with pytest.raises(UserError, match=r"^algo.beta=0.1,0.2 seed=range\(3\): this sweeper takes its grid from "
                                        r"hydra.sweeper.search, not from the command line. Fix: "):
        check_arguments(["algo.beta=0.1,0.2", "seed=range(3)", "train.max_steps=3"])
