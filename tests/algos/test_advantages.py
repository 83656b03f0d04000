"""Advantages of online RL (rlhf.algos.advantages) against values worked out by hand in plain Python below."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos import advantages as A
from rlhf.core.errors import UserError

# Two prompts, three completions each (G = 3).
REWARDS = [1.0, 0.0, 2.0, 5.0, 5.0, 5.0]
G = 3


def close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    assert torch.allclose(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol), actual


def sample_std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def test_group_scaling_by_hand():
    # group 1: mean 1, sample std sqrt((0 + 1 + 1) / 2) = 1; group 2: all 5 → advantages 0, no NaN
    adv = A.scale_by_group_std(torch.tensor(REWARDS), G)
    close(adv, [0.0, -1 / 1.0001, 1 / 1.0001, 0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()


def test_batch_scaling_divides_by_the_std_of_the_whole_batch():
    std = sample_std(REWARDS)  # 2.2509...
    close(A.scale_by_batch_std(torch.tensor(REWARDS), G), [0, -1 / (std + 1e-4), 1 / (std + 1e-4), 0, 0, 0])


def test_no_scaling_is_the_group_centered_reward():
    close(A.no_scaling(torch.tensor([1.0, 3.0, 10.0, 20.0]), 2), [-1, 1, -5, 5])


def test_the_registry_names_trls_values():
    assert A.SCALE_REWARDS == {"group": A.scale_by_group_std, "batch": A.scale_by_batch_std, "none": A.no_scaling}


def test_all_equal_rewards_give_zero_advantages_everywhere():
    equal = torch.full((6,), 0.7)
    for fn in (*A.SCALE_REWARDS.values(), A.leave_one_out, A.reinforce_pp):
        adv = fn(equal, G)
        assert torch.isfinite(adv).all() and torch.equal(adv, torch.zeros(6)), fn.__name__


def test_equal_rewards_give_exact_zeros_despite_rounding():
    # the float32 mean of eight 0.7s is off by 6e-8; divided by (std + 1e-4) that would be an advantage of 6e-4
    equal = torch.full((16,), 0.7)
    for fn in (*A.SCALE_REWARDS.values(), A.leave_one_out, A.reinforce_pp):
        assert torch.equal(fn(equal, 8), torch.zeros(16)), fn.__name__


def test_leave_one_out_by_hand():
    # r = [1, 0, 2]: baselines (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5
    adv = A.leave_one_out(torch.tensor(REWARDS), G)
    close(adv, [1 - 1, 0 - 1.5, 2 - 0.5, 0, 0, 0])
    # = G/(G-1) × (r − group mean)
    close(adv[:3], [1.5 * (1 - 1), 1.5 * (0 - 1), 1.5 * (2 - 1)])


def test_leave_one_out_refuses_groups_of_one():
    with pytest.raises(UserError, match="num_generations=2"):
        A.leave_one_out(torch.tensor([1.0, 2.0]), 1)


def test_rewards_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="groups"):
        A.scale_by_group_std(torch.tensor([1.0, 2.0, 3.0]), 2)


def test_reinforce_pp_whitens_over_the_batch():
    r = [1.0, 2.0, 3.0, 6.0]
    mean, std = 3.0, sample_std(r)  # sqrt(14/3)
    close(A.reinforce_pp(torch.tensor(r)), [(x - mean) / (std + 1e-4) for x in r])
    # with a group baseline (G = 2): centered [-0.5, 0.5, -1.5, 1.5], mean 0, std sqrt(5/3)
    c = [-0.5, 0.5, -1.5, 1.5]
    close(A.reinforce_pp(torch.tensor(r), num_generations=2), [x / (sample_std(c) + 1e-4) for x in c])


MASK = [[1, 1, 1], [1, 1, 0]]


def test_masked_whiten_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    inside = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean, std = 3.0, sample_std(inside)  # var 2.5
    expected = [[(x - mean) / math.sqrt(std**2 + 1e-8) for x in row] for row in ([1, 2, 3], [4, 5])]
    close(A.masked_whiten(values, torch.tensor(MASK)), [expected[0], [*expected[1], 0.0]])
    kept = A.masked_whiten(values, torch.tensor(MASK), shift_mean=False)
    close(kept, [[x + mean for x in expected[0]], [*(x + mean for x in expected[1]), 0.0]])


def test_masked_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    assert A.masked_mean(values, torch.tensor(MASK)).item() == pytest.approx(3.0)
    close(A.masked_mean(values, torch.tensor(MASK), dim=1), [2.0, 4.5])


def test_discounted_returns_and_reinforce_pp_tokens():
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.5, 2.0, 7.0]])
    g = 0.5
    returns = [[0 + g * (-0.1 + g * 1.0), -0.1 + g * 1.0, 1.0], [0.5 + g * 2.0, 2.0, 0.0]]
    close(A.discounted_returns(rewards, torch.tensor(MASK), gamma=g), returns)
    inside = returns[0] + returns[1][:2]
    mean, std = sum(inside) / 5, sample_std(inside)
    expected = [[(x - mean) / math.sqrt(std**2 + 1e-8) for x in returns[0]],
                [(returns[1][0] - mean) / std, (returns[1][1] - mean) / std, 0.0]]
    close(A.reinforce_pp_tokens(rewards, torch.tensor(MASK), gamma=g), expected, atol=1e-5)


def test_gae_by_hand_with_padding_and_bootstrap():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 9.0]])
    # row 0, full length, ends (V after last = 0)
    d2 = 1.0 + gamma * 0 - 0.3
    d1 = 0.0 + gamma * 0.3 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    # row 1, two tokens; the padded step (reward 5, value 9) must not count
    e1 = 2.0 + 0 - 0.6
    e0 = 0.0 + gamma * 0.6 - 0.2
    b1 = e1
    b0 = e0 + gamma * lam * b1
    adv, ret = A.gae(rewards, values, torch.tensor(MASK), gamma=gamma, lam=lam)
    close(adv, [[a0, a1, a2], [b0, b1, 0.0]])
    close(ret, [[a0 + 0.5, a1 + 0.4, a2 + 0.3], [b0 + 0.2, b1 + 0.6, 0.0]])

    # bootstrap: a truncated completion continues with the value of the state after its last token
    boot = torch.tensor([2.0, 3.0])
    a2b = 1.0 + gamma * 2.0 - 0.3
    a1b = d1 + gamma * lam * a2b
    a0b = d0 + gamma * lam * a1b
    b1b = 2.0 + gamma * 3.0 - 0.6
    b0b = e0 + gamma * lam * b1b
    adv, _ = A.gae(rewards, values, torch.tensor(MASK), gamma=gamma, lam=lam, bootstrap_values=boot)
    close(adv, [[a0b, a1b, a2b], [b0b, b1b, 0.0]])


def test_gae_with_gamma_and_lam_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 1.0, 2.0]])
    values = torch.tensor([[0.5, 0.25, 1.0]])
    adv, ret = A.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[3.0 - 0.5, 3.0 - 0.25, 2.0 - 1.0]])
    close(ret, [[3.0, 3.0, 2.0]])


def test_gae_refuses_left_padding():
    with pytest.raises(ValueError, match="right-padded"):
        A.gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[0, 1, 1]]))


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3])
    assert A.groups_with_reward_variance(rewards, G).tolist() == [True, False, False, True]
    assert A.groups_with_reward_variance(rewards, G).nonzero().squeeze(1).tolist() == [0, 3]
    assert A.completions_in_kept_groups(rewards, G).tolist() == [True] * 3 + [False] * 6 + [True] * 3
    assert A.groups_with_reward_variance(rewards, G, atol=0.01).tolist() == [True, False, False, False]
    assert A.frac_reward_zero_std(rewards, G).item() == pytest.approx(2 / 4)


# Two reward functions, "correct" (0 or 1) and "short" (graded), over three groups of four completions.
CORRECT_AND_SHORT = torch.tensor([
    [0.0, 0.9], [0.0, 0.5], [0.0, 0.1], [0.0, 0.7],   # nobody right: only "short" differs
    [1.0, 0.9], [0.0, 0.5], [1.0, 0.1], [0.0, 0.7],   # "correct" differs: the group has a real signal
    [1.0, 0.2], [1.0, 0.2], [1.0, 0.2], [1.0, 0.2],   # all equal: no advantage at all
])


def test_a_lightly_weighted_reward_alone_differing_in_a_group_is_found():
    alone = A.minor_rewards_alone(CORRECT_AND_SHORT, [1.0, 0.1], 4)
    assert alone.tolist() == [[False, True], [False, False], [False, False]]
    # why it matters: group scaling gives "short"'s differences of 0.08 (in the weighted reward) unit advantages
    # there, the same size as the right-or-wrong of the second group, whose "short" is the smaller part
    adv = A.scale_by_group_std(CORRECT_AND_SHORT @ torch.tensor([1.0, 0.1]), 4)
    assert float(adv[:4].abs().max()) > 1.0 and float(adv[4:8].abs().max()) < 1.0
    # none flagged where no weight is small (equal weights, None = all 1, exactly at a quarter is small, above not)
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT, [1.0, 1.0], 4).any()
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT, None, 4).any()
    assert A.minor_rewards_alone(CORRECT_AND_SHORT, [1.0, 0.25], 4).any()
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT, [1.0, 0.26], 4).any()
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT, [-1.0, -0.3], 4).any()
    assert A.minor_rewards_alone(CORRECT_AND_SHORT, [-1.0, 0.1], 4).tolist()[0] == [False, True]  # sizes: |w|
    # at weight 0 a function is logged, not trained on: its differences change no reward
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT, [1.0, 0.0], 4).any()
    # the heavy function differing too takes the group out, whatever the light one does
    assert not A.minor_rewards_alone(CORRECT_AND_SHORT[4:8], [1.0, 0.1], 4).any()


def test_minor_rewards_alone_reads_nan_as_the_weighted_sum_does_and_refuses_part_groups():
    per_function = torch.tensor([[math.nan, 0.3], [0.0, 0.6]])  # NaN counts as 0: "correct" is 0 and 0, equal
    assert A.minor_rewards_alone(per_function, [1.0, 0.1], 2).tolist() == [[False, True]]
    per_function = torch.tensor([[math.nan, 0.3], [1.0, 0.6]])  # 0 and 1: the heavy function differs
    assert not A.minor_rewards_alone(per_function, [1.0, 0.1], 2).any()
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        A.minor_rewards_alone(CORRECT_AND_SHORT[:6], [1.0, 0.1], 4)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo=grpo"], "algo.num_generations=1: each completion's advantage is its reward against its prompt's group "
                    "mean, so one completion a prompt has nothing to be compared with"),
    (["algo=rloo"], "algo.num_generations=1: each completion's baseline is the mean reward of the other"),
    (["algo=reinforce_pp", "algo.group_baseline=true"], "algo.num_generations=1 with algo.group_baseline=true.*Fix: "
                                                       r"algo.num_generations=2 or more \(8 is common\); for one "
                                                       "completion a prompt, algo.group_baseline=false"),
])
def test_one_completion_a_prompt_is_refused_where_the_advantage_compares_within_the_group(overrides, message):
    from rlhf.config.checks import check_config
    from rlhf.core.errors import UserError
    from tests.conftest import compose_config

    with pytest.raises(UserError, match=message):
        check_config(compose_config(*overrides, "algo.num_generations=1"))
    check_config(compose_config(*overrides, "algo.num_generations=2"))


@pytest.mark.parametrize("overrides", [["algo=ppo"], ["algo=reinforce_pp"], ["algo=iterative_sft"]])
def test_one_completion_a_prompt_is_allowed_where_it_means_something(overrides):
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    check_config(compose_config(*overrides, "algo.num_generations=1"))
