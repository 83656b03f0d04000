"""The optimizer benchmark's plan: search spaces, equal trial budgets, quasi-random points, choices and their edges."""

from __future__ import annotations

import math

import pytest

from rlhf.core.errors import UserError
from rlhf.sweeps.bench.plan import SELF_TUNING, TUNED, Bench, Dimension

LR = {"low": 1e-5, "high": 1e-2, "scale": "log"}


def config(**changes):
    base = {
        "workloads": {"sft": {"overrides": ["algo=sft"], "max_steps": 40, "eval_every_steps": 5,
                              "metric": "eval/exact_match", "direction": "maximize"},
                      "grpo": {"overrides": "algo=grpo", "max_steps": 20, "metric": "eval/reward",
                               "direction": "maximize", "target": 0.8}},
        "optimizers": {
            "adamw": {"space": {"optimizer.lr": LR}},  # one searched key
            "muon": {"space": {"optimizer.lr": LR, "optimizer.adamw.lr": LR,  # five
                               "optimizer.momentum": {"low": 0.8, "high": 0.98, "scale": "log1m"},
                               "optimizer.weight_decay": {"low": 0.0, "high": 0.1},
                               "scheduler.num_warmup_steps": {"low": 0.0, "high": 0.2, "of_steps": True}}},
            "prodigy": None,  # self-tuning
            "sf": {"option": "schedule_free_adamw", "overrides": ["scheduler=constant"]},
        },
        "trials": 4, "studies": 3, "confirm_seeds": 2, "self_tuning_budget": 1.5,
        "select_on": {"data.evaluate_on": "validation"}, "confirm_on": {"data.evaluate_on": "held_out"},
    }
    base.update(changes)
    return base


def test_every_tuned_optimizer_gets_the_same_trials_whatever_its_space_and_the_self_tuning_track_none():
    """A space of 1 key and one of 5 get the same studies x trials on every workload; self-tuning entries search
    nothing and run studies x confirm_seeds confirm jobs at 1.5x the steps. Red if trials grew with the space."""
    bench = Bench.from_config(config())
    search = bench.search_jobs()
    for workload in ("sft", "grpo"):
        for name in ("adamw", "muon"):
            own = [j for j in search if (j.workload, j.optimizer) == (workload, name)]
            assert len(own) == 3 * 4 and {(j.study, j.index) for j in own} == {(s, t) for s in range(3)
                                                                               for t in range(4)}
            assert all(j.track == TUNED and "data.evaluate_on=validation" in j.overrides for j in own)
        assert not [j for j in search if j.optimizer in ("prodigy", "sf")]
    confirm = bench.confirm_jobs(search)  # nothing has a value yet: the tuned studies have nothing to confirm
    for name in ("adamw", "muon", "prodigy", "sf"):
        own = [j for j in confirm if (j.workload, j.optimizer) == ("sft", name)]
        assert len(own) == 3 * 2
        assert all(j.launched == (name in ("prodigy", "sf")) for j in own)
    sf = [j for j in confirm if j.optimizer == "sf" and j.workload == "sft"][0]
    assert sf.track == SELF_TUNING and sf.steps == 60 and sf.point == {}
    assert sf.overrides[:3] == ["algo=sft", "optimizer=schedule_free_adamw", "scheduler=constant"]
    assert bench.counts() == {"search": 2 * 2 * 12, "confirm": 2 * 4 * 6, "runs": 48 + 48,
                              "steps": 40 * 2 * 3 * (4 + 2) + 60 * 2 * 3 * 2 + 20 * 2 * 3 * (4 + 2) + 30 * 2 * 3 * 2}


def test_the_points_are_quasi_random_in_range_on_their_scale_the_same_on_every_workload_and_new_per_study():
    bench = Bench.from_config(config(trials=8))
    points = [bench.points("muon", study) for study in range(3)]
    assert points[0] == bench.points("muon", 0)  # reproducible
    assert points[0] != points[1] and points[1] != points[2] and points[0] != points[2]
    lrs = sorted(p["optimizer.lr"] for p in points[0])
    assert all(1e-5 <= v <= 1e-2 for v in lrs)
    decades = {math.floor(math.log10(v)) for v in lrs}
    assert decades >= {-5, -4, -3}, lrs  # a log scale spreads 8 Sobol points over the decades
    for p in points[0]:
        assert 0.8 <= p["optimizer.momentum"] <= 0.98
    search = bench.search_jobs()
    for study in range(3):
        sft = [j.point for j in search if (j.workload, j.optimizer, j.study) == ("sft", "muon", study)]
        grpo = [j.point for j in search if (j.workload, j.optimizer, j.study) == ("grpo", "muon", study)]
        assert sft == grpo == points[study]
    job = next(j for j in search if j.workload == "grpo" and j.optimizer == "muon")
    warmup = next(o for o in job.overrides if o.startswith("scheduler.num_warmup_steps="))
    assert warmup == f"scheduler.num_warmup_steps={round(job.point['scheduler.num_warmup_steps'] * 20)}"
    assert "seed=0" in job.overrides and "objective.metric=eval/reward" in job.overrides


