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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor

from rlhf.algos.advantages import (
    completions_in_kept_groups,
    frac_reward_zero_std,
    masked_mean,
    scale_by_group_std,
)
from rlhf.algos.base import PROMPT_TOKENS, selective_log_softmax
from rlhf.algos.online import (
    COMPLETION_TOKENS,
    GENERATIONS,
    ITERATIONS,
    STEPS_PER_GENERATION,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    OnlineAlgorithm,
    concat_samples,
    training_batch,
)
from rlhf.algos.policy_losses import (
    EPSILON,
    clipped_surrogate,
    drop_truncated,
    entropy_from_logits,
    grpo_loss,
    kl_k3,
    token_log_ratio,
)
from rlhf.errors import UserError
from rlhf.models.reference import FrozenCopy, Reference, disable_dropout
from rlhf.validate import Range, limits


@limits(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, max_completion_length=COMPLETION_TOKENS,
        max_prompt_length=PROMPT_TOKENS, num_generations=GENERATIONS, num_iterations=ITERATIONS,
        steps_per_generation=STEPS_PER_GENERATION, epsilon=EPSILON,
        epsilon_high=Range(gt=0, meaning="DAPO's clip-higher upper range (0.28 in the paper); null is epsilon",
                           fix=0.28),
        beta=Range(ge=0, meaning="the weight of the KL to the reference in the loss; 0 holds no reference", fix=0.0),
        log_completions_every_steps=Range(ge=0, integer=True, meaning="steps between samples.jsonl entries; 0 "
                                          "is never", fix=50),
        num_completions_to_print=Range(ge=0, integer=True, meaning="completions written each time", fix=4),
        max_sampling_batches=Range(ge=1, integer=True, meaning="prompt batches dynamic sampling may draw per "
                                   "rollout", fix=4))
