"""The optimizer benchmark's scores (rlhf.sweeps.bench.scores) on hand-made tables and metrics, each answer worked
out by hand in a comment: time to target (mid-window, at step 0, missed, minimized, repeated by a resume), bootstrap
intervals, the performance profile and its exact score, the geometric-mean speed-up, and the profile's figure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf.core.errors import UserError
from rlhf.sweeps.bench import scores
from rlhf.sweeps.bench.profile_plot import profile_figure, profile_plot
from rlhf.sweeps.plots import pyplot

INF = math.inf
MATCH, LOSS, STEP = "eval/exact_match", "eval/loss", scores.STEP_TIME

# Log windows every 10 steps (0.5, 1.0 and 2.0 s per step), evaluations every 15 (loss and exact match).
RECORDS = [
    {"step": 0, MATCH: 0.1, LOSS: 2.0},
    {"step": 10, STEP: 0.5, "train/loss": 1.9},
    {"step": 15, MATCH: 0.6, LOSS: 1.2},
    {"step": 20, STEP: 1.0, "train/loss": 1.1},
    {"step": 30, STEP: 2.0, "train/loss": 0.8},
    {"step": 30, "perf/checkpoint_time_s": 50.0},
    {"step": 30, MATCH: 0.8, LOSS: 0.9},
]


@pytest.mark.parametrize(("metric", "direction", "target", "expected"), [
    # met at step 15, in the window 11..20: 10 steps x 0.5 s + 5 steps x 1.0 s = 10 s
    (MATCH, "maximize", 0.5, (15, 10.0)),
    # met at step 30: 10 x 0.5 + 10 x 1.0 + 10 x 2.0 = 35 s (the checkpoint's 50 s not counted)
    (MATCH, "maximize", 0.7, (30, 35.0)),
    # met by the evaluation before training: 0 steps, 0 s
    (MATCH, "maximize", 0.1, (0, 0.0)),
    # never met
    (MATCH, "maximize", 0.9, (INF, INF)),
    # a loss to push down: 2.0, 1.2, 0.9 meet <= 1.0 first at step 30 (maximized, 2.0 >= 1.0 would give step 0)
    (LOSS, "minimize", 1.0, (30, 35.0)),
    # never evaluated
    ("eval/reward", "maximize", 0.0, (INF, INF)),
])
def test_time_to_target_counts_the_training_steps_up_to_the_first_evaluation_that_meets_it(
        metric, direction, target, expected):
    """Red with the window's steps past the target counted (10 s -> 15 s), with the comparison fixed to >= (the
    minimized loss met at step 0), and with the first evaluation returned whatever its value."""
    assert scores.time_to_target(RECORDS, metric, direction, target) == expected


def test_time_to_target_takes_the_last_line_of_a_step_a_resume_logged_again():
    """Checkpoint at step 20; steps 21..30 ran, were logged (slow, 3.0 s per step; exact match 0.55) and killed
    before the next checkpoint; the resume ran them again (1.0 s per step; 0.45) and went on. Target 0.5: the
    lines that count say step 40, 10 x 0.5 + 10 x 1.0 + 10 x 1.0 + 10 x 1.0 = 35 s. Red with the first line of a
    step kept (step 30, 5 + 10 + 30 = 45 s)."""
    records = [
        {"step": 10, STEP: 0.5}, {"step": 10, MATCH: 0.3},
        {"step": 20, STEP: 1.0}, {"step": 20, MATCH: 0.4},
        {"step": 30, STEP: 3.0}, {"step": 30, MATCH: 0.55},  # the attempt that was killed
        {"step": 30, STEP: 1.0}, {"step": 30, MATCH: 0.45},  # the resumed one
        {"step": 40, STEP: 1.0}, {"step": 40, MATCH: 0.6},
    ]
    assert scores.time_to_target(records, MATCH, "maximize", 0.5) == (40, 35.0)


def test_a_failed_run_misses_and_steps_past_the_last_window_take_its_pace():
    """No records (a trial that failed before writing any): a miss. A run killed at step 27 after its evaluation
    at 25 met the target: 10 x 0.5 + 10 x 1.0, then 5 steps at the last window's 1.0 s = 20 s. Red with the steps
    past the last window left out (15 s). A non-finite value written as a string ("nan") never meets a target."""
    assert scores.time_to_target(None, MATCH, "maximize", 0.5) == scores.MISSED == (INF, INF)
    killed = [{"step": 10, STEP: 0.5}, {"step": 20, STEP: 1.0}, {"step": 25, MATCH: "nan"}, {"step": 25, MATCH: 0.7}]
    assert scores.time_to_target(killed, MATCH, "maximize", 0.5) == (25, 20.0)
    assert scores.time_to_target(killed[:3], MATCH, "maximize", 0.5) == scores.MISSED
    with pytest.raises(UserError, match="direction='max' is not one of minimize, maximize"):
        scores.time_to_target(RECORDS, MATCH, "max", 0.5)


def test_the_bootstrap_interval_of_three_runs_is_their_range_and_narrows_with_thirty():
    """Three values: a resample's median is the smallest with probability 7/27 and the largest with 7/27, both
    above 2.5%, so the 95% interval is [min, max] = [1, 3]. Thirty values around 10 (sd 0.1): the median's interval
    holds the median and is under half their range (the median's standard error is about 1.25 x 0.1 / sqrt(30) =
    0.023, the range about 0.4). Red with [min, max] returned for every n, and with the bootstrap of the mean."""
    assert scores.bootstrap_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    tight = np.random.default_rng(1).normal(10.0, 0.1, 30)
    low, high = scores.bootstrap_interval(tight)
    assert low <= np.median(tight) <= high
    assert high - low < 0.5 * (tight.max() - tight.min())
    assert scores.bootstrap_interval(tight, seed=5) == scores.bootstrap_interval(tight, seed=5)
    # skewed values: the median's interval leaves out the outlier, the mean's would reach towards it
    assert scores.bootstrap_interval([1.0, 1.1, 1.2, 1.3, 100.0] * 4)[1] < 2.0


def test_missed_targets_make_the_median_infinite_where_half_or_more_missed():
    """[1, 2, inf]: median 2, interval [1, inf] (a resample with two or three infs has median inf, probability
    7/27). [1, inf, inf]: median inf, interval [1, inf]. Red with percentiles interpolated (NaN between infs)."""
    assert scores.summary([2.0, INF, 1.0]) == {"median": 2.0, "low": 1.0, "high": INF, "min": 1.0, "max": INF,
                                               "n": 3}
    assert scores.summary([INF, 1.0, INF]) == {"median": INF, "low": 1.0, "high": INF, "min": 1.0, "max": INF,
                                               "n": 3}
    with pytest.raises(UserError, match="NaN among"):
        scores.summary([1.0, math.nan])
    with pytest.raises(UserError, match="no values"):
        scores.bootstrap_interval([])


# 3 workloads x 3 optimizers: a tie (SFT), a miss (SGD on DPO), a workload every optimizer missed (GRPO).
TIMES = {
    "sft": {"adamw": 100.0, "lion": 100.0, "sgd": 310.0},  # ratios 1, 1, 3.1
    "dpo": {"adamw": 50.0, "lion": 25.0, "sgd": INF},      # ratios 2, 1, inf
    "grpo": {"adamw": INF, "lion": INF, "sgd": INF},      # ratios inf, inf, inf: a miss for all, not a tie
}


def test_the_performance_profile_scores_the_exact_area_under_its_steps():
    """Score = sum over workloads of max(0, 4 - r) / (3 workloads x (4 - 1)):
    adamw (3 + 2 + 0) / 9 = 5/9; lion (3 + 3 + 0) / 9 = 2/3; sgd (0.9 + 0 + 0) / 9 = 0.1.
    rho: adamw 1/3 from 1, 2/3 from 2; lion 2/3 from 1; sgd 0 from 1, 1/3 from 3.1; each held to r_max = 4.
    Red with the integral sampled on 1000 points of tau, with ratios over AdamW's time instead of the best (lion
    0.5 on DPO), and with the all-missed workload counted as a tie."""
    profile = scores.performance_profile(TIMES)
    assert profile.ratios == {"sft": {"adamw": 1.0, "lion": 1.0, "sgd": 3.1}, "dpo": {"adamw": 2.0, "lion": 1.0,
                              "sgd": INF}, "grpo": {"adamw": INF, "lion": INF, "sgd": INF}}
    assert profile.scores == pytest.approx({"adamw": 5 / 9, "lion": 2 / 3, "sgd": 0.1}, rel=1e-12)
    assert profile.curves == {"adamw": ([1.0, 2.0, 4.0], [1 / 3, 2 / 3, 2 / 3]),
                              "lion": ([1.0, 4.0], [2 / 3, 2 / 3]),
                              "sgd": ([1.0, 3.1, 4.0], [0.0, 1 / 3, 1 / 3])}
    # r_max = 2: sgd's 3.1 is past it; adamw (1 + 0) / 3, lion (1 + 1) / 3
    assert scores.performance_profile(TIMES, r_max=2.0).scores == pytest.approx(
        {"adamw": 1 / 3, "lion": 2 / 3, "sgd": 0.0}, rel=1e-12)


@pytest.mark.parametrize(("times", "message"), [
    ({"sft": {"adamw": 1.0, "lion": math.nan}}, "lion has time nan"),
    ({"sft": {"adamw": 1.0, "lion": 0.0}}, "met the target before training"),
    ({"sft": {"adamw": 1.0, "lion": 2.0}, "dpo": {"adamw": 1.0}}, "time every optimizer on every workload"),
    ({}, "no workloads"),
])
def test_times_that_cannot_be_scored_are_refused_with_the_fix(times, message):
    """Red with the check removed (NaN passes as a time; a missing optimizer is a KeyError)."""
    with pytest.raises(UserError, match=message):
        scores.performance_profile(times)
    with pytest.raises(UserError):
        scores.geometric_mean_speedup(times, baseline="adamw")


def test_the_geometric_mean_speedup_counts_workloads_both_reached_and_says_who_missed_the_rest():
    """lion: 100/50 = 2 and 80/20 = 4 -> sqrt(8) = 2.828, GRPO left out (AdamW missed). sgd: 80/160 = 0.5 on DPO
    alone; SFT left out (SGD missed), GRPO (AdamW missed). Red with the arithmetic mean (lion 3.0) and with
    t_optimizer / t_baseline (lion 0.354)."""
    times = {"sft": {"adamw": 100.0, "lion": 50.0, "sgd": INF},
             "dpo": {"adamw": 80.0, "lion": 20.0, "sgd": 160.0},
             "grpo": {"adamw": INF, "lion": 10.0, "sgd": 40.0}}
    speedups = scores.geometric_mean_speedup(times, baseline="adamw")
    assert speedups["lion"].speedup == pytest.approx(math.sqrt(8.0), rel=1e-12)
    assert speedups["lion"][1:] == (2, 0, 1)
    assert speedups["sgd"] == (pytest.approx(0.5, rel=1e-12), 1, 1, 1)
    assert speedups["adamw"] == (1.0, 2, 0, 1)
    with pytest.raises(UserError, match="the baseline 'sgd' is not among"):
        scores.geometric_mean_speedup({"sft": {"adamw": 1.0}}, baseline="sgd")
    assert math.isnan(scores.geometric_mean_speedup({"sft": {"adamw": INF, "lion": 1.0}})["lion"].speedup)


def test_the_profile_figure_draws_a_step_curve_per_optimizer_on_a_log_axis_with_its_score(tmp_path):
    """One steps-post line per optimizer through its curve's points, tau on a log axis from 1 to r_max, the
    legend best score first with the scores; the PNG written. Red with a linear axis, with the score left out of
    the legend, and with the file not saved."""
    profile = scores.performance_profile(TIMES)
    figure = profile_figure(profile, "time to target (s)")
    axis = figure.axes[0]
    lines = axis.get_lines()
    assert [line.get_drawstyle() for line in lines] == ["steps-post"] * 3
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in lines] == [
        profile.curves["lion"], profile.curves["adamw"], profile.curves["sgd"]]
    assert axis.get_xscale() == "log" and axis.get_xlim() == pytest.approx((1.0, 4.0))
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "lion (score 0.667)", "adamw (score 0.556)", "sgd (score 0.100)"]
    pyplot().close(figure)
    path = tmp_path / "profile.png"
    profile_plot(profile, path, "time to target (s)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
