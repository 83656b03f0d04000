"""Proximal Policy Optimization for language models (Schulman et al. 2017, arXiv:1707.06347; as in Ziegler et al.
2019, arXiv:1909.08593, and Stiennon et al. 2020): a critic, the KL to the reference as a per-token reward, GAE.

Per rollout: completions are sampled and scored; the scores are post-processed (``score_scaling``: divided by the
running standard deviation of every score seen; ``score_norm``: also the running mean subtracted; ``score_clip``;
the running statistics are checkpointed); the sampling policy's log-probabilities and the critic's values are taken
in one forward pass; each token's reward is ``−kl_coef · KL_t`` (the reference's per-token estimate,
``kl_estimator``), plus the score on the last token (``kl_in_reward=false``: no KL in the reward, ``kl_coef`` times
it in the loss instead); advantages and returns come from GAE (``gamma``, ``lam``), the advantages whitened over
every token of the global batch; the KL coefficient comes from ``kl_controller`` (fixed, or Ziegler's adaptive one,
updated after each rollout). Then ``num_ppo_epochs`` passes over ``num_mini_batches`` micro-batches each, minimizing
the clipped surrogate plus ``vf_coef`` times the clipped value loss.

The critic is a value head on the policy's trunk, or with ``separate_critic`` on a copy of its backbone
(:mod:`rlhf.models.value_head`); either way it is part of the one model the loop trains and checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor

from rlhf.algos.advantages import gae, masked_mean, whiten_with
from rlhf.algos.online import training_batch
from rlhf.algos.policy_gradient import (
    PolicyGradient,
    all_gather_rows,
    completion_logps,
    completion_part,
    global_masked_moments,
)
from rlhf.algos.policy_losses import clipped_value_loss
from rlhf.algos.reward_shaping import (
    FixedKLController,
    KLController,
    RunningMoments,
    kl_penalized_rewards,
    score_clip,
    score_norm,
    score_scaling,
)
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.models.value_head import attach_value_head, values_on

RENAMED = {"num_iterations": "num_ppo_epochs", "steps_per_generation": "num_mini_batches", "beta": "kl_controller"}


@limits(gamma=Range(gt=0, le=1, meaning="the discount of later token rewards; 1 is TRL's", fix=1.0),
        lam=Range(ge=0, le=1, meaning="GAE's lambda; 0.95 is TRL's", fix=0.95),
        vf_coef=Range(ge=0, meaning="the weight of the value loss; 0.1 is TRL's", fix=0.1),
        cliprange_value=Range(gt=0, meaning="how far a value may move from the rollout's before its loss is clipped",
                              fix=0.2),
        num_ppo_epochs=Range(ge=1, integer=True, meaning="optimization passes over each rollout", fix=1),
        num_mini_batches=Range(ge=1, integer=True, meaning="micro-batches each rollout is split into", fix=1),
        score_clip=Range(gt=0, null=True, meaning="scores are clipped to [-score_clip, score_clip]; null is off",
                         fix=None))
class PPO(PolicyGradient):
    """PPO on ``prompt`` rows. Sampling, rewards and the clipped surrogate as :class:`~rlhf.algos.grpo.GRPO`'s
    (``epsilon`` is TRL's PPO ``cliprange``), plus (TRL's ``PPOConfig`` names):

    Args:
        kl_controller: the KL coefficient (:class:`~rlhf.algos.reward_shaping.FixedKLController` ``kl_coef``, or
            the adaptive one); a fixed 0 holds no reference model.
        kl_in_reward: ``True``: ``−kl_coef · KL_t`` per token in the reward (PPO's); ``False``: in the loss (with
            ``algo/kl_estimator=k2`` or ``k3``: k1's expected gradient is zero there, refused).
        separate_critic: the critic reads a copy of the policy's backbone, not the policy's hidden states.
        num_ppo_epochs, num_mini_batches: passes over each rollout, and the micro-batches it is split into.
        gamma, lam: GAE's discount and lambda. vf_coef: the value loss's weight. cliprange_value: its clip.
        whiten_advantages: whiten the advantages over every token of the global batch.
        score_scaling, score_norm, score_clip: the scores' post-processing, in that order (see the module).
    """

    def __init__(self, kl_controller: KLController | None = None, kl_in_reward: bool = True,
                 separate_critic: bool = False, num_ppo_epochs: int = 1, num_mini_batches: int = 1,
                 gamma: float = 1.0, lam: float = 0.95, vf_coef: float = 0.1, cliprange_value: float = 0.2,
                 whiten_advantages: bool = True, score_scaling: bool = False, score_norm: bool = False,
                 score_clip: float | None = None, **kwargs: Any) -> None:
        for name in RENAMED.keys() & kwargs.keys():
            raise UserError(f"algo.{name} is not an option of ppo. Fix: algo.{RENAMED[name]} (TRL's PPO name)")
        if kwargs.pop("fused_output_layer", False) is not False:
            raise UserError("algo.fused_output_layer is not an option of ppo: its policy's one forward pass gives the "
                            "logits and the critic's values together. Fix: leave it out")
        self.kl_controller = kl_controller if kl_controller is not None else FixedKLController(0.05)
        super().__init__(beta=self.kl_controller.value, kl_in_reward=kl_in_reward, num_iterations=num_ppo_epochs,
                         steps_per_generation=num_mini_batches, fused_output_layer=False, **kwargs)
        self.separate_critic, self.gamma, self.lam = separate_critic, gamma, lam
        self.vf_coef, self.cliprange_value, self.whiten_advantages = vf_coef, cliprange_value, whiten_advantages
        self.score_scaling, self.score_norm, self.score_clip = score_scaling, score_norm, score_clip
        self.score_moments = RunningMoments()

    def setup(self, policy, tokenizer) -> None:
        super().setup(policy, tokenizer)  # the reference is a copy of the policy without the critic
        self.beta = self.kl_controller.value
        attach_value_head(policy, separate=self.separate_critic, seed=self.seed)

    @property
    def old_logps_needed(self) -> bool:
        return True  # computed with the values in the rollout's one forward pass anyway

    # ---- rollout -----------------------------------------------------------------------------------------------------
    def shape_scores(self, scores: Tensor, model) -> Tensor:
        """The scores after ``score_scaling``/``score_norm`` (the running moments updated with every process's scores
        first) and ``score_clip``."""
        if self.score_scaling or self.score_norm:
            everyone, _ = all_gather_rows(scores, model)
            self.score_moments.update(everyone)
            moments = self.score_moments
            scores = score_norm(scores, moments.mean, moments.std) if self.score_norm else \
                score_scaling(scores, moments.std)
        return scores if self.score_clip is None else score_clip(scores, self.score_clip)

    def rollout(self, model, prompts: dict[str, Any], seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        sampled = self.sample(model, prompts, self.num_generations, seed)
        reward, per_function = self.score(prompts, sampled, self.num_generations)
        metrics = self.reward_metrics(reward, per_function, sampled)
        scores = self.shape_scores(reward, model)
        samples = {k: sampled[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           "truncated")}
        samples["rewards"] = reward
        batch = training_batch(samples)
        policy = extract_model_from_parallel(model)  # no collective of a wrapper (DDP's buffer broadcast)
        with torch.no_grad(), values_on(policy):
            out = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        old_logps, mask, _ = completion_part(out.logits, batch, with_entropy=False, temperature=self.temperature)
        values = out["token_values"][:, int(batch["prompt_length"]) - 1:-1] * mask
        kl = torch.zeros_like(old_logps)
        if "reference" in self.frozen:
            with torch.no_grad():
                ref_logps = completion_logps(self.frozen["reference"], batch, False, self.temperature)[0]
            kl = self.kl_estimator(old_logps, ref_logps) * mask
            if not self.kl_in_reward:
                samples["ref_logps"] = ref_logps
        coef = self.kl_controller.value
        token_rewards = kl_penalized_rewards(scores, kl if self.kl_in_reward else torch.zeros_like(kl), mask, coef)
        advantages, returns = gae(token_rewards, values, mask, self.gamma, self.lam)
        if self.whiten_advantages:
            count, mean, m2 = global_masked_moments(advantages, mask, model)
            advantages = whiten_with(advantages, mask, mean, m2 / max(count - 1, 1))
        everyone_kl, _ = all_gather_rows(kl.sum(-1), model)
        self.kl_controller.update(float(everyone_kl.mean()), everyone_kl.numel())
        self.beta = self.kl_controller.value
        samples.update(old_logps=old_logps, old_values=values, advantages=advantages, returns=returns)
        metrics.update({"kl": masked_mean(kl, mask), "kl_coef": torch.tensor(coef), "score": scores.mean(),
                        "values/mean": masked_mean(values, mask)})
        return samples, metrics

    # ---- the loss ----------------------------------------------------------------------------------------------------
    def loss(self, model, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        with values_on(model):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        token_logps, mask, entropy = completion_part(out.logits, batch, temperature=self.temperature)
        policy_loss, metrics = self.policy_loss(token_logps, mask, entropy, batch)
        values = out["token_values"][:, int(batch["prompt_length"]) - 1:-1]
        per_token, clipped = clipped_value_loss(values, batch["old_values"], batch["returns"], self.cliprange_value)
        value_loss = masked_mean(per_token, mask)
        loss = policy_loss + self.vf_coef * value_loss
        metrics.update({"loss": loss.detach(), "loss/policy": policy_loss.detach(), "loss/value": value_loss.detach(),
                        "val/clipfrac": masked_mean(clipped.float(), mask)})
        return loss, metrics

    # ---- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "score_moments": self.score_moments.state_dict(),
                "kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "score_moments" in state:
            self.score_moments.load_state_dict(state["score_moments"])
            self.kl_controller.load_state_dict(state["kl_controller"])
            self.beta = self.kl_controller.value
