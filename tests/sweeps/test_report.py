"""The comparison report (rlhf.sweeps.report, scripts/compare_runs.py) of a real sweep: two optimizers x two seeds of a
few steps (one interpreter, about 12 s), plus a crashed and a still-running run folder made by hand."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf.sweeps import report
from rlhf.sweeps.results import find
from tests.conftest import FAST, ROOT
from tests.sweeps.test_results import script

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """outputs of ``train.py -m optimizer=sgd,lion seed=0,1`` (held-out metrics at steps 0, 2 and 3), and beside
    its jobs ``crashed`` (SGD, seed 2: two logged lines, an error in train.log, nothing written for an hour) and
    ``running`` (SGD at another learning rate: metrics.jsonl just written, no summary)."""
    folder = tmp_path_factory.mktemp("sweep")
    overrides = [o for o in FAST if not o.startswith("train.eval_every_steps")]
    command = [sys.executable, "train.py", "-m", *overrides, "train.eval_every_steps=2", "optimizer=sgd,lion",
               "seed=0,1", f"hydra.sweep.dir={folder}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sgd = next(run.path for run in find([folder]) if run.config["optimizer"]["_target_"] == "torch.optim.SGD")
    for name, change, lines in (("crashed", {"seed": 2}, 2), ("running", {"optimizer": {"lr": 0.01}}, 3)):
        fake = folder / name
        shutil.copytree(sgd / ".hydra", fake / ".hydra")
        config = yaml.safe_load((fake / ".hydra" / "config.yaml").read_text())
        for key, value in change.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        (fake / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        (fake / "metrics.jsonl").write_text("".join((sgd / "metrics.jsonl").read_text().splitlines(True)[:lines]))
    (folder / "crashed" / "train.log").write_text(
        "[2026-01-01 10:00:00,000][rlhf.run.components][INFO] - run dir: x\n"
        "[2026-01-01 10:00:07,500][rlhf][ERROR] - error: out of memory | try a smaller batch\n")
    shutil.copytree(folder / "crashed", folder / "crashed_now")  # written just now, but its log has an error
    shutil.rmtree(folder / "crashed_now" / ".hydra")  # and no config: it makes no value differ
    an_hour_ago = time.time() - 3600
    os.utime(folder / "crashed" / "metrics.jsonl", (an_hour_ago, an_hour_ago))
    return folder


def lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_each_row_holds_the_runs_own_metrics_and_the_values_that_differ(sweep):
    made = report.build(find([sweep]))
    assert made.metrics == ["eval/loss", "eval/exact_match", "eval/rewards/accuracies"]  # DPO's, found in the files
    # the option as chosen (Hydra's record) in place of its class, then the parameters that differ in config.yaml
    assert made.value_columns[:3] == ["optimizer", "seed", "lr"] and made.value_columns.count("optimizer") == 1
    # SGD's and Lion's own options (momentum, betas), the same in every run of the option: the option names them
    assert "momentum" not in made.value_columns and "betas" not in made.value_columns
    rows = {row.name: row for row in made.rows}
    assert list(rows) == ["0", "1", "2", "3", "crashed", "crashed_now", "running"]
    assert rows.pop("crashed_now").status == "crashed"
    assert [rows[n].values["optimizer"] for n in "0123"] == ["sgd", "sgd", "lion", "lion"]
    assert [rows[n].values["seed"] for n in "0123"] == [0, 1, 0, 1] and rows["crashed"].values["seed"] == 2
    assert rows["running"].values["lr"] == 0.01
    for run in find([sweep])[:4]:
        row, logged = rows[run.path.name.partition("_")[0]], lines(run.path)
        assert row.status == "finished" and row.note == ""
        for metric in made.metrics:
            history = [(line["step"], line[metric]) for line in logged if metric in line]
            assert [step for step, _ in history] == [0, 2, 3]
            best = (min if metric == "eval/loss" else max)(history, key=lambda point: point[1])
            assert [row.figures[c] for c in report.metric_columns(metric)] == [
                history[0][1], history[-1][1], best[1], best[0]]
        assert row.figures["train/loss end"] == [line["train/loss"] for line in logged if "train/loss" in line][-1]
        assert row.figures["tokens/s"] == statistics.fmean(line["perf/tokens_per_s"] for line in logged
                                                           if "perf/tokens_per_s" in line)
        summary = json.loads((run.path / "summary.json").read_text())
        assert row.figures["peak MB"] == max(summary["final"]["perf/peak_mem_mb"],
                                             *(line.get("perf/peak_mem_mb", 0) for line in logged))
        assert row.figures["optimizer state MB"] == summary["memory_held_mb"]["optimizer_state"] > 0
        assert 0 < row.figures["wall s"] < 60
    crashed, running = rows["crashed"], rows["running"]
    assert crashed.status == "crashed" and crashed.note == "error: out of memory | try a smaller batch"
    first = lines(find([sweep])[0].path)  # the crashed run logged the first two lines of job 0 (SGD, seed 0)
    assert crashed.figures["wall s"] == 7.5 and crashed.figures["tokens/s"] == first[1]["perf/tokens_per_s"]
    assert crashed.figures["eval/loss @0"] == crashed.figures["eval/loss end"] == first[0]["eval/loss"]
    assert running.status == "running" and running.figures["eval/loss best step"] == 0


def test_report_files_and_seed_aggregation(sweep, tmp_path, monkeypatch, capsys):
    runs = find([sweep])
    made = report.build(runs)
    md, table_csv, png = report.write(made, tmp_path / "each")
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000
    header, *rows = list(csv.reader(table_csv.open()))
    assert header[:4] == ["run", "optimizer", "seed", "lr"] and header[-2:] == ["status", "note"]
    assert [row[0] for row in rows] == ["0", "1", "2", "3", "crashed", "crashed_now", "running"]
    column = header.index("eval/loss end")
    assert [float(row[column]) for row in rows[:4]] == [run.last("eval/loss") for run in runs[:4]]  # exact
    notes, _, text = md.read_text().rpartition("\n\n")  # a note on the load the runs ran beside, if it differed
    assert all(line.startswith("> ") for line in notes.splitlines() if line)
    assert text.startswith("| run | optimizer | seed | lr |") and "| --- |" in text
    assert "out of memory \\| try a smaller batch |\n" in text and text.count("\n") == 2 + len(rows)

    folded = report.aggregate_seeds(made)
    assert [row.values["optimizer"] for row in folded.rows] == ["sgd", "lion", "", "sgd"]  # "": no config
    assert "seed" not in folded.value_columns
    sgd, lion, no_config, running = folded.rows
    assert (sgd.name, sgd.status, lion.status, no_config.status, running.status) == (
        "3 seeds (0,1,2)", "2 finished, 1 crashed", "2 finished", "1 crashed", "1 running")
    for row, members in ((sgd, runs[:2]), (lion, runs[2:4])):  # the crashed run does not count in the mean
        ends = [run.last("eval/rewards/accuracies") for run in members]
        assert row.figures["eval/rewards/accuracies end"] == statistics.fmean(ends)
        assert math.isclose(row.spread["eval/rewards/accuracies end"], statistics.stdev(ends))
    assert "eval/loss best step" not in running.spread
    for row, members in ((sgd, runs[:2]), (lion, runs[2:4])):  # best and its step: of the seeds' mean curve
        curves = [dict(run.history("eval/loss")) for run in members]
        steps = sorted(set(curves[0]) & set(curves[1]))
        step = min(steps, key=lambda s: curves[0][s] + curves[1][s])
        assert row.figures["eval/loss best step"] == step and "eval/loss best step" not in row.spread
        assert math.isclose(row.figures["eval/loss best"], (curves[0][step] + curves[1][step]) / 2)
    out = tmp_path / "seeds"
    code, printed, err = script("compare_runs", sweep, "--seeds", "--out", out, "--metrics", "eval/loss", "--plot",
                                "train/loss", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and f"wrote {out}/report.md" in err and " ± " in printed
    header, *rows = list(csv.reader((out / "report.csv").open()))
    first = header.index("eval/loss @0")
    assert header[:3] == ["run", "optimizer", "lr"] and header[first:first + 3] == [
        "eval/loss @0", "eval/loss @0 std", "eval/loss end"] and "eval/exact_match end" not in header
    assert len(rows) == 4 and (out / "report.png").read_bytes().startswith(PNG)
    code, _, _ = script("compare_runs", *(run.path for run in runs[2:4]), "--csv", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and (sweep / "report.png").is_file()  # the folder that holds the runs given


def test_short_names_and_flattening():
    assert report.short_names(["optimizer.lr", "seed", "data.seed", "algo.loss.beta"]) == {
        "optimizer.lr": "lr", "seed": "seed", "data.seed": "data.seed", "algo.loss.beta": "beta"}
    assert report.flatten({"optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 1.0,
                                         "betas": [0.9, 0.99]}}) == {
        "optimizer": "SGD", "optimizer.lr": 1.0, "optimizer.betas": "[0.9, 0.99]"}
    assert report.differing([{"a": 1, "b": {"c": 2}, "output_dir": "x"}, {"a": 1, "b": {"c": 3}, "output_dir": "y"},
                             {"a": 1, "b": {"c": 2}, "d": 0}, {}]) == ["b.c", "d"]


def test_job_numbers_name_the_rows_unless_they_repeat(tmp_path):
    from tests.sweeps.test_results import make_run

    runs = find([make_run(tmp_path / "a" / "0_x=1"), make_run(tmp_path / "a" / "1_x=2")])
    assert [row.name for row in report.build(runs).rows] == ["0", "1"]
    runs = find([make_run(tmp_path / "b" / "0_x=1"), tmp_path / "a"])
    assert [row.name for row in report.build(runs).rows] == ["0_x=1", "0_x=1", "1_x=2"]


def test_a_failed_sweep_point_is_crashed_with_the_reason_it_recorded(tmp_path):
    from rlhf.sweeps.points import FAILED
    from rlhf.sweeps.results import Run

    run = tmp_path / "0_algo.beta=5"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/loss": 0.69}\n')  # written just now: not stale
    (run / "train.log").write_text("")
    (run / FAILED).write_text(json.dumps({"error": "NonFinite", "message": "step 3: the loss is nan"}))
    lines = report.log_lines(Run(run))
    assert report.status(Run(run), lines) == "crashed"
    assert report.why(lines, run) == "NonFinite: step 3: the loss is nan"


def test_the_searched_parameters_are_the_numbers_that_vary_among_runs_alike_in_everything_else(tmp_path):
    """``lr`` is searched within each optimizer; ``weight_decay`` only follows the optimizer; ``seed`` is never an
    axis; the series are named by the optimizer alone. The objective's figure is written from them."""
    def row(optimizer, lr, weight_decay, seed, value):
        values = {"optimizer": optimizer, "lr": lr, "weight_decay": weight_decay, "seed": seed}
        return report.Row(f"{optimizer}{lr}{seed}", values, report.FINISHED, {"eval/exact_match end": value}, [])

    rows = [row("SGD", lr, 0.0, seed, lr) for lr in (0.01, 0.1) for seed in (0, 1)]
    rows += [row("Lion", lr, 0.1, 0, lr * 100) for lr in (1e-5, 1e-4)]
    keys = ["optimizer._target_", "optimizer.lr", "optimizer.weight_decay", "seed"]
    made = report.Report(rows, keys, dict(zip(keys, ["optimizer", "lr", "weight_decay", "seed"])),
                         ["eval/exact_match"])
    assert report.searched_parameters(made) == (["lr"], ["optimizer"])
    written = report.write(made, tmp_path, plot_metrics=["eval/exact_match"], objective="eval/exact_match")
    assert (tmp_path / "objective.png") in written and (tmp_path / "objective.png").stat().st_size > 10_000
    one_lr = report.Report([r for r in rows if r.values["lr"] in (0.01, 1e-5)], keys, made.names, made.metrics)
    assert report.searched_parameters(one_lr)[0] == []  # nothing searched: no objective figure
    assert not report.plot_objective(one_lr, "eval/exact_match", tmp_path / "none.png")


