"""Reward shaping (rlhf.algos.reward_shaping): running moments against numpy, their checkpoint round trip and merge
over processes; score scaling/normalization/clipping, the KL-penalized reward, the KL controllers and weighted rewards
against values worked out by hand."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from rlhf.algos import reward_shaping as R
from rlhf.core.errors import UserError

BATCHES = [[1.0, 2.0, 4.0], [-3.0, 0.5], [10.0], [2.0, 2.0, 7.0, -1.0]]


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    assert torch.allclose(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol), actual


def test_running_moments_equal_numpy_over_all_batches_seen():
    running = R.RunningMoments()
    seen: list[float] = []
    for batch in BATCHES:
        running.update(torch.tensor(batch))
        seen += batch
        assert running.count == len(seen)
        assert running.mean == pytest.approx(np.mean(seen), abs=1e-12)
        assert running.std == pytest.approx(np.std(seen, ddof=1), abs=1e-12)


def test_running_moments_before_two_scores_leave_scores_unscaled():
    running = R.RunningMoments()
    assert running.std == 1.0
    running.update(torch.tensor([3.0]))
    assert (running.count, running.mean, running.std) == (1.0, 3.0, 1.0)
    running.update(torch.tensor([]))
    assert running.count == 1.0


def test_running_moments_state_dict_round_trip_is_exact():
    first = R.RunningMoments()
    for batch in BATCHES[:2]:
        first.update(torch.tensor(batch))
    state = first.state_dict()
    assert all(t.dtype == torch.float64 for t in state.values())
    resumed = R.RunningMoments()
    resumed.load_state_dict({k: v.clone() for k, v in state.items()})
    for batch in BATCHES[2:]:
        first.update(torch.tensor(batch))
        resumed.update(torch.tensor(batch))
    assert (resumed.count, resumed.mean, resumed.m2) == (first.count, first.mean, first.m2)  # bit for bit


def test_combine_of_per_process_moments_equals_one_process_over_the_concatenation():
    per_process = [R.batch_moments(torch.tensor(b)) for b in BATCHES]
    counts, means, m2s = (torch.tensor(column, dtype=torch.float64) for column in zip(*per_process))
    count, mean, m2 = R.combine_moments(counts, means, m2s)
    everything = [x for b in BATCHES for x in b]
    assert count == len(everything)
    assert mean == pytest.approx(np.mean(everything), abs=1e-12)
    assert m2 == pytest.approx(np.var(everything) * len(everything), abs=1e-10)
    # a process without scores changes nothing
    with_empty = R.combine_moments(torch.cat([counts, torch.zeros(1)]), torch.cat([means, torch.zeros(1)]),
                                   torch.cat([m2s, torch.zeros(1)]))
    assert with_empty == (count, mean, m2)
    # feeding the merged global batch to every process's running moments = one process seeing everything
    merged, single = R.RunningMoments(), R.RunningMoments()
    merged.update_from_moments(count, mean, m2)
    single.update(torch.tensor(everything))
    assert merged.mean == pytest.approx(single.mean, abs=1e-12) and merged.std == pytest.approx(single.std, abs=1e-12)


def test_score_scaling_norm_and_clip_by_hand():
    scores = torch.tensor([1.0, 4.0, -8.0])
    mean, std = 2.0, 4.0
    close(R.score_scaling(scores, std), [1 / 4, 1.0, -2.0])
    close(R.score_norm(scores, mean, std), [-1 / 4, 2 / 4, -10 / 4])
    close(R.score_clip(torch.tensor([-3.0, 0.5, 2.5]), 2.0), [-2.0, 0.5, 2.0])


def test_kl_penalized_rewards_put_the_score_on_the_last_token():
    scores = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    coef = 0.5
    expected = [[-coef * 0.1, -coef * 0.2, -coef * 0.3 + 1.0], [-coef * 0.5, -coef * -0.4 - 2.0, 0.0]]
    close(R.kl_penalized_rewards(scores, kl, mask, coef), expected)
    with pytest.raises(ValueError, match="no token"):
        R.kl_penalized_rewards(scores, kl, torch.tensor([[1, 1, 1], [0, 0, 0]]), coef)


def test_fixed_kl_controller_stays_put():
    fixed = R.FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    copy = R.FixedKLController(1.0)
    copy.load_state_dict(fixed.state_dict())
    assert copy.value == 0.05


def test_adaptive_kl_controller_by_hand():
    ctl = R.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=1000)
    ctl.update(current_kl=7.5, n_steps=100)  # error 7.5/6 - 1 = 0.25, clipped to 0.2
    expected = 0.2 * (1 + 0.2 * 100 / 1000)
    assert ctl.value == pytest.approx(expected)
    ctl.update(current_kl=5.4, n_steps=50)  # error -0.1
    expected *= 1 - 0.1 * 50 / 1000
    assert ctl.value == pytest.approx(expected)
    ctl.update(current_kl=0.0, n_steps=10)  # error -1, clipped to -0.2
    expected *= 1 - 0.2 * 10 / 1000
    assert ctl.value == pytest.approx(expected)
    resumed = R.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=1000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value  # exact
    resumed.update(6.6, 10)
    ctl.update(6.6, 10)
    assert resumed.value == ctl.value


def test_weighted_rewards_treat_nan_as_not_applicable():
    nan = math.nan
    per_func = torch.tensor([[1.0, 0.5], [0.0, nan], [nan, nan]])
    reward, means = R.weighted_rewards(per_func, torch.tensor([2.0, -1.0]))
    close(reward, [2 * 1.0 - 1 * 0.5, 2 * 0.0, 0.0])
    close(means, [(1.0 + 0.0) / 2, 0.5])  # each function's own, unweighted mean
    reward, _ = R.weighted_rewards(per_func)
    close(reward, [1.5, 0.0, 0.0])
    _, means = R.weighted_rewards(torch.tensor([[1.0, nan]]))
    assert math.isnan(means[1].item())


def test_weighted_rewards_refuse_the_wrong_number_of_weights():
    with pytest.raises(UserError, match="one weight per reward function"):
        R.weighted_rewards(torch.zeros(2, 3), torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize("module", ["advantages", "policy_losses", "reward_shaping"])
def test_declared_limits_name_real_arguments(module):
    import importlib

    mod = importlib.import_module(f"rlhf.algos.{module}")
    for name, obj in vars(mod).items():
        if getattr(obj, "__module__", None) == mod.__name__ and hasattr(obj, "__limits__"):
            assert set(obj.__limits__) <= set(inspect.signature(obj).parameters), name


def test_reward_functions_and_weights_default_and_refuse_a_count_that_does_not_match():
    """One helper for online algorithms (algo.) and eval=generate (eval.): the task's exact match by default, one
    weight per function, the key named as the user types it."""
    from rlhf.algos import reward_funcs
    from rlhf.core.errors import UserError

    functions, weights = reward_funcs.functions_and_weights(None, None, "algo")
    assert list(functions) == ["exact_match"] and functions["exact_match"] is reward_funcs.exact_match
    assert weights is None
    assert reward_funcs.functions_and_weights({"a": len, "b": len}, [1, 0], "eval")[1] == [1.0, 0.0]
    with pytest.raises(UserError, match=r"^eval.reward_weights has 1 values for 2 reward functions \(a, b\). Fix: .*"
                                        r"eval.reward_weights=null"):
        reward_funcs.functions_and_weights({"a": len, "b": len}, [1], "eval")
