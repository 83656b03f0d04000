"""What GRPO, RLOO and REINFORCE++ share: sample, score, turn the scores into advantages, and minimize PPO's clipped
surrogate of the importance ratio, optionally with a KL to a frozen reference — in the reward or in the loss.

A subclass says only how scores become advantages (:meth:`PolicyGradient.advantages`); the rest is here:

- the rollout (:meth:`PolicyGradient.rollout`): completions sampled and scored (:class:`~rlhf.algos.online.OnlineAlgorithm`),
  the sampling policy's log-probabilities when the ratio needs them (``num_iterations > 1`` or
  ``steps_per_generation > 1``) or the KL is in the reward, the reference's when ``beta > 0``;
- the KL: with ``kl_in_reward`` the per-token estimate ``kl_estimator(π_old, π_ref)`` is subtracted from the reward
  (``beta`` times it: summed over the completion for a sequence-level advantage, per token for a token-level one) and
  the loss has none; otherwise ``beta`` times the estimate on the trained policy is added to the loss per token,
  where what counts is the estimator's gradient: k2's is that of KL(π‖ref), k3's that of KL(ref‖π), k1's zero
  (refused there; :mod:`rlhf.algos.policy_losses`);
- every log-probability (trained, sampling and reference policy) and the entropy are of ``softmax(logits /
  temperature)``, the distribution the completions were sampled from;
- statistics over the global batch: :func:`all_gather_rows` (every process's rewards, so that an advantage that
  normalizes over the batch sees all of it) and :func:`global_masked_moments` (mean and variance over every process's
  tokens), one collective each, and nothing with one process;
- the loss: :func:`~rlhf.algos.policy_losses.clipped_surrogate` with ``epsilon``/``epsilon_high``, the importance
  ratio at token or sequence level, aggregated by ``loss_type``; DAPO's dynamic sampling (:meth:`collect`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor

from rlhf.algos.advantages import completions_in_kept_groups, frac_reward_zero_std, masked_mean
from rlhf.algos.online import (
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
    kl_k1,
    kl_k3,
    token_log_ratio,
)
from rlhf.algos.reward_shaping import Moments, batch_moments, combine_moments
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.models.reference import FrozenCopy, Reference, disable_dropout
from rlhf.ops.collectives import (
    flag_on_any_process,
    gather_equal,
    gather_rows,
    processes,
    sum_over_every_process,
)
from rlhf.ops.output_layer import answer, answers, check_when, tap_output_layer, token_request
from rlhf.ops.token_logps import selective_log_softmax

_K1_IN_THE_LOSS = ("{where}: kl_in_reward=false puts the KL estimate in the loss, where k1's gradient is zero in "
                   "expectation (E_pi[grad log pi] = 0; with a per-sequence mean, only a bias of the length): the KL "
                   "weight would not pull the policy toward the reference. Fix: "
                   "{where_slash}kl_estimator=k2 (its gradient is that of KL(pi||ref); k3's is that of KL(ref||pi)), "
                   "or {where}.kl_in_reward=true (k1 as a reward, as TRL's RLOO and PPO)")


def _is_k1(estimator: Any) -> bool:
    """Whether ``estimator`` (a function, a partial of one, or a config node naming one) is :func:`kl_k1`."""
    if isinstance(estimator, dict):
        estimator = estimator.get("_target_")
    if isinstance(estimator, str):
        return estimator == f"{kl_k1.__module__}.{kl_k1.__name__}"
    return getattr(estimator, "func", estimator) is kl_k1


def _kl_weight(values: dict[str, Any]) -> float:
    """The KL's weight a config node gives: ``beta``, or PPO's ``kl_controller`` (a fixed ``kl_coef``; an adaptive
    one is positive)."""
    controller = values.get("kl_controller")
    if isinstance(controller, dict):
        return float(controller.get("kl_coef", controller.get("init_kl_coef", 1.0)))
    if controller is not None and hasattr(controller, "value"):
        return float(controller.value)
    return float(values.get("beta") or 0.0)


def kl_term_regularizes(values: dict[str, Any], where: str) -> None:
    """Refuse k1 as a KL term in the loss (``kl_in_reward=false`` with a positive weight): its expected gradient is
    zero (:mod:`rlhf.algos.policy_losses`, the KL estimators), so ``beta`` would do nothing."""
    if values.get("kl_in_reward") or not _is_k1(values.get("kl_estimator")) or _kl_weight(values) <= 0:
        return
    raise UserError(_K1_IN_THE_LOSS.format(where=where, where_slash=f"{where}/" if where else ""))


@limits(
    kl_term_regularizes,
    epsilon=EPSILON,
    epsilon_high=Range(gt=0, meaning="DAPO's clip-higher upper range (0.28 in the paper); null is epsilon", fix=0.28),
    beta=Range(ge=0, meaning="the weight of the KL to the reference; 0 holds no reference", fix=0.0),
    max_sampling_batches=Range(ge=1, integer=True, meaning="prompt batches dynamic sampling may draw per rollout",
                               fix=4))
class PolicyGradient(OnlineAlgorithm):
    """The shared policy-gradient algorithm (see the module docstring); subclasses implement :meth:`advantages` and
    take their own arguments, passing the rest (``**kwargs``) here. The arguments are GRPO's
    (:class:`rlhf.algos.grpo.GRPO` documents each); the limits above hold for every subclass."""

    def __init__(
        self,
        beta: float = 0.0,
        kl_in_reward: bool = False,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: Callable[..., Tensor] = grpo_loss,
        importance_sampling_level: Callable[[Tensor, Tensor, Tensor], Tensor] = token_log_ratio,
        kl_estimator: Callable[[Tensor, Tensor], Tensor] = kl_k3,
        mask_truncated_completions: bool = False,
        dynamic_sampling: bool = False,
        max_sampling_batches: int = 4,
        reference: Reference | None = None,
        disable_dropout: bool = True,
        fused_output_layer: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # the sampling, reward and logging options of every online algorithm
        kl_term_regularizes({"beta": beta, "kl_in_reward": kl_in_reward, "kl_estimator": kl_estimator}, "algo")
        self.fused_output_layer = check_when(fused_output_layer)
        self.beta, self.kl_in_reward = beta, kl_in_reward
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.loss_type, self.importance_sampling_level = loss_type, importance_sampling_level
        self.kl_estimator = kl_estimator
        self.mask_truncated_completions = mask_truncated_completions
        self.dynamic_sampling, self.max_sampling_batches = dynamic_sampling, max_sampling_batches
        self.reference = reference if reference is not None else FrozenCopy()
        self.disable_dropout = disable_dropout

    def setup(self, policy, tokenizer) -> None:
        super().setup(policy, tokenizer)
        tap_output_layer(policy, self.fused_output_layer)  # before the reference is made: a copy inherits it
        if self.disable_dropout:
            disable_dropout(policy)
        if self.beta > 0:
            reference = self.reference(policy, tokenizer)
            if reference is None:
                raise UserError(f"algo.beta={self.beta} needs a reference model, but algo/reference builds none. "
                                "Fix: algo/reference=copy, or algo.beta=0")
            tap_output_layer(reference, self.fused_output_layer)  # one loaded on its own (algo/reference=model)
            self.frozen = {"reference": reference}
        else:
            self.frozen = {}  # beta = 0: no reference is built or held

    @property
    def old_logps_needed(self) -> bool:
        """Whether the sampling policy differs from the trained one when a micro-batch is served."""
        return self.num_iterations > 1 or self.steps_per_generation > 1

    # ---- what a subclass says ----------------------------------------------------------------------------------------
    def advantages(self, rewards: Tensor, token_kl: Tensor | None, mask: Tensor, model) -> Tensor:
        """The advantages of one rollout: ``[N]`` (one per completion) or ``[N, C]`` (per completion token).

        ``rewards [N]``: the weighted scores, in groups of ``num_generations``; ``token_kl [N, C]``: ``beta`` times
        the per-token KL estimate of the sampling policy to the reference (0 on padding) when the KL is in the
        reward, else ``None``; ``mask [N, C]``: the completion tokens; ``model``: for the collectives
        (:func:`all_gather_rows`, :func:`global_masked_moments`)."""
        raise NotImplementedError

    # ---- rollout -----------------------------------------------------------------------------------------------------
    def rollout(self, model, prompts: dict[str, Any], seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        group = self.num_generations
        sampled = self.sample(model, prompts, group, seed)
        reward, per_function = self.score(prompts, sampled, group)
        metrics = self.reward_metrics(reward, per_function, sampled)
        metrics["frac_reward_zero_std"] = frac_reward_zero_std(reward, group)
        samples = {k: sampled[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           "truncated")}
        samples["rewards"] = reward
        batch = training_batch(samples)
        kl_in_reward = self.kl_in_reward and self.beta > 0
        with torch.no_grad():  # the unwrapped policy: no collective of a wrapper (DDP's buffer broadcast)
            if self.old_logps_needed or kl_in_reward:
                samples["old_logps"] = completion_logps(extract_model_from_parallel(model), batch, False,
                                                        self.temperature)[0]
            if self.beta > 0:
                samples["ref_logps"] = completion_logps(self.frozen["reference"], batch, False, self.temperature)[0]
        mask = samples["completion_mask"]
        token_kl = None
        if kl_in_reward:
            token_kl = self.beta * self.kl_estimator(samples["old_logps"], samples.pop("ref_logps")) * mask
            metrics["kl"] = masked_mean(token_kl / self.beta, mask)
            if not self.old_logps_needed:  # the ratio is to the trained policy itself
                del samples["old_logps"]
        samples["advantages"] = self.advantages(reward, token_kl, mask, model)
        return samples, metrics

    def collect(self, model, next_prompts) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One rollout (:meth:`sample_rollout`), each completion carrying ``loss_tokens``: the completion tokens of
        every process's rollout over ``processes × steps_per_generation``, the mean count of a micro-batch, which
        ``loss_type=dapo`` divides by so that every token of the rollout weighs the same on every process (with
        ``mask_truncated_completions``, the tokens of truncated completions are not counted: they are not in the
        loss either, as in TRL)."""
        samples, metrics = self.sample_rollout(model, next_prompts)
        mask = samples["completion_mask"]
        if self.mask_truncated_completions:
            mask = drop_truncated(mask, samples["truncated"])
        count = mask.sum().float()  # may be 0 (every completion truncated): floored below, as dapo_loss's own count
        if processes() > 1:
            count = sum_over_every_process(count.to(_device(model)))
        per_micro_batch = count.clamp(min=1) / (processes() * self.steps_per_generation)
        samples["loss_tokens"] = per_micro_batch.expand(samples["rewards"].shape[0]).clone()
        return samples, metrics

    def sample_rollout(self, model, next_prompts) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """One rollout; with ``dynamic_sampling``, of groups whose rewards differ, drawing prompt batches until the
        batch holds as many groups as one batch of prompts (or ``max_sampling_batches`` were drawn)."""
        if not self.dynamic_sampling:
            return self.rollout(model, *next_prompts())
        group, kept, dropped, all_metrics, wanted, have = self.num_generations, [], [], [], None, 0
        # Every process draws as many batches as the one that needs most: generation is a collective with several.
        device = _device(model) if processes() > 1 else "cpu"  # where the flag's all-reduce runs, with several
        while len(all_metrics) < self.max_sampling_batches and (
                wanted is None or flag_on_any_process(have < wanted, device)):
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
        token_logps, mask, entropy = completion_logps(model, batch, with_entropy=True, temperature=self.temperature)
        return self.policy_loss(token_logps, mask, entropy, batch)

    def policy_loss(self, token_logps: Tensor, mask: Tensor, entropy: Tensor, batch: dict[str, Any]
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate (plus ``beta`` times the KL when it is in the loss), aggregated by ``loss_type``,
        and its metrics, from the trained policy's completion log-probabilities and each position's entropy."""
        old = batch["old_logps"] if "old_logps" in batch else token_logps.detach()
        log_ratio = self.importance_sampling_level(token_logps, old, mask)
        surrogate = clipped_surrogate(log_ratio, batch["advantages"], self.epsilon, self.epsilon_high)
        per_token = surrogate.per_token_loss
        metrics: dict[str, Tensor] = {}
        if self.beta > 0 and not self.kl_in_reward:
            kl = self.kl_estimator(token_logps, batch["ref_logps"])
            per_token = per_token + self.beta * kl
            metrics["kl"] = masked_mean(kl.detach(), mask)
        loss_mask = drop_truncated(mask, batch["truncated"]) if self.mask_truncated_completions else mask
        num_tokens = batch["loss_tokens"][0] if "loss_tokens" in batch else None
        loss = self.loss_type(per_token, loss_mask, num_tokens)
        with torch.no_grad():
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        metrics.update({k: v for k, v in surrogate.clip_metrics(mask).items()})
        return loss, {"loss": loss.detach(), **batch.get("rollout_metrics", {}), **metrics}


# ---- collectives: statistics over the global batch -------------------------------------------------------------------
# Every collective is rlhf.ops.collectives'; these give it the policy's device.
def _device(model) -> torch.device:
    return next(extract_model_from_parallel(model).parameters()).device


def all_gather_rows(values: Tensor, model) -> tuple[Tensor, slice]:
    """Every process's ``values`` (equal shapes), concatenated in process order along the first dimension, and the
    slice of this process's rows in it (:func:`rlhf.ops.collectives.gather_rows` on the policy's device)."""
    return gather_rows(values, _device(model) if processes() > 1 else values.device)


def global_masked_moments(values: Tensor, mask: Tensor, model) -> Moments:
    """``(count, mean, M2)`` of the entries of ``values`` where ``mask`` is 1, over every process (float64; one
    all-gather of three numbers per process)."""
    local = batch_moments(values[mask.bool()])
    if processes() == 1:
        return local
    moments = torch.tensor(local, dtype=torch.float64, device=_device(model))
    stacked = torch.stack(gather_equal(moments)).cpu()
    return combine_moments(stacked[:, 0], stacked[:, 1], stacked[:, 2])


def completion_logps(model, batch: dict[str, Tensor], with_entropy: bool, temperature: float = 1.0
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(token_logps [N, C], mask [N, C], entropy [N, C] or None)`` of the completion tokens of a
    :func:`~rlhf.algos.online.training_batch` (prompts ``P`` tokens, left-padded; completions after them), the
    entropy of each completion position's distribution without gradient, all of the policy at the sampling
    ``temperature``: ``softmax(logits / temperature)``, the distribution the completions were drawn from (as TRL's
    GRPO and PPO divide the logits). Where the model's output layer answers
    with log-probabilities (``algo.fused_output_layer``), it sees only the completion's positions and the logits
    never exist whole; elsewhere the output layer runs at every position, as it always has."""
    prompt, ids, attention = int(batch["prompt_length"]), batch["input_ids"], batch["attention_mask"]
    if answers(extract_model_from_parallel(model), _device(model)):
        labels, mask = ids[:, prompt:], attention[:, prompt:]
        with token_request(labels, with_entropy=with_entropy, temperature=temperature) as request:
            logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=labels.shape[1] + 1).logits
        answered = answer(request, logits)
        if answered is not None:
            return answered * mask, mask, request.entropy if with_entropy else None
        if logits.shape[1] != ids.shape[1]:  # logits of the kept positions only: every position's, as below
            logits = model(input_ids=ids, attention_mask=attention).logits
    else:
        logits = model(input_ids=ids, attention_mask=attention).logits
    token_logps, mask, entropy = completion_part(logits, batch, with_entropy, temperature)
    return token_logps, mask, entropy


def completion_part(logits: Tensor, batch: dict[str, Tensor], with_entropy: bool = True, temperature: float = 1.0
                    ) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`completion_logps` from the logits ``[N, P + C, V]`` of a forward pass over the batch (at
    ``temperature``; the logits are divided block by block, never copied whole)."""
    prompt = int(batch["prompt_length"])
    labels = batch["input_ids"][:, prompt:]
    mask = batch["attention_mask"][:, prompt:]
    token_logps = selective_log_softmax(logits, labels, start=prompt - 1, temperature=temperature) * mask
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits[:, prompt - 1:-1].detach(), temperature=temperature)
    return token_logps, mask, entropy
