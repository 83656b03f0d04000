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
        "may lie beyond it; widen the grid (hydra.sweeper.search, or once by itself: hydra.sweeper.widen_edges=true) "
        "and search again"]
    table = markdown(study.summary())
    assert "optimizer.lr=0.01 scheduler=cosine — **on the grid's edge**: optimizer.lr=0.01 (the lowest of 3)" in table
    assert table.count("on the grid's edge") == 1


def test_widening_adds_one_point_beyond_each_chosen_edge_by_the_grids_own_step(caplog):
    """sgd chose its lowest learning rate (0.01 of 0.01, 0.1, 1): one more point at 0.001 (×0.1, the grid's step),
    the other overrides kept; lion chose inside its learning rates: nothing added there, but its beta=0 (the lowest
    of 0, 0.5) is not widened across 0 (said in the log); a grid of counts widens to a count (3 of 3, 4: 2, not
    2.25). Red when the step is taken from the far end of the grid, when an inside choice is widened, or when 0 is
    stepped across."""
    study = Study.plan("optimizer=sgd,lion,adamw", {"sgd": "optimizer.lr=0.01,0.1,1 scheduler=cosine",
                                                    "lion": "optimizer.lr=1e-6,1e-5,1e-4 algo.beta=0,0.5",
                                                    "adamw": "algo.num_generations=3,4"},
                       {"metric": "eval/loss", "direction": "minimize"})
    for point, value in zip(study.search, [0.2, 0.3, 0.4, 0.5, 0.6, 0.1, 0.7, 0.8, 0.9, 0.3, 0.4]):
        point.value = value  # lion: 1e-5 (inside), beta=0 (the lowest of 0, 0.5); adamw: 3 (the lowest)
    with caplog.at_level("WARNING", logger="rlhf.sweeps.search"):
        added = study.widen()
    assert [(p.compared, p.overrides) for p in added] == [
        (["optimizer=sgd"], ["optimizer.lr=0.001", "scheduler=cosine"]),
        (["optimizer=adamw"], ["algo.num_generations=2"])]
    assert "algo.beta=0 (the lowest of 2) is on the edge of its grid next to 0 or a point already tried; not widened" \
        in caplog.text
    assert study.search[-2:] == added and study.widened == added
    added[0].value = 0.05  # the widened point wins: it is the choice now, and still on the (new) edge
    assert study.chosen(["optimizer=sgd"]).overrides == ["optimizer.lr=0.001", "scheduler=cosine"]
    assert study.on_edge(["optimizer=sgd"]) == ["optimizer.lr=0.001 (the lowest of 4)"]
    summary = study.summary()["compared"]["optimizer=sgd"]
    assert summary["widened"] == [["optimizer.lr=0.001", "scheduler=cosine"]]
    added[1].value = None  # a widened point that failed is no part of the grid's edges
    assert study.on_edge(["optimizer=adamw"]) == ["algo.num_generations=3 (the lowest of 2)"]


def test_widening_reads_the_points_that_returned_and_keeps_a_whole_number_grid_off_0():
    """A failed lowest point is no edge, and is not searched again; beta=1,2 with 1 chosen widens to 0.5, not to a
    rounded 0 (red when failed points count, or whole numbers are always rounded)."""
    study = Study.plan("optimizer=sgd,lion", {"sgd": "optimizer.lr=0.001,0.01,0.1", "lion": "algo.beta=1,2"},
                       {"metric": "eval/loss", "direction": "minimize"})
    for point, value in zip(study.search, [None, 0.2, 0.3, 0.1, 0.4]):  # sgd: 0.001 failed, 0.01 chosen
        point.value = value
    assert [(p.compared, p.overrides) for p in study.widen()] == [(["optimizer=lion"], ["algo.beta=0.5"])]


