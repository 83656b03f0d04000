"""Advantages of online RL, each a pure tensor function: group-relative (GRPO), leave-one-out (RLOO), global batch
normalization (REINFORCE++), GAE (PPO), masked whitening, and DAPO's dynamic-sampling filter.

Shapes: ``B`` completions, ``G`` completions per prompt (TRL's ``num_generations``), ``T`` completion tokens.
Sequence-level rewards are ``[B]``, ordered group by group: rows ``0..G-1`` answer the first prompt, ``G..2G-1`` the
second, ... (TRL's layout). Token-level tensors are ``[B, T]`` with a completion ``mask`` of the same shape (1 for a
completion token, 0 for padding; right-padded where a function says so).

A config chooses among alternatives by ``_target_`` (one function each); the dicts at the end
(:data:`SCALE_REWARDS`) map TRL's option values to those functions for the config boundary only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from rlhf.core.errors import UserError

STD_EPS = 1e-4
"""Added to a standard deviation before dividing by it (TRL's GRPO uses 1e-4): all-equal rewards give 0, not NaN."""


def _groups(rewards: Tensor, num_generations: int) -> Tensor:
    """``[B]`` → ``[B/G, G]``, refusing a batch that is not whole groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one per completion, [B]; got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    return rewards.view(-1, num_generations)


def _group_std(rewards: Tensor, num_generations: int) -> Tensor:
    """Each group's sample standard deviation (Bessel-corrected, as ``torch.std``), repeated to ``[B]``; 0 for G = 1."""
    grouped = _groups(rewards, num_generations)
    if num_generations == 1:
        return torch.zeros_like(rewards)
    return grouped.std(dim=1).repeat_interleave(num_generations)


def _centered(x: Tensor, dim: int) -> Tensor:
    """``x − mean(x)`` along ``dim``, exactly 0 where all values are equal (a float mean of equal values can be off
    by a rounding error, which a division by a tiny standard deviation would blow up)."""
    equal = x.amax(dim=dim, keepdim=True) == x.amin(dim=dim, keepdim=True)
    return torch.where(equal, torch.zeros_like(x), x - x.mean(dim=dim, keepdim=True))


def compares_within_a_group(baseline: str, when: str | None = None) -> Callable[[dict, str], None]:
    """A config check (:func:`rlhf.core.limits.limits`) refusing ``num_generations=1`` for an algorithm whose
    advantage compares each completion with the others of its prompt (``baseline`` says how), optionally only
    when its option ``when`` is on: one completion a prompt is its own baseline, every advantage is 0 and nothing is
    learned."""

    def check(values: dict, where: str) -> None:
        generations = values.get("num_generations")
        if (when is not None and not values.get(when)) or not isinstance(generations, int) or generations >= 2:
            return
        on = f" with {where}.{when}=true" if when else ""
        alone = f"{where}.{when}=false" if when else "algo=ppo (a learned value baseline) or algo=reinforce_pp"
        raise UserError(f"{where}.num_generations={generations}{on}: {baseline}, so one completion a prompt has "
                        f"nothing to be compared with and nothing is learned. Fix: {where}.num_generations=2 or more "
                        f"(8 is common); for one completion a prompt, {alone}")

    return check


def group_centered(rewards: Tensor, num_generations: int) -> Tensor:
    """``r_i − mean(group of i)``, ``[B]`` → ``[B]``: the GRPO baseline before any scaling (0 for equal rewards)."""
    return _centered(_groups(rewards, num_generations), dim=1).reshape(-1)


def scale_by_group_std(rewards: Tensor, num_generations: int) -> Tensor:
    """GRPO (Shao et al. 2024, arXiv:2402.03300), TRL's ``scale_rewards="group"``: ``(r_i − mean_g) / (std_g + 1e-4)``.

    ``rewards [B]`` → advantages ``[B]``; ``std_g`` is the group's sample standard deviation (``torch.std``, as TRL).
    A group whose rewards are all equal gets advantages 0.
    """
    return group_centered(rewards, num_generations) / (_group_std(rewards, num_generations) + STD_EPS)


scale_by_group_std.divides_by_group_std = True  # read by GRPO's check of lightly weighted rewards (grpo.py)


def scale_by_batch_std(rewards: Tensor, num_generations: int) -> Tensor:
    """TRL's ``scale_rewards="batch"`` (after Liu et al. 2025, arXiv:2508.08221): ``(r_i − mean_g) / (std_B + 1e-4)``.

    The group mean is the baseline; the scale is the sample standard deviation of all ``B`` rewards of the batch (the
    caller gathers the rewards of every process first, so that the batch is the global one). ``[B]`` → ``[B]``.
    """
    std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return group_centered(rewards, num_generations) / (std + STD_EPS)


def no_scaling(rewards: Tensor, num_generations: int) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), TRL's ``scale_rewards="none"``: ``r_i − mean_g``, no division."""
    return group_centered(rewards, num_generations)


