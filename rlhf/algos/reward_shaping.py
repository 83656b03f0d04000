"""What happens to rewards before they become advantages: running statistics of the scores (checkpointed, merged over
processes), PPO's score scaling/normalization/clipping, the KL penalty in the per-token reward, the fixed and
adaptive KL controllers, and the weighted sum of several reward functions.

Shapes: ``B`` completions, ``T`` completion tokens, ``F`` reward functions; ``mask [B, T]`` is 1 on completion
tokens, right-padded. Option names are TRL's (``PPOConfig``'s former ``use_score_scaling``, ``use_score_norm``,
``score_clip``, ``init_kl_coef``, ``target``, ``horizon``; ``GRPOConfig``'s ``reward_weights``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits

# ---- running moments: (count, mean, M2), M2 = Σ (x − mean)² ----


Moments = tuple[float, float, float]
"""``(count, mean, M2)`` of a set of numbers, M2 = Σ (x − mean)²."""


def batch_moments(x: Tensor) -> Moments:
    """``(count, mean, M2)`` of all entries of ``x``, in float64: what one process contributes to the merge."""
    flat = x.detach().reshape(-1).double()
    count = flat.numel()
    if count == 0:
        return 0.0, 0.0, 0.0
    mean = flat.mean()
    return float(count), float(mean), float(((flat - mean) ** 2).sum())


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of the union of two sets (Chan, Golub & LeVeque 1979): ``n = n_a + n_b``, ``δ = mean_b − mean_a``,
    ``mean = mean_a + δ n_b / n``, ``M2 = M2_a + M2_b + δ² n_a n_b / n``."""
    (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = a, b
    if n_b == 0 or n_a == 0:
        return (float(n_a), float(mean_a), float(m2_a)) if n_b == 0 else (float(n_b), float(mean_b), float(m2_b))
    total = n_a + n_b
    delta = mean_b - mean_a
    return total, mean_a + delta * n_b / total, m2_a + m2_b + delta * delta * n_a * n_b / total


def combine_moments(counts: Tensor, means: Tensor, m2s: Tensor) -> Moments:
    """The moments of the union of ``P`` sets from each one's ``(count, mean, M2)``, given as three ``[P]`` tensors.

    For processes: all-gather each one's :func:`batch_moments` and call this; every process gets the same result,
    equal (to rounding) to :func:`batch_moments` of all their numbers together.
    """
    merged: Moments = (0.0, 0.0, 0.0)
    for moments in zip(counts.double().tolist(), means.double().tolist(), m2s.double().tolist()):
        merged = merge_moments(merged, moments)
    return merged


class RunningMoments:
    """The running mean and standard deviation of every score seen (PPO's score scaling), exact in float64.

    ``update(scores)`` adds a batch; with several processes, all-gather each one's :func:`batch_moments`, combine
    them (:func:`combine_moments`) and pass the result to ``update_from_moments`` on every process. ``state_dict``
    holds the three numbers as float64 tensors, so a resumed run continues bit for bit.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update_from_moments(self, count: float, mean: float, m2: float) -> None:
        self.count, self.mean, self.m2 = merge_moments((self.count, self.mean, self.m2), (count, mean, m2))

    def update(self, scores: Tensor) -> None:
        self.update_from_moments(*batch_moments(scores))

    @property
    def std(self) -> float:
        """The sample standard deviation (ddof = 1, as TRL's ``RunningMoments``); 1 before two scores are seen (so
        scaling leaves the first score as it is)."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count >= 2 else 1.0

    def state_dict(self) -> dict[str, Tensor]:
        return {name: torch.tensor(getattr(self, name), dtype=torch.float64) for name in ("count", "mean", "m2")}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.count, self.mean, self.m2 = (float(state[name].item()) for name in ("count", "mean", "m2"))


# ---- PPO's score post-processing (TRL's former PPOConfig; applied after the running moments are updated) ----

SCALE_EPS = 1e-8


def score_scaling(scores: Tensor, std: float) -> Tensor:
    """TRL's ``use_score_scaling``: ``scores / (σ + 1e-8)``, ``σ`` the running standard deviation. ``[B]`` → ``[B]``."""
    return scores / (std + SCALE_EPS)


def score_norm(scores: Tensor, mean: float, std: float) -> Tensor:
    """TRL's ``use_score_norm`` (with scaling): ``(scores − μ) / (σ + 1e-8)`` with the running mean and std."""
    return (scores - mean) / (std + SCALE_EPS)


@limits(score_clip=Range(gt=0, meaning="scores are clipped to [-score_clip, score_clip]", fix=5.0))
def score_clip(scores: Tensor, score_clip: float) -> Tensor:
    """TRL's ``score_clip``: ``clamp(scores, −c, c)``, after scaling or normalization. ``[B]`` → ``[B]``."""
    return scores.clamp(-score_clip, score_clip)


def kl_penalized_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float | Tensor) -> Tensor:
    """PPO's per-token reward with the KL penalty (Ziegler et al. 2019, arXiv:1909.08593; Stiennon et al. 2020).

    ``scores [B]``, ``kl [B, T]`` (a per-token estimator of :mod:`rlhf.algos.policy_losses`, e.g. ``kl_k1``),
    ``mask [B, T]`` right-padded → ``[B, T]``: ``−kl_coef · kl_t`` on every completion token, plus the score on each
    row's last completion token; 0 on padding.
    """
    mask = mask.to(kl.dtype)
    lengths = mask.sum(-1).long()
    if (lengths == 0).any():
        raise ValueError("kl_penalized_rewards: a completion has no token to put its score on (empty mask row)")
    rewards = -kl_coef * kl * mask
    last = (lengths - 1).unsqueeze(-1)
    return rewards.scatter_add(-1, last, scores.to(rewards.dtype).unsqueeze(-1))