def test_the_objective_of_runs_is_read_resolved_from_their_saved_config():
    """.hydra/config.yaml keeps the default objective as an interpolation (the algorithm's); the report resolves it
    (a raw "${...}" taken for a metric's name broke the plot's title)."""
    from types import SimpleNamespace

    default = {"metric": "${rlhf.objective:${oc.select:algo._target_,null},metric}"}
    dpo = SimpleNamespace(config={"algo": {"_target_": "rlhf.algos.dpo.DPO"}, "objective": default})
    named = SimpleNamespace(config={"algo": {"_target_": "rlhf.algos.dpo.DPO"},
                                    "objective": {"metric": "eval/exact_match"}})
    assert report.objective_of([dpo, dpo]) == "eval/loss"
    assert report.objective_of([named]) == "eval/exact_match"
    assert report.objective_of([dpo, named]) is None  # runs that optimized different things


def _frontier_run(folder, objective: str, seed: int, trajectory: list[tuple[float, float]], algo_keys: str = ""):
    """A finished run of ``objective`` whose evaluations logged (KL, reward) pairs at steps 0, 10, 20...;
    ``algo_keys``: more YAML lines under ``algo``."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(f"algo:\n  _target_: rlhf.algos.dpo.DPO\n  loss: {objective}\n"
                                                   f"{algo_keys}seed: {seed}\n")
    (folder / ".hydra" / "overrides.yaml").write_text(f"- algo={objective}\n- seed={seed}\n")
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {
        "algo": objective, "algo/loss": objective, "optimizer": "adamw", "hydra/sweeper": "basic"}}}}))
    lines = [{"step": 10 * i, "eval/gen/kl": kl, "eval/gen/reward": reward} for i, (kl, reward) in enumerate(trajectory)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({"final": lines[-1], "seed": seed}))
    return folder


def test_the_frontier_is_the_runs_own_final_points_with_the_dominated_ones_marked(tmp_path):
    """frontier.png from the runs' own files: each row's point is its runs' last (KL, reward), seeds as means with
    a standard deviation, the objective as chosen (algo=ipo), and a point that another beats on both axes off the
    front."""
    from rlhf.sweeps import plots
    from rlhf.sweeps.report import aggregate_seeds, build, write
    from rlhf.sweeps.results import find

    _frontier_run(tmp_path / "0_algo=dpo,seed=0", "dpo", 0, [(0.0, 0.5), (1.0, 0.7), (2.0, 0.8)])
    _frontier_run(tmp_path / "1_algo=dpo,seed=1", "dpo", 1, [(0.0, 0.5), (1.5, 0.72), (2.2, 0.84)])
    _frontier_run(tmp_path / "2_algo=ipo,seed=0", "ipo", 0, [(0.0, 0.5), (3.0, 0.75)])  # more KL, less reward
    _frontier_run(tmp_path / "3_algo=ipo,seed=1", "ipo", 1, [(0.0, 0.5), (3.2, 0.77)])
    runs = find([tmp_path])
    each = build(runs)  # the option as chosen (algo=ipo), not what it expands to (algo.loss: ipo under DPO)
    assert each.value_columns == ["algo", "seed"] and [r.values["algo"] for r in each.rows] == ["dpo"] * 2 + ["ipo"] * 2
    # losses of two objectives are not one quantity: no loss panel; one objective's runs keep it
    assert plots.plot_curves(each, ["train/loss", "eval/gen/reward"], tmp_path / "mixed.png") == ["gen/reward"]
    assert plots.plot_curves(build(runs[:2]), ["train/loss", "eval/gen/reward"], tmp_path / "dpo.png") == [
        "loss", "gen/reward"]
    report = aggregate_seeds(each)
    points = {p["objective"]: p for p in plots.frontier_points(report)}
    assert set(points) == {"dpo", "ipo"}
    assert points["dpo"]["kl"] == pytest.approx(2.1) and points["dpo"]["reward"] == pytest.approx(0.82)
    assert points["dpo"]["kl_sd"] == pytest.approx(0.1414213562) and points["dpo"]["reward_sd"] == pytest.approx(
        0.0282842712)
    assert points["dpo"]["front"] and not points["ipo"]["front"]
    assert sorted(len(t) for t in points["dpo"]["trajectories"]) == [3, 3]
    assert "eval/gen/kl" in report.metrics and "eval/gen/reward" in report.metrics  # the table's columns
    written = write(report, tmp_path / "report")
    assert tmp_path / "report" / "frontier.png" in written and (tmp_path / "report" / "frontier.png").stat().st_size
    assert not (tmp_path / "plain").exists() and plots.plot_frontier(build([]), tmp_path / "plain.png") is False


def test_objectives_over_their_strengths_show_the_option_and_the_strength_alone(tmp_path):
    """DPO at two betas beside GRPO at two: the columns are the chosen option and beta (what varies within an
    option), not the keys one option has and the other lacks (num_generations) nor an option's own defaults
    (label_smoothing); the frontier's annotations say the strength alone (the colour says the objective). Red with
    every parameter kept as a column."""
    from rlhf.sweeps import plots
    from rlhf.sweeps.report import aggregate_seeds, build
    from rlhf.sweeps.results import find

    for i, (objective, beta, extra) in enumerate([("dpo", 0.1, "  label_smoothing: 0.0\n"),
                                                  ("dpo", 0.3, "  label_smoothing: 0.0\n"),
                                                  ("grpo", 0.0, "  num_generations: 8\n"),
                                                  ("grpo", 0.2, "  num_generations: 8\n")]):
        _frontier_run(tmp_path / f"{i}_algo={objective},algo.beta={beta}", objective, 1,
                      [(0.0, 0.5), (1.0 + i, 0.6 + i / 10)], f"  beta: {beta}\n{extra}")
    report = aggregate_seeds(build(find([tmp_path])))
    assert report.value_columns == ["algo", "beta"]
    assert sorted(p["label"] for p in plots.frontier_points(report)) == ["beta=0", "beta=0.1", "beta=0.2",
                                                                         "beta=0.3"]


def test_a_folded_row_is_named_by_its_runs_own_seeds(tmp_path):
    """The seeds come from each run's config, whether or not ``seed`` is a column: one seed shared by all runs (not
    a column) is ``1 seed (1)``, not ``1 seeds (?)`` (red with the seeds read from the columns); two runs of one
    seed count as runs; a run that does not say its seed is counted as a run."""
    from rlhf.sweeps.report import aggregate_seeds, build, seeds_name

    for i, beta in enumerate([0.1, 0.3, 0.3]):
        _frontier_run(tmp_path / f"{i}_algo.beta={beta}", "dpo", 1, [(0.0, 0.5), (1.0, 0.6)], f"  beta: {beta}\n")
    runs = find([tmp_path])
    assert [row.name for row in aggregate_seeds(build(runs)).rows] == ["1 seed (1)", "2 runs, 1 seed (1)"]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metrics.jsonl").write_text("")
    assert seeds_name(find([tmp_path / "bare"])) == "1 run (seed unknown)"


def test_a_value_set_on_the_command_line_stays_a_column_though_one_option_has_one(tmp_path):
    """A confirm stage: each optimizer at the one learning rate its search chose, SGD with a momentum the user set.
    SGD's momentum is one value in the one option that has it, yet it was the user's (on the command line): it
    stays a column (red without the command-line rule)."""
    from rlhf.sweeps.report import build
    from rlhf.sweeps.results import find

    for i, (name, lr) in enumerate([("sgd", 0.05), ("sgd", 0.05), ("adamw", 0.001), ("adamw", 0.001)]):
        folder = tmp_path / f"{i}_optimizer={name}"
        (folder / ".hydra").mkdir(parents=True)
        momentum = "  momentum: 0.5\n" if name == "sgd" else ""  # SGD's own key, set by the user
        (folder / ".hydra" / "config.yaml").write_text(
            f"optimizer:\n  _target_: torch.optim.{name.upper()}\n  lr: {lr}\n{momentum}seed: {i % 2}\n")
        extra = "- optimizer.momentum=0.5\n" if name == "sgd" else ""
        (folder / ".hydra" / "overrides.yaml").write_text(
            f"- optimizer={name}\n- optimizer.lr={lr}\n{extra}- seed={i % 2}\n")
        (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {
            "optimizer": name}}}}))
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/loss": 0.5}) + "\n")
        (folder / "summary.json").write_text(json.dumps({"final": {"step": 1, "eval/loss": 0.5}}))
    assert build(find([tmp_path])).value_columns == ["optimizer", "lr", "momentum", "seed"]