def leave_one_out(rewards: Tensor, num_generations: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): ``r_i − mean_{j≠i in group} r_j``, ``[B]`` → ``[B]``.

    Equal to ``G/(G−1) · (r_i − mean_g)``. Needs ``G ≥ 2``: with one completion per prompt there is no other sample
    to form the baseline from.
    """
    if num_generations < 2:
        raise UserError(f"the leave-one-out baseline needs at least 2 completions per prompt, got num_generations="
                        f"{num_generations}: the baseline of a completion is the mean reward of the others of its "
                        "prompt. Fix: num_generations=2 or more (4 is common)")
    return group_centered(rewards, num_generations) * (num_generations / (num_generations - 1))


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1 (over all, or along ``dim``); 0 where nothing is counted."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x − mean) / sqrt(var + eps)`` with mean and variance over the masked entries only, as PPO's whitening.

    ``values``, ``mask``: any equal shapes (``[B, T]`` for token advantages). The variance is the sample variance
    (Bessel-corrected, as TRL's ``masked_var``); one masked entry has variance 0. ``shift_mean=False`` adds the mean
    back (rescale only: TRL whitens PPO's rewards that way). Entries outside the mask are 0 in the result.
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    centered = (values - mean) * mask
    var = (centered**2).sum() / (count - 1).clamp(min=1)
    return whiten_with(values, mask, mean, var, shift_mean, eps)


def whiten_with(values: Tensor, mask: Tensor, mean: Tensor | float, var: Tensor | float, shift_mean: bool = True,
                eps: float = 1e-8) -> Tensor:
    """:func:`masked_whiten` with a given mean and variance (e.g. over every process's tokens:
    :func:`rlhf.algos.policy_gradient.global_masked_moments`); 0 outside the mask."""
    mask = mask.to(values.dtype)
    whitened = (values - mean) * torch.rsqrt(torch.as_tensor(var, dtype=values.dtype) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def reinforce_pp(rewards: Tensor, num_generations: int = 1) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262), outcome rewards: advantages whitened over the global batch.

    ``rewards [B]`` (a score per completion, any KL already in it; the caller gathers every process's rewards) →
    ``(r_i − mean_B) / (std_B + 1e-4)``. No per-prompt baseline: the batch statistics replace the critic. With
    ``num_generations = G > 1`` this is the paper's REINFORCE++-baseline: the group mean is subtracted first, then
    the result is whitened over the batch. For token-level rewards use :func:`reinforce_pp_tokens`.
    """
    centered = group_centered(rewards, num_generations) if num_generations > 1 else rewards
    std = centered.std() if centered.numel() > 1 else centered.new_zeros(())
    return _centered(centered, dim=0) / (std + STD_EPS)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = Σ_{k≥t} γ^{k−t} r_k`` over each row's masked tokens, ``[B, T]`` → ``[B, T]`` (0 at padding)."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = (token_rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def reinforce_pp_tokens(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (arXiv:2501.03262) with token rewards (score at the last token, ``−β·KL`` at every token; see
    :func:`rlhf.algos.reward_shaping.kl_penalized_rewards`): the discounted returns, whitened over every masked token
    of the batch (:func:`masked_whiten`). ``[B, T]`` → ``[B, T]``, 0 at padding."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95,
        bootstrap_values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015, arXiv:1506.02438), PPO's ``gamma`` and ``lam``.

    ``token_rewards``, ``values``, ``mask``: ``[B, T]``, right-padded (each row's mask is ones, then zeros).
    ``δ_t = r_t + γ V_{t+1} − V_t`` and ``A_t = δ_t + γλ A_{t+1}``, where after a row's last token ``V_{t+1}`` is
    ``bootstrap_values [B]`` (the value of the state after it, for a completion cut at ``max_completion_length``) or
    0 (the completion ended: TRL's PPO always uses 0). Returns ``(advantages, returns)``, each ``[B, T]``, with
    ``returns = advantages + values`` (the value head's target) and 0 at padding. Not whitened: see
    :func:`masked_whiten`.
    """
    mask = mask.to(values.dtype)
    if (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError("gae needs right-padded masks (each row ones, then zeros)")
    batch, length = values.shape
    after_last = values.new_zeros(batch) if bootstrap_values is None else bootstrap_values.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_advantage = values.new_zeros(batch)
    for t in reversed(range(length)):
        inside_next = mask[:, t + 1] if t + 1 < length else values.new_zeros(batch)
        next_value = values[:, t + 1] * inside_next if t + 1 < length else values.new_zeros(batch)
        next_value = next_value + after_last * (1 - inside_next)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage * inside_next) * mask[:, t]
        advantages[:, t] = next_advantage
    return advantages, (advantages + values) * mask


def groups_with_reward_variance(rewards: Tensor, num_generations: int, atol: float = 0.0) -> Tensor:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): which groups to keep, ``[B]`` → bool ``[B/G]``.

    A group is kept when its rewards are not all equal (``max − min > atol``): a group of equal rewards has zero
    advantage everywhere and gives no gradient. Indices of the kept groups: ``mask.nonzero().squeeze(1)``; a mask
    over completions: :func:`completions_in_kept_groups`.
    """
    grouped = _groups(rewards, num_generations)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > atol


def completions_in_kept_groups(rewards: Tensor, num_generations: int, atol: float = 0.0) -> Tensor:
    """:func:`groups_with_reward_variance`, repeated to one bool per completion, ``[B]``."""
    return groups_with_reward_variance(rewards, num_generations, atol).repeat_interleave(num_generations)


def frac_reward_zero_std(rewards: Tensor, num_generations: int, atol: float = 0.0) -> Tensor:
    """TRL's ``frac_reward_zero_std``: the fraction of groups whose rewards are all equal, a scalar in [0, 1]."""
    return (~groups_with_reward_variance(rewards, num_generations, atol)).float().mean()


MINOR_WEIGHT = 0.25
"""A reward function weighs little when its weight (in absolute value, above 0) is at most this fraction of the
largest weight: under :func:`scale_by_group_std` it may then count for more than its weight says
(:func:`minor_rewards_alone`)."""


def light_weights(weights: Sequence[float] | None, count: int, minor: float = MINOR_WEIGHT) -> list[bool]:
    """Which of ``count`` reward functions weigh little: ``0 < |w_f| ≤ minor · max |w|`` (``weights=None``: all 1,
    none light)."""
    sizes = [1.0] * count if weights is None else [abs(float(w)) for w in weights]
    return [0 < size <= minor * max(sizes) for size in sizes]


def minor_rewards_alone(per_function: Tensor, weights: Sequence[float] | None, num_generations: int,
                        minor: float = MINOR_WEIGHT) -> Tensor:
    """Where lightly weighted reward functions alone make a group's rewards differ, ``[B, F]`` → bool ``[B/G, F]``.

    ``per_function [B, F]``: each reward function's values (NaN where one does not apply, which the weighted sum
    counts as 0), in groups of ``num_generations``; ``weights [F]`` (``None``: all 1). Entry ``(g, f)`` is true where
    function ``f`` weighs little (``0 < |w_f| ≤ minor · max |w|``) and its values differ within group ``g``, while
    every function that does not weigh little is equal within ``g`` and the weighted sum differs (several light
    functions may differ in one group: each is flagged). In such a group a standard deviation by group (GRPO's
    ``scale_rewards=group``) is the light functions' alone, so dividing by it gives
    the light function's differences advantages of about ±1, as large as a heavy function's right-or-wrong would
    get in another group: its small weight has no effect there. ``.any(1)`` is which groups, ``.any(0)`` which
    functions.
    """
    rows, count = per_function.shape
    if num_generations < 1 or rows % num_generations:
        raise ValueError(f"{rows} rows of rewards do not split into groups of num_generations={num_generations}")
    grouped = per_function.nan_to_num(0.0).reshape(rows // num_generations, num_generations, count)
    weight = per_function.new_ones(count) if weights is None else per_function.new_tensor(list(weights))
    light = torch.tensor(light_weights(weights, count, minor), device=per_function.device)
    differs = grouped.amax(1) != grouped.amin(1)  # [B/G, F]: the function's values differ within the group
    total = (grouped * weight).sum(-1)  # the weighted sum, as reward_shaping.weighted_rewards forms it
    total_differs = total.amax(1) != total.amin(1)
    heavy_equal = ~(differs & ~light & (weight != 0)).any(1)
    return differs & light & (heavy_equal & total_differs).unsqueeze(1)


GroupAdvantage = Callable[[Tensor, int], Tensor]

SCALE_REWARDS: dict[str, GroupAdvantage] = {
    "group": scale_by_group_std,
    "batch": scale_by_batch_std,
    "none": no_scaling,
}
"""TRL's ``scale_rewards`` values → the advantage function (for translating a TRL config; a run's config names the
function by ``_target_``). TRL's ``True``/``False`` are ``"group"``/``"none"``."""
