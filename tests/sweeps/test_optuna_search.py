"""Hyperparameter search: Optuna's sweeper (the [search] extra, hydra/sweeper=search) through ``train.py -m``.

What the jobs return to Hydra is what Optuna ranks (checked against the trials' own metrics files), a failing trial
is recorded and the search finishes its others, a wrong objective is refused before any trial, and a command line
that selects the sweeper without the extra gets one message naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from rlhf.config import command_line
from rlhf.config.checks import check_config
from rlhf.sweeps.points import FAILED
from tests.conftest import CONF, FAST, compose_config
from tests.test_train_cli import run


def _search(tmp_path: Path, *overrides: str):
    """The trial folders' names leave out the fixed test settings too: "<n>_algo.beta=...,optimizer.lr=..." (and
    the objective, by conf/config.yaml: a metric's name holds a /)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        keys = list(compose("config", return_hydra_config=True).hydra.job.config.override_dirname.exclude_keys)
    short = f"hydra.job.config.override_dirname.exclude_keys=[{','.join(keys + [o.split('=')[0] for o in FAST])}]"
    return run("-m", "hydra/sweeper=search", *FAST, *overrides, f"hydra.sweep.dir={tmp_path}", short)


def _final(trial: Path, metric: str) -> float:
    """The last logged value of `metric` in a trial's own metrics.jsonl."""
    values = [line[metric] for line in map(json.loads, (trial / "metrics.jsonl").read_text().splitlines())
              if metric in line]
    return values[-1]


def test_the_search_ranks_what_the_trials_report(tmp_path):
    """Three seeded TPE trials maximizing eval/rewards/margins: Optuna's best value is the largest final value in
    the trials' metrics files (not the smallest: the direction comes from the objective). ~12 s."""
    out = _search(tmp_path, "hydra.sweeper.n_trials=3", "objective.metric=eval/rewards/margins",
                  "objective.direction=maximize", "optimizer.lr=tag(log, interval(1e-3, 1e-1))",
                  "algo.beta=interval(0.05, 0.5)")
    assert out.returncode == 0, out.stderr[-3000:]
    trials = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert len(trials) == 3, trials
    finals = {trial: _final(trial, "eval/rewards/margins") for trial in trials}
    assert len(set(finals.values())) == 3, finals  # the points differ, so that the ranking means something
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    best = max(finals, key=finals.get)
    assert results["best_value"] == finals[best]
    chosen = yaml.safe_load((best / ".hydra" / "overrides.yaml").read_text())
    assert {o.split("=")[0]: float(o.split("=")[1]) for o in chosen if o.startswith(("algo.beta", "optimizer.lr"))} \
        == results["best_params"]
    assert out.stderr.strip().splitlines()[-1] == "all 3 points finished"


def test_failing_trials_are_recorded_and_the_search_finishes_the_others(tmp_path):
    """beta in {0.1, -1}: a trial with beta=-1 stops with a UserError (beta must be > 0), recorded in its
    failed.json; the search goes on, the finished trial is Optuna's best; exit 1 and the closing line count the
    failed ones. The seeded sampler (seed=0, optuna pinned in constraints.txt) draws -1, 0.1, -1. ~9 s."""
    out = _search(tmp_path, "hydra.sweeper.n_trials=3", "algo.beta=choice(0.1, -1.0)")
    assert out.returncode == 1, out.stderr[-3000:]
    failed = sorted(tmp_path.glob("*_algo.beta=-1.0"))
    finished = sorted(tmp_path.glob("*_algo.beta=0.1"))
    assert [p.name[0] for p in failed] == ["0", "2"] and [p.name[0] for p in finished] == ["1"], (failed, finished)
    for folder in failed:
        record = json.loads((folder / FAILED).read_text())
        assert record["error"] == "UserError" and "algo.beta=-1.0 must be > 0" in record["message"], record
    assert (finished[0] / "summary.json").is_file() and not (finished[0] / FAILED).exists()
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"algo.beta": 0.1}
    assert results["best_value"] == _final(finished[0], "eval/loss")
    closing = out.stderr.strip().splitlines()[-1]
    assert closing.startswith(f"2 of 3 points failed: {failed[0].name}: algo.beta=-1.0 must be > 0"), closing


def test_an_objective_the_runs_do_not_report_is_refused_before_any_trial(tmp_path):
    """~4 s."""
    sweep = tmp_path / "sweep"
    out = run("-m", "hydra/sweeper=search", "objective.metric=eval/accuracy", "objective.direction=maximize",
              "optimizer.lr=tag(log, interval(1e-4, 1e-2))", *FAST, f"hydra.sweep.dir={sweep}")
    assert out.returncode == 1
    assert "error: objective.metric=eval/accuracy: runs of rlhf.algos.dpo.DPO do not report it" in out.stderr
    assert "Fix: objective.metric=eval/rewards/accuracies" in out.stderr
    assert not sweep.exists()


def test_the_preset_searches_lr_and_beta_for_the_objective_with_a_seeded_sampler():
    """experiment=dpo_search composes with the project's sweeper: the direction and the sampler's seed are the
    run's own, its space is lr x beta, and its objective is one DPO reports."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=dpo_search", "seed=7"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert (sweeper.direction, sweeper.sampler.seed) == ("maximize", 7) == (cfg.objective.direction, cfg.seed)
    assert sweeper.max_failure_rate == 1.0
    assert set(sweeper.params) == {"optimizer.lr", "algo.beta"} and sweeper.params["optimizer.lr"].startswith("tag(log")
    check_config(compose_config("experiment=dpo_search", output_dir=Path("/tmp/unused")))  # the objective is DPO's


@pytest.mark.parametrize("argv", [["-m", "hydra/sweeper=search"], ["-m", "hydra/sweeper=optuna"],
                                  ["-m", "experiment=dpo_search"], ["-m", "experiment=dpo_rpo,dpo_search"]])
def test_a_search_without_the_extra_names_the_fix(argv, monkeypatch, capsys):
    """Without hydra-optuna-sweeper, Hydra would say only that it cannot find hydra/sweeper/optuna."""
    assert command_line.missing_extra(argv) is None  # installed here (scripts/setup.sh)
    monkeypatch.setitem(command_line.EXTRA_SWEEPERS, "optuna", ("hydra_plugins.not_installed_sweeper", "search"))
    with pytest.raises(SystemExit) as stop:
        command_line.check_overrides(argv)
    assert stop.value.code == 1
    assert 'optional extra [search], not installed here. Fix: pip install -e ".[search]"' in capsys.readouterr().err
    assert command_line.missing_extra(["-m", "experiment=dpo_search", "hydra/sweeper=basic"]) is None
    assert command_line.missing_extra(["-m", "experiment=dpo_rpo", "optimizer=sgd,lion"]) is None
