"""REINFORCE++ (Hu 2025, arXiv:2501.03262): REINFORCE with PPO's tricks and no critic.

The score of a completion is put on its last token and ``−beta · KL_t`` (the per-token estimate of the sampling
policy to the reference, ``kl_estimator``, k1 by default) on every token
(:func:`rlhf.algos.reward_shaping.kl_penalized_rewards`); each token's return is the discounted sum of what follows
(``gamma``, 1 by default); the advantages are the returns whitened over every completion token of the global batch
(all processes' rollouts: :func:`rlhf.algos.policy_gradient.global_masked_moments`) — the batch statistics replace
the critic. ``group_baseline=true`` subtracts each prompt's mean score first (the paper's REINFORCE++-baseline, for
``num_generations > 1``). The loss is the shared clipped surrogate (:class:`~rlhf.algos.policy_gradient.PolicyGradient`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf.algos.advantages import compares_within_a_group, discounted_returns, group_centered, whiten_with
from rlhf.algos.policy_gradient import PolicyGradient, global_masked_moments
from rlhf.algos.reward_shaping import kl_penalized_rewards
from rlhf.core.limits import Range, limits


@limits(compares_within_a_group("the group baseline subtracts the mean score of its prompt's completions",
                                when="group_baseline"),
        gamma=Range(gt=0, le=1, meaning="the discount of later token rewards in a return; 1 is the paper's", fix=1.0))
class ReinforcePP(PolicyGradient):
    """REINFORCE++ on ``prompt`` rows. Options as :class:`~rlhf.algos.grpo.GRPO`'s (TRL's names), plus:

    Args:
        group_baseline: subtract the mean score of each prompt's completions before the KL and the whitening
            (REINFORCE++-baseline); ``False``: the paper's REINFORCE++, no per-prompt baseline.
        gamma: the discount of the token returns.
        kl_in_reward: ``True`` (the default in ``conf/algo/reinforce_pp.yaml``): the KL is a per-token reward;
            ``False``: ``beta`` times it is added to the loss (with k2 or k3: k1 is refused there).
    """

    def __init__(self, group_baseline: bool = False, gamma: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group_baseline, self.gamma = group_baseline, gamma

    def advantages(self, rewards: Tensor, token_kl: Tensor | None, mask: Tensor, model) -> Tensor:
        scores = group_centered(rewards, self.num_generations) if self.group_baseline else rewards
        kl = token_kl if token_kl is not None else rewards.new_zeros(mask.shape)
        returns = discounted_returns(kl_penalized_rewards(scores, kl, mask, 1.0), mask, self.gamma)
        count, mean, m2 = global_masked_moments(returns, mask, model)
        return whiten_with(returns, mask, mean, m2 / max(count - 1, 1))
