"""REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740; Kool et al. 2019).

Per prompt, ``num_generations`` completions are sampled; each one's baseline is the mean reward of the *others* of
its prompt (:func:`rlhf.algos.advantages.leave_one_out`), an unbiased baseline that needs no critic. The KL to the
reference is in the reward by default, as in the paper and TRL's ``RLOOTrainer``: ``r − beta · Σ_t KL_t`` with the
per-token estimate of the sampling policy (``kl_estimator``, k1 by default); ``kl_in_reward=false`` puts
``beta · KL`` in the loss instead, as GRPO does, with k2 or k3 (k1's expected gradient is zero there: refused). The loss is the shared clipped surrogate
(:class:`rlhf.algos.policy_gradient.PolicyGradient`): at ``num_iterations=1`` it is REINFORCE with the baseline.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf.algos.advantages import STD_EPS, compares_within_a_group, leave_one_out
from rlhf.algos.policy_gradient import PolicyGradient, all_gather_rows
from rlhf.core.limits import limits


@limits(compares_within_a_group("each completion's baseline is the mean reward of the other completions of its "
                                "prompt"))
class RLOO(PolicyGradient):
    """RLOO on ``prompt`` rows. Options as :class:`~rlhf.algos.grpo.GRPO`'s (TRL's names), plus:

    Args:
        normalize_advantages: whiten the leave-one-out advantages over the global batch (every process's rollout),
            TRL's ``normalize_advantages``.
        kl_in_reward: ``True`` (the default in ``conf/algo/rloo.yaml``): ``beta`` times the completion's summed KL
            is subtracted from its reward before the baseline; ``False``: added to the loss per token.
    """

    def __init__(self, normalize_advantages: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.normalize_advantages = normalize_advantages

    def advantages(self, rewards: Tensor, token_kl: Tensor | None, mask: Tensor, model) -> Tensor:
        if token_kl is not None:
            rewards = rewards - token_kl.sum(-1)
        advantages = leave_one_out(rewards, self.num_generations)
        if not self.normalize_advantages:
            return advantages
        everyone, mine = all_gather_rows(advantages, model)
        std = everyone.std() if everyone.numel() > 1 else everyone.new_zeros(())
        return ((everyone - everyone.mean()) / (std + STD_EPS))[mine]