@pytest.mark.parametrize("scale, low, high", [("linear", 0.0, 0.1), ("log", 1e-6, 1e-2), ("log1m", 0.9, 0.999)])
def test_a_dimension_maps_the_unit_interval_onto_its_range_and_back(scale, low, high):
    dim = Dimension("k", low, high, scale)
    assert dim.at(0.0) == pytest.approx(low) and dim.at(1.0) == pytest.approx(high)
    for unit in (0.05, 0.5, 0.95):
        assert dim.unit(dim.at(unit)) == pytest.approx(unit)
    assert dim.edge(dim.at(0.05)) == "low" and dim.edge(dim.at(0.95)) == "high" and dim.edge(dim.at(0.5)) == ""
    if scale == "log1m":  # the middle of 0.9..0.999 on this scale is 0.99
        assert dim.at(0.5) == pytest.approx(0.99)


def test_the_choice_is_the_best_trial_that_returned_and_a_study_of_failed_trials_confirms_nothing():
    bench = Bench.from_config(config())
    search = bench.search_jobs()
    for job in search:
        job.value = -abs(math.log10(job.point["optimizer.lr"]) + 3.5)  # best near 3e-4
    study0 = [j for j in search if (j.workload, j.optimizer, j.study) == ("sft", "adamw", 0)]
    best = max(study0, key=lambda j: j.value)
    best.value = None  # the best trial failed: the next best is chosen
    assert bench.choice(search, "sft", "adamw", 0) is max((j for j in study0 if j.value is not None),
                                                          key=lambda j: j.value)
    for job in study0:
        job.value = None
    assert bench.choice(search, "sft", "adamw", 0) is None
    confirm = [j for j in bench.confirm_jobs(search) if (j.workload, j.optimizer) == ("sft", "adamw")]
    assert [j.launched for j in confirm] == [False, False, True, True, True, True]
    assert confirm[0].reason == "every trial of its study failed"
    chosen = bench.choice(search, "sft", "adamw", 1)
    assert confirm[2].point == chosen.point and confirm[2].seed != chosen.seed
    assert "data.evaluate_on=held_out" in confirm[2].overrides and "train.eval_at_start=true" in confirm[2].overrides
    assert {j.seed for j in confirm} == set(range(1000, 1006))


def test_a_bad_space_or_plan_is_refused_with_its_fix():
    with pytest.raises(UserError, match=r"optimizers.adamw.space.optimizer.lr: needs low > 0 on a log scale .* Fix"):
        Bench.from_config(config(optimizers={"adamw": {"space": {"optimizer.lr": {"low": 0, "high": 1,
                                                                                    "scale": "log"}}}}))
    with pytest.raises(UserError, match=r"unknown field\(s\) \['spaces'\]. Fix: option"):
        Bench.from_config(config(optimizers={"adamw": {"spaces": {}}}))
    with pytest.raises(UserError, match=r"take their target from the reference optimizer 'adamw', which is not a "
                                        r"tuned optimizer"):
        Bench.from_config(config(optimizers={"sgd": {"space": {"optimizer.lr": LR}}}))
    with pytest.raises(UserError, match=r"workloads.sft lacks \['metric'\]"):
        Bench.from_config(config(workloads={"sft": {"max_steps": 3, "direction": "maximize"}}))


def test_unknown_keys_names_and_ranges_are_refused_naming_the_key_they_resemble():
    with pytest.raises(UserError, match=r"hydra.sweeper.confirm_seed is not a setting .* Fix: "
                                        r"hydra.sweeper.confirm_seeds \(the key it resembles\)"):
        Bench.from_config(config(confirm_seed=3))
    with pytest.raises(UserError, match=r"workloads.sft.eval_every_step is not a setting .* Fix: "
                                        r"hydra.sweeper.workloads.sft.eval_every_steps"):
        Bench.from_config(config(workloads={"sft": {"max_steps": 3, "metric": "eval/loss", "direction": "minimize",
                                                    "eval_every_step": 1}}, optimizers={"adamw": {"space": {
                                                        "optimizer.lr": LR}}}))
    with pytest.raises(UserError, match=r"r_max=1.0: .* Fix: hydra.sweeper.r_max=4"):
        Bench.from_config(config(r_max=1.0))
    with pytest.raises(UserError, match=r"the name 'my adamw' is a folder"):
        Bench.from_config(config(optimizers={"adamw": {"space": {"optimizer.lr": LR}}, "my adamw": {}}))
    with pytest.raises(UserError, match=r"needs 0 <= low and high <= 1 for a fraction of the steps"):
        Dimension.parse("scheduler.num_warmup_steps", {"low": 0, "high": 5, "of_steps": True}, "space")


def test_an_override_keeps_six_significant_digits():
    """A beta2 of 0.99987 written with 4 digits would run as 0.9999 (1 - beta2 off by 23%)."""
    assert Dimension("optimizer.betas.1", 0.9, 0.9999, "log1m").override(0.99987, 10) == "optimizer.betas.1=0.99987"