# ---- KL coefficient controllers ----


class KLController:
    """The KL coefficient ``value`` of the per-token reward, updated after each rollout; saved in checkpoints."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: the mean KL per completion of the last rollout; ``n_steps``: its number of completions."""

    def state_dict(self) -> dict[str, Tensor]:
        return {"value": torch.tensor(self.value, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.value = float(state["value"].item())


@limits(kl_coef=Range(ge=0, meaning="the KL penalty's coefficient in the reward; 0.05 is common", fix=0.05))
class FixedKLController(KLController):
    """A constant KL coefficient (TRL's PPO ``kl_coef``); ``update`` changes nothing."""

    def __init__(self, kl_coef: float = 0.05) -> None:
        self.value = float(kl_coef)


@limits(init_kl_coef=Range(gt=0, meaning="the KL coefficient at the start", fix=0.2),
        target=Range(gt=0, meaning="the KL (nats per completion) the controller steers to", fix=6.0),
        horizon=Range(gt=0, meaning="samples over which the coefficient may change by about e^±0.2", fix=10000))
class AdaptiveKLController(KLController):
    """Ziegler et al. 2019 (arXiv:1909.08593, §2.2): ``β ← β (1 + clip(KL/target − 1, −0.2, 0.2) · n / horizon)``.

    ``n`` is the number of samples (completions) since the last update; the KL is measured per completion. TRL's
    former ``adap_kl_ctrl`` with ``init_kl_coef``, ``target``, ``horizon``.
    """

    def __init__(self, init_kl_coef: float = 0.2, target: float = 6.0, horizon: float = 10000) -> None:
        self.value = float(init_kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ---- several reward functions ----


def weighted_rewards(rewards_per_func: Tensor, reward_weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The reward that trains the policy and each function's own mean, as TRL's GRPO computes them.

    ``rewards_per_func [B, F]``: one column per reward function, NaN where a function does not apply to a sample
    (e.g. a math checker on a code prompt). ``reward_weights [F]`` (``None``: all 1). Returns
    ``(reward [B], per_function_mean [F])``: ``reward = nansum_f(w_f · r_f)`` (NaN entries count as 0; a sample no
    function applies to gets 0), and ``per_function_mean`` the unweighted NaN-ignoring mean of each column, logged
    as ``rewards/<fn>/mean`` beside ``reward`` (NaN for a column with no value).
    """
    num_functions = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = torch.ones(num_functions, dtype=rewards_per_func.dtype)
    if reward_weights.numel() != num_functions:
        raise UserError(f"reward_weights has {reward_weights.numel()} values for {num_functions} reward functions. "
                        f"Fix: one weight per reward function, in their order (e.g. [{','.join(['1.0'] * num_functions)}])")
    weights = reward_weights.to(rewards_per_func)
    return (rewards_per_func * weights).nansum(dim=1), rewards_per_func.nanmean(dim=0)
