"""Group Relative Policy Optimization (Shao et al. 2024, arXiv:2402.03300) and its variants by config.

Per prompt, ``num_generations`` completions are sampled and scored; each completion's advantage is its reward
against its group's (``scale_rewards``: :mod:`rlhf.algos.advantages`); the loss is PPO's clipped surrogate of the
importance ratio (``importance_sampling_level``: token, or GSPO's sequence), optionally plus ``beta`` times a KL
estimate to a frozen reference (``kl_estimator``), aggregated by ``loss_type`` (:mod:`rlhf.algos.policy_losses`).
Options are named as TRL's ``GRPOConfig``; the alternatives are functions chosen by ``_target_``
(``conf/algo/{scale_rewards,loss_type,importance_sampling_level,kl_estimator}/``), not strings.

With ``num_iterations=1`` (and ``steps_per_generation=1``) the policy that sampled is the one being trained, the
ratio is exactly 1 and the loss's value is ``-mean(advantages)`` ≈ 0 by construction (group-centred advantages):
watch ``reward`` and ``eval/reward``, not ``loss``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from rlhf.algos.advantages import compares_within_a_group, scale_by_group_std
from rlhf.algos.policy_gradient import PolicyGradient, all_gather_rows
from rlhf.core.limits import limits


@limits(compares_within_a_group("each completion's advantage is its reward against its prompt's group mean"))
class GRPO(PolicyGradient):
    """GRPO on ``prompt`` rows.

    Args (TRL's ``GRPOConfig`` names where it has one):
        num_generations: completions per prompt (a group); ``train.per_device_batch_size`` counts prompts.
        beta: weight of the KL to the reference in the loss; 0 (the default, as TRL's) builds no reference.
        kl_in_reward: subtract ``beta`` times the completion's summed KL estimate from its reward instead.
        num_iterations: optimization passes over each rollout (> 1: the ratio to the sampling policy moves).
        steps_per_generation: micro-batches each rollout is split into (whole groups).
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``None``: ``epsilon``).
        scale_rewards: the advantage function ``(rewards [B], num_generations) -> [B]`` (TRL's group/batch/none:
            ``scale_by_group_std``, ``scale_by_batch_std`` (over the rollouts of every process), ``no_scaling``).
        loss_type: the aggregation ``(per_token_loss, mask) -> loss`` (``grpo_loss``, ``bnpo_loss``, ``dapo_loss``
            (÷ the mean completion tokens of a micro-batch of the rollout, all processes), ``dr_grpo_loss``).
        importance_sampling_level: the log-ratio function (``token_log_ratio``; GSPO's ``sequence_log_ratio``).
        kl_estimator: ``(logps, ref_logps) -> [B, T]`` (``kl_k1``, ``kl_k2``, ``kl_k3``), used when ``beta > 0``.
            In the loss (``kl_in_reward=false``) only k2's gradient is that of KL(π‖ref), k3's is that of
            KL(ref‖π) and k1's is zero in expectation (refused there); in the reward any is an estimate of the KL
            (:mod:`rlhf.algos.policy_losses`).
        mask_truncated_completions: completions without EOS add nothing to the loss.
        dynamic_sampling: DAPO's: drop groups whose rewards are all equal and sample more prompts until the batch
            is full, at most ``max_sampling_batches`` prompt batches per rollout; then the batch is filled up
            with dropped groups (advantage 0). With several processes each draws as many batches as the one that
            needs most (generation is a collective), keeping its first kept groups.
        cache_implementation: the key-value cache ``generate`` samples with (TRL's name): ``None`` (transformers'
            dynamic cache, grown token by token) or ``"static"`` (allocated once at its longest; transformers then
            compiles the decoding step on a GPU). The same completions on a CPU (tested); its speed is measured by
            ``benchmarks/gpu_check.py``'s levers.
        gather_for_generation: under ``fsdp``/``zero3``, the policy's parameters gathered once for a rollout's
            generation (the whole model in the compute dtype on each process while it generates; TRL's
            ``ds3_gather_for_generation``); ``False``: each layer gathered at every token (``synced_gpus``), for a
            model that fits only sharded. No effect under DDP or on one process.
        temperature, top_p, top_k, max_completion_length: sampling of training completions (held-out ones are
            greedy); every log-probability of the loss (policy, sampling policy, reference) and the entropy are
            of ``softmax(logits / temperature)``, the policy that sampled (``top_p``/``top_k`` truncate the
            sampling only, as in TRL); ``max_prompt_length``: prompts keep their last tokens.
        seed: the run's seed, from which every prompt batch's sampling seed derives.
        reward_funcs, reward_weights, reward_columns: the reward functions by name (:mod:`rlhf.algos.reward_funcs`), one
            weight each (``None``: all 1), and the dataset columns passed to them.
        reference: the :class:`~rlhf.models.reference.Reference` strategy that builds the reference (``beta > 0``).
        disable_dropout: no dropout in policy and reference, as TRL does.
        log_completions, log_completions_every_steps, num_completions_to_print: every N steps (and at the
            first), the first completions of the latest rollout with their rewards go to the loggers
            (``samples.jsonl`` in the run folder, a W&B table with ``logger=wandb``).
    """

    def __init__(self, scale_rewards: Callable[[Tensor, int], Tensor] = scale_by_group_std, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scale_rewards = scale_rewards

    def advantages(self, rewards: Tensor, token_kl: Tensor | None, mask: Tensor, model) -> Tensor:
        """``scale_rewards`` of every process's rewards (minus the summed KL when it is in the reward), this
        process's share."""
        if token_kl is not None:
            rewards = rewards - token_kl.sum(-1)
        everyone, mine = all_gather_rows(rewards, model)
        return self.scale_rewards(everyone, self.num_generations)[mine]