def test_confirm_every_runs_each_grid_point_over_the_seeds_and_reports_each_point():
    """confirm=every: no choice; each point of each compared value's grid over the confirm seeds, and selection.md
    one row per point with its mean over the seeds that returned a number (red if only a choice is confirmed)."""
    from rlhf.sweeps.search import markdown

    study = Study.plan("algo=dpo,grpo", {"dpo": "algo.beta=0.1,0.3", "grpo": "algo.beta=0"},
                       {"metric": "eval/gen/reward", "direction": "maximize"}, confirm="every")
    confirm = study.plan_confirm(["data.evaluate_on=held_out", "seed=1,2"])
    assert [(p.compared, p.overrides) for p in confirm] == [
        (["algo=dpo"], ["algo.beta=0.1", "data.evaluate_on=held_out", "seed=1"]),
        (["algo=dpo"], ["algo.beta=0.1", "data.evaluate_on=held_out", "seed=2"]),
        (["algo=dpo"], ["algo.beta=0.3", "data.evaluate_on=held_out", "seed=1"]),
        (["algo=dpo"], ["algo.beta=0.3", "data.evaluate_on=held_out", "seed=2"]),
        (["algo=grpo"], ["algo.beta=0", "data.evaluate_on=held_out", "seed=1"]),
        (["algo=grpo"], ["algo.beta=0", "data.evaluate_on=held_out", "seed=2"])]
    for point, value in zip(confirm, [0.5, 0.7, 0.2, 0.2, 0.9, None]):
        point.value = value
    summary = study.summary()
    assert summary["confirm"] == "every" and summary["compared"]["algo=dpo"]["chosen"] is None
    points = summary["compared"]["algo=dpo"]["points"]
    assert [p["overrides"] for p in points] == [["algo.beta=0.1"], ["algo.beta=0.3"]]
    assert points[0]["mean"] == pytest.approx(0.6) and points[1]["std"] == 0.0
    table = markdown(summary)
    assert "| algo=dpo | algo.beta=0.1 | 0.6 ± 0.14 (2 of 2) |" in table
    assert "| algo=grpo | algo.beta=0 | 0.9 (1 of 2) |" in table
    with pytest.raises(UserError, match="hydra.sweeper.confirm='all' is not one of chosen, every"):
        Study.plan("algo=dpo", "algo.beta=1", {"metric": "m", "direction": "maximize"}, confirm="all")


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


@pytest.mark.slow
@pytest.mark.serial  # submitit starts its jobs' processes, two at a time
def test_the_objective_frontier_preset_runs_end_to_end_and_its_figure_is_the_runs_own(tmp_path):
    """experiment=objective_frontier cut to two objectives at one strength each, one seed (~30 s): every grid point
    runs on the held-out rows with eval=generate, selection.json holds each point's final sampled reward, and the
    frontier's points are the runs' own final (KL, reward)."""
    from rlhf.sweeps import plots
    from rlhf.sweeps.report import aggregate_seeds, build
    from rlhf.sweeps.results import find

    out = run("experiment=objective_frontier", *FAST, "train.max_steps=2", "train.eval_every_steps=1",
              "eval.prompts=4", "hydra.sweeper.compare='algo=dpo,grpo'",
              "hydra.sweeper.search.dpo='algo.beta=0.1'",
              "hydra.sweeper.search.grpo='algo.beta=0 algo/reward_funcs=similarity train.per_device_batch_size=4'",
              "hydra.sweeper.confirm_on.seed='1'", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    selection = json.loads((tmp_path / "selection.json").read_text())
    assert selection["confirm"] == "every" and set(selection["compared"]) == {"algo=dpo", "algo=grpo"}
    assert not (tmp_path / "search").exists()  # nothing is chosen: no search ran
    for group in selection["compared"].values():
        (point,) = group["confirm"]
        config = yaml.safe_load((tmp_path / point["folder"] / ".hydra" / "config.yaml").read_text())
        assert config["data"]["evaluate_on"] == "held_out" and config["seed"] == 1
        assert config["eval"]["_target_"] == "rlhf.evaluation.generated.GenerationEval"
        assert group["points"][0]["mean"] == point["value"] == final(tmp_path / point["folder"])["eval/gen/reward"]
    runs = find([tmp_path / "confirm"])
    points = {p["objective"]: p for p in plots.frontier_points(aggregate_seeds(build(runs)))}
    assert set(points) == {"dpo", "grpo"}
    for run_ in runs:
        point = points[run_.override_values["algo"]]
        assert (point["kl"], point["reward"]) == (run_.final["eval/gen/kl"], run_.final["eval/gen/reward"])
    assert (tmp_path / "confirm" / "frontier.png").stat().st_size > 10_000