class GRPO(OnlineAlgorithm):
    """GRPO on ``prompt`` rows.

    Args (TRL's ``GRPOConfig`` names where it has one):
        num_generations: completions per prompt (a group); ``train.per_device_batch_size`` counts prompts.
        beta: weight of the KL to the reference in the loss; 0 (the default, as TRL's) builds no reference.
        num_iterations: optimization passes over each rollout (> 1: the ratio to the sampling policy moves).
        steps_per_generation: micro-batches each rollout is split into (whole groups).
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``None``: ``epsilon``).
        scale_rewards: the advantage function ``(rewards [B], num_generations) -> [B]`` (TRL's group/batch/none:
            ``scale_by_group_std``, ``scale_by_batch_std`` (over this process's rollout), ``no_scaling``).
        loss_type: the aggregation ``(per_token_loss, mask) -> loss`` (``grpo_loss``, ``bnpo_loss``, ``dapo_loss``
            (over the micro-batch's tokens), ``dr_grpo_loss``).
        importance_sampling_level: the log-ratio function (``token_log_ratio``; GSPO's ``sequence_log_ratio``).
        kl_estimator: ``(logps, ref_logps) -> [B, T]`` (``kl_k1``, ``kl_k2``, ``kl_k3``), used when ``beta > 0``.
        mask_truncated_completions: completions without EOS add nothing to the loss.
        dynamic_sampling: DAPO's: drop groups whose rewards are all equal and sample more prompts until the batch
            is full, at most ``max_sampling_batches`` prompt batches per rollout; then the batch is filled up
            with dropped groups (advantage 0). With several processes each draws as many batches as the one that
            needs most (generation is a collective), keeping its first kept groups.
        temperature, top_p, top_k, max_completion_length: sampling of training completions (held-out ones are
            greedy); ``max_prompt_length``: prompts keep their last tokens.
        seed: the run's seed, from which every prompt batch's sampling seed derives.
        reward_funcs, reward_weights, reward_columns: the reward functions by name (:mod:`rlhf.rewards`), one
            weight each (``None``: all 1), and the dataset columns passed to them.
        reference: the :class:`~rlhf.models.reference.Reference` strategy that builds the reference (``beta > 0``).
        disable_dropout: no dropout in policy and reference, as TRL does.
        log_completions_path, log_completions_every_steps, num_completions_to_print: every N steps (and at the
            first), the first completions of the step's rollout with their rewards, appended to this JSON-lines
            file (``samples.jsonl`` in the run folder; ``None``: none).
    """

    def __init__(
        self,
        num_generations: int = 8,
        beta: float = 0.0,
        num_iterations: int = 1,
        steps_per_generation: int = 1,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        scale_rewards: Callable[[Tensor, int], Tensor] = scale_by_group_std,
        loss_type: Callable[..., Tensor] = grpo_loss,
        importance_sampling_level: Callable[[Tensor, Tensor, Tensor], Tensor] = token_log_ratio,
        kl_estimator: Callable[[Tensor, Tensor], Tensor] = kl_k3,
        mask_truncated_completions: bool = False,
        dynamic_sampling: bool = False,
        max_sampling_batches: int = 4,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_completion_length: int = 16,
        max_prompt_length: int | None = 512,
        seed: int = 0,
        reward_funcs: Mapping[str, Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_columns: Sequence[str] = (),
        reference: Reference | None = None,
        disable_dropout: bool = True,
        log_completions_path: str | None = None,
        log_completions_every_steps: int = 50,
        num_completions_to_print: int = 4,
    ) -> None:
        self._init_online(temperature=temperature, top_p=top_p, top_k=top_k,
                          max_completion_length=max_completion_length, max_prompt_length=max_prompt_length,
                          num_generations=num_generations, num_iterations=num_iterations,
                          steps_per_generation=steps_per_generation, seed=seed, reward_funcs=reward_funcs,
                          reward_weights=reward_weights, reward_columns=reward_columns,
                          log_completions_path=log_completions_path,
                          log_completions_every_steps=log_completions_every_steps,
                          num_completions_to_print=num_completions_to_print)
        self.beta, self.epsilon, self.epsilon_high = beta, epsilon, epsilon_high
        self.scale_rewards, self.loss_type = scale_rewards, loss_type
        self.importance_sampling_level, self.kl_estimator = importance_sampling_level, kl_estimator
        self.mask_truncated_completions = mask_truncated_completions
        self.dynamic_sampling, self.max_sampling_batches = dynamic_sampling, max_sampling_batches
        self.reference = reference if reference is not None else FrozenCopy()
        self.disable_dropout = disable_dropout

    def setup(self, policy, tokenizer) -> None:
        super().setup(policy, tokenizer)
        if self.disable_dropout:
            disable_dropout(policy)
        if self.beta > 0:
            reference = self.reference(policy, tokenizer)
            if reference is None:
                raise UserError(f"algo.beta={self.beta} needs a reference model, but algo/reference builds none. "
                                "Fix: algo/reference=copy, or algo.beta=0")
            self.frozen = {"reference": reference}
        else:
            self.frozen = {}  # beta = 0: no reference is built or held

    @property
    def old_logps_needed(self) -> bool:
        """Whether the sampling policy differs from the trained one when a micro-batch is served."""
        return self.num_iterations > 1 or self.steps_per_generation > 1

    # ---- rollout -----------------------------------------------------------------------------------------------------
    def rollout(self, model, prompts: dict[str, Any], seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        group = self.num_generations
        sampled = self.sample(model, prompts, group, seed)
        reward, per_function = self.score(prompts, sampled["completions"], group)
        metrics = self.reward_metrics(reward, per_function, sampled)
        metrics["frac_reward_zero_std"] = frac_reward_zero_std(reward, group)
        samples = {k: sampled[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           "truncated")}
        samples["rewards"] = reward
        samples["advantages"] = self.scale_rewards(reward, group)
        batch = training_batch(samples)
        with torch.no_grad():  # the unwrapped policy: no collective of a wrapper (DDP's buffer broadcast)
            if self.old_logps_needed:
                samples["old_logps"] = completion_logps(extract_model_from_parallel(model), batch, False)[0]
            if self.beta > 0:
                samples["ref_logps"] = completion_logps(self.frozen["reference"], batch, False)[0]
        return samples, metrics

    def collect(self, model, next_prompts) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One rollout; with ``dynamic_sampling``, of groups whose rewards differ, drawing prompt batches until the
        batch holds as many groups as one batch of prompts (or ``max_sampling_batches`` were drawn)."""
        if not self.dynamic_sampling:
            return self.rollout(model, *next_prompts())
        group, kept, dropped, all_metrics, wanted, have = self.num_generations, [], [], [], None, 0
        # Every process draws as many batches as the one that needs most: generation is a collective with several.
        while len(all_metrics) < self.max_sampling_batches and (wanted is None or _any_process(have < wanted, model)):
            samples, metrics = self.rollout(model, *next_prompts())
            all_metrics.append(metrics)
            wanted = wanted or samples["rewards"].numel()
            keep = completions_in_kept_groups(samples["rewards"], group)
            kept.append({k: v[keep] for k, v in samples.items()})
            dropped.append({k: v[~keep] for k, v in samples.items()})
            have += int(keep.sum())
        merged = concat_samples(kept + dropped, self.pad_id)  # dropped groups (advantage 0) fill up a short batch
        merged = {k: v[:wanted] for k, v in merged.items()}
        metrics = {k: torch.stack([m[k] for m in all_metrics]).mean() for k in all_metrics[0]}
        metrics["sampling_batches"] = torch.tensor(float(len(all_metrics)))
        return merged, metrics

    # ---- the loss ----------------------------------------------------------------------------------------------------
    def loss(self, model, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        token_logps, mask, logits = completion_logps(model, batch, with_logits=True)
        old = batch["old_logps"] if "old_logps" in batch else token_logps.detach()
        log_ratio = self.importance_sampling_level(token_logps, old, mask)
        surrogate = clipped_surrogate(log_ratio, batch["advantages"], self.epsilon, self.epsilon_high)
        per_token = surrogate.per_token_loss
        metrics: dict[str, Tensor] = {}
        if self.beta > 0:
            kl = self.kl_estimator(token_logps, batch["ref_logps"])
            per_token = per_token + self.beta * kl
            metrics["kl"] = masked_mean(kl.detach(), mask)
        loss_mask = drop_truncated(mask, batch["truncated"]) if self.mask_truncated_completions else mask
        loss = self.loss_type(per_token, loss_mask)
        with torch.no_grad():
            metrics["entropy"] = masked_mean(entropy_from_logits(logits.detach()), mask)
        metrics.update({k: v for k, v in surrogate.clip_metrics(mask).items()})
        return loss, {"loss": loss.detach(), **batch.get("rollout_metrics", {}), **metrics}


def _any_process(flag: bool, model) -> bool:
    """``flag`` OR-ed over every process (one all-reduce on the policy's device; just ``flag`` in one process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    value = torch.tensor([float(flag)], device=next(extract_model_from_parallel(model).parameters()).device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item() > 0)


def completion_logps(model, batch: dict[str, Tensor], with_logits: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(token_logps [N, C], mask [N, C], logits [N, C, V] or None)`` of the completion tokens of a
    :func:`~rlhf.algos.online.training_batch` (prompts ``P`` tokens, left-padded; completions after them)."""
    prompt = int(batch["prompt_length"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, prompt - 1:-1].float()
    labels = batch["input_ids"][:, prompt:]
    mask = batch["attention_mask"][:, prompt:]
    return selective_log_softmax(logits, labels) * mask, mask, logits if with_logits else None
