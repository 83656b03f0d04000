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

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf.algos.advantages import (
    compares_within_a_group,
    light_weights,
    minor_rewards_alone,
    scale_by_group_std,
)
from rlhf.algos.policy_gradient import PolicyGradient, all_gather_rows
from rlhf.core.limits import limits

log = logging.getLogger(__name__)

MINOR_METRIC = "frac_groups_scaled_by_minor_reward"
"""The fraction of a rollout's groups whose reward spread is a lightly weighted function's alone, divided by its own
standard deviation (:func:`rlhf.algos.advantages.minor_rewards_alone`); logged as ``train/`` + this name."""


def minor_reward_warning(alone: Tensor, names: Sequence[str], weights: Sequence[float] | None) -> str:
    """The warning for :func:`~rlhf.algos.advantages.minor_rewards_alone`'s ``alone [G, F]`` (at least one true):
    which functions, their weights, in what fraction of the rollout's groups, why it matters and the fix."""
    weights = [1.0] * len(names) if weights is None else list(weights)
    light = [f"{name} (weight {weights[f]:g})" for f, name in enumerate(names) if alone[:, f].any()]
    heavy = [name for name, small, w in zip(names, light_weights(weights, len(names)), weights) if w and not small]
    groups, flagged = alone.shape[0], int(alone.any(1).sum())
    return (f"reward function{'s' if len(light) > 1 else ''} {', '.join(light)} alone made the rewards differ in "
            f"{flagged} of {groups} groups ({flagged / groups:.0%}) of this rollout: {', '.join(heavy)} gave each "
            "completion of those groups the same value. algo/scale_rewards=group divides each group's rewards by "
            "their own standard deviation, so there the lightly weighted function's differences get advantages of "
            f"about ±1, as large as {', '.join(heavy)}'s get in other groups: its weight does not make it count less, "
            "and it can take over the training (a brevity bonus at weight 0.1 beside correctness trained the embedded "
            "task to empty answers). Fix: "
            "algo/scale_rewards=none (Dr. GRPO: no division) or algo/scale_rewards=batch (one standard deviation for "
            f"the whole batch), which keep the weights' proportions. Said once; train/{MINOR_METRIC} follows it")


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
            With ``scale_by_group_std`` and a reward function weighted a quarter of the largest weight or less, the
            groups whose rewards differ by that function alone are counted (``frac_groups_scaled_by_minor_reward``)
            and the first time there are some the run warns once, naming the fix (:meth:`watch_rewards`).
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
            ``benchmarks/gpu_check``'s levers.
        generation: the decoder of the rollouts (:mod:`rlhf.models.decoding`): ``auto`` (what
            :data:`rlhf.core.auto_choices.CHOICES` says: transformers' ``generate`` until a GPU check measures the
            static decoder faster), ``transformers``, ``static`` (a static cache with the decoding step compiled
            into CUDA graphs on a GPU and the ends checked every few tokens), or ``static_compiled`` (its step
            compiled by inductor on a CPU too). Both give the same completions on a CPU, greedy and sampled (tested).
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
        self.minor_fractions: list[Tensor] = []  # this rollout's fractions of MINOR_METRIC (one per prompt batch)
        self.warned_minor = False

    def watch_rewards(self, per_function: Tensor, num_generations: int) -> None:
        """Where ``scale_rewards`` divides by each group's standard deviation, the fraction of groups whose rewards
        differ by a lightly weighted function alone (:func:`~rlhf.algos.advantages.minor_rewards_alone`), for
        ``train/frac_groups_scaled_by_minor_reward``, and a warning the first time there is one. Not with the KL in
        the reward (which makes every group's rewards differ) nor where no function weighs little (one function,
        equal weights)."""
        scale = getattr(self.scale_rewards, "func", self.scale_rewards)
        kl_in_reward = self.kl_in_reward and self.beta > 0
        light = light_weights(self.reward_weights, per_function.shape[1])
        if not getattr(scale, "divides_by_group_std", False) or not any(light) or kl_in_reward:
            return
        alone = minor_rewards_alone(per_function, self.reward_weights, num_generations)
        self.minor_fractions.append(alone.any(1).float().mean())
        if not self.warned_minor and bool(alone.any()) and _first_process():
            self.warned_minor = True
            log.warning(minor_reward_warning(alone, list(self.reward_funcs), self.reward_weights))

    def collect(self, model, next_prompts) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`PolicyGradient.collect`, with ``frac_groups_scaled_by_minor_reward`` where it is watched."""
        samples, metrics = super().collect(model, next_prompts)
        if self.minor_fractions:
            metrics[MINOR_METRIC] = torch.stack(self.minor_fractions).mean()
            self.minor_fractions = []
        return samples, metrics

    def advantages(self, rewards: Tensor, token_kl: Tensor | None, mask: Tensor, model) -> Tensor:
        """``scale_rewards`` of every process's rewards (minus the summed KL when it is in the reward), this
        process's share."""
        if token_kl is not None:
            rewards = rewards - token_kl.sum(-1)
        everyone, mine = all_gather_rows(rewards, model)
        return self.scale_rewards(everyone, self.num_generations)[mine]


def _first_process() -> bool:
    """Whether this is the first process (or the only one): a warning is said once, not once per process."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
