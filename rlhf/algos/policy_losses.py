"""The policy-gradient losses of online RL, each a pure tensor function: importance ratios (token level, GSPO's
sequence level), PPO's clipped surrogate with DAPO's clip-higher, the loss aggregations of GRPO and its variants, the
KL estimators, PPO's clipped value loss and the entropy of a distribution given by logits.

Shapes: ``B`` completions, ``T`` completion tokens, ``V`` vocabulary. ``logps``, ``old_logps``, ``ref_logps`` are the
per-token log-probabilities ``[B, T]`` of the sampled tokens under the policy being trained, the policy that
sampled them, and the reference; ``mask [B, T]`` is 1 on completion tokens and 0 on padding.

Option names are TRL's ``GRPOConfig``/``PPOConfig``: ``epsilon``, ``epsilon_high``, ``importance_sampling_level``,
``loss_type``, ``max_completion_length``, ``cliprange_value``. The dicts at the end map TRL's option values to the
functions, for the config boundary only; a run's config names a function by ``_target_``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.advantages import masked_mean
from rlhf.core.limits import Range, limits

# ---- importance ratios: log π_θ/π_old per token, [B, T] ----


def token_log_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """TRL's ``importance_sampling_level="token"`` (PPO, GRPO): ``log π_θ(y_t) − log π_old(y_t)``, ``[B, T]``."""
    return logps - old_logps


def sequence_log_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), TRL's ``importance_sampling_level="sequence"``.

    The length-normalized sequence log-ratio ``(1/|y|) Σ_t (log π_θ(y_t) − log π_old(y_t))`` over the masked tokens,
    broadcast to every token, ``[B, T]``: its exponential is the geometric mean of the token ratios, one ratio per
    sequence (a row without tokens gets 0).
    """
    mask = mask.to(logps.dtype)
    per_sequence = ((logps - old_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.unsqueeze(-1).expand_as(logps)


def sequence_token_log_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token (arXiv:2507.18071, eq. 13): the value of :func:`sequence_log_ratio`, the gradient of each token's own
    log-probability (``log π_θ(y_t) − sg[log π_θ(y_t)] + sg[sequence log-ratio]``), for per-token advantages."""
    return logps - logps.detach() + sequence_log_ratio(logps, old_logps, mask).detach()


# ---- the clipped surrogate ----


@dataclass(frozen=True)
class Surrogate:
    """PPO's clipped surrogate per token, ``[B, T]`` each: the loss, the ratio, and where the clip is active."""

    per_token_loss: Tensor
    ratio: Tensor
    is_low_clipped: Tensor  # ratio < 1 − ε and advantage < 0: the clipped term wins below
    is_high_clipped: Tensor  # ratio > 1 + ε_high and advantage > 0: the clipped term wins above

    @property
    def is_region_clipped(self) -> Tensor:
        return self.is_low_clipped | self.is_high_clipped

    def clip_metrics(self, mask: Tensor) -> dict[str, Tensor]:
        """TRL's ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``: the fraction of
        completion tokens clipped (this process's; the loop averages over processes)."""
        return {
            "clip_ratio/low_mean": masked_mean(self.is_low_clipped.float(), mask),
            "clip_ratio/high_mean": masked_mean(self.is_high_clipped.float(), mask),
            "clip_ratio/region_mean": masked_mean(self.is_region_clipped.float(), mask),
        }


EPSILON = Range(gt=0, lt=1, meaning="the clip range of the importance ratio, [1 − epsilon, 1 + epsilon_high]; 0.2 "
                "is common", fix=0.2)


@limits(epsilon=EPSILON, epsilon_high=Range(gt=0, meaning="DAPO's clip-higher upper range (0.28 in the paper); "
                                            "null is epsilon", fix=0.28))
def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, epsilon: float = 0.2,
                      epsilon_high: float | None = None) -> Surrogate:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with clip-higher (DAPO, arXiv:2503.14476).

    ``log_ratio [B, T]`` (from an importance-sampling function above), ``advantages [B]`` (one per completion,
    broadcast to its tokens) or ``[B, T]``. With ``r = exp(log_ratio)``, per token
    ``loss = −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A)``, ``ε = epsilon``, ``ε_high = epsilon_high`` (``None``: ε, as
    TRL). Clip-higher leaves more room above: a rare token whose probability rises is clipped later.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == log_ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    return Surrogate(
        per_token_loss=per_token_loss,
        ratio=ratio,
        is_low_clipped=(ratio < 1 - epsilon) & (advantages < 0),
        is_high_clipped=(ratio > 1 + high) & (advantages > 0),
    )


def drop_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """TRL's ``mask_truncated_completions``: the mask with every token of a truncated completion (``truncated [B]``,
    true where no end-of-sequence token was generated) set to 0, so it adds nothing to the loss."""
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)


# ---- loss aggregations: per-token losses [B, T] → the micro-batch's scalar loss ----
# One signature, so that a config swaps them by _target_: (per_token_loss, mask, num_tokens=None); only `dapo` reads
# num_tokens, and `dr_grpo` takes its constant (max_completion_length) from the config.


def grpo_loss(per_token_loss: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """TRL's ``loss_type="grpo"`` (Shao et al. 2024, arXiv:2402.03300): the mean over each sequence's tokens, then the
    mean over sequences. A token of a short completion weighs more than one of a long completion."""
    return masked_mean(per_token_loss, mask, dim=-1).mean()


def bnpo_loss(per_token_loss: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """TRL's ``loss_type="bnpo"``: the mean over every completion token of the micro-batch (each token weighs the
    same within a micro-batch; micro-batches with fewer tokens weigh more per token)."""
    return masked_mean(per_token_loss, mask)


def dapo_loss(per_token_loss: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None) -> Tensor:
    """DAPO's token-level loss (Yu et al. 2025, arXiv:2503.14476), TRL's ``loss_type="dapo"``: ``Σ loss / num_tokens``.

    ``num_tokens``: what the caller divides by so that every token of the *global* batch weighs the same. The loop
    divides each micro-batch's loss by its accumulation steps and averages gradients over processes, so pass the
    loss's tokens of the whole global batch (all processes, all accumulation steps; without the truncated
    completions' where ``mask_truncated_completions`` leaves them out) divided by ``processes × accumulation
    steps``: the mean token count of a micro-batch, at least 1. ``None``: this micro-batch's own count (then equal
    to :func:`bnpo_loss`).
    """
    mask = mask.to(per_token_loss.dtype)
    divisor = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return (per_token_loss * mask).sum() / divisor


@limits(max_completion_length=Range(ge=1, integer=True, meaning="the most tokens a completion may have", fix=256))
def dr_grpo_loss(per_token_loss: Tensor, mask: Tensor, num_tokens: Tensor | float | None = None, *,
                 max_completion_length: int) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), TRL's ``loss_type="dr_grpo"``: ``Σ loss / (B · L_max)`` with
    ``L_max = max_completion_length``: a constant divisor, so no length bias (a long wrong answer is not penalized
    less per token). Equal micro-batches make the loop's average over them the global ``Σ / (B_global · L_max)``."""
    mask = mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)


Aggregation = Callable[..., Tensor]

LOSS_TYPES: dict[str, Aggregation] = {"grpo": grpo_loss, "bnpo": bnpo_loss, "dapo": dapo_loss, "dr_grpo": dr_grpo_loss}
"""TRL's ``loss_type`` → the aggregation (``dr_grpo`` also needs ``max_completion_length``)."""

IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}
"""TRL's ``importance_sampling_level`` → the log-ratio function."""


# ---- KL estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html) ----
# Each is a per-token estimate from samples y ~ π_θ, with log r = log π_ref(y) − log π_θ(y). [B, T] → [B, T].
#
# Two different questions, with different answers (Schulman 2020 for the values; for the gradients Tang & Munos
# 2025, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv:2506.09477):
#
# - Its *value* as an estimate of KL(π_θ ‖ π_ref): E_π[k1] = E_π[k3] = KL (unbiased), E_π[k2] ≈ KL (biased).
#   This is what matters with ``kl_in_reward=true``: the estimate is a (negative) reward, and the policy gradient
#   of ``reward − β·KL`` regularizes through the score function, as for any reward.
# - Its *gradient* as a loss term (``kl_in_reward=false``: ``+ β·k`` per token, the samples not differentiated):
#   ∇_θ k depends on θ only through log π_θ(y), so E_π[∇k] = Σ_y π(y) k'(y) ∇log π(y) with k' = ∂k/∂log π_θ:
#     k1: k' = 1               → E_π[∇ log π] = Σ_y ∇π(y) = 0: no gradient at all in expectation;
#     k2: k' = log π − log ref → Σ_y ∇π(y)·log(π/ref)(y) = ∇ KL(π ‖ ref) (the term Σ π ∇log π is 0);
#     k3: k' = 1 − ref/π       → −Σ_y ref(y) ∇log π(y) = ∇ KL(ref ‖ π), the *forward* (mass-covering) KL.
#   So only k2 regularizes toward the reference by the gradient of the reverse KL that PPO's objective names; k3
#   (TRL's GRPO default) regularizes too, by the forward KL's gradient; k1 does nothing and is refused there.
#   Per token, these are the gradients of each token's KL given its prefix; the sequence's KL also moves through the
#   later tokens' distributions, which a per-token loss term leaves out (Tang & Munos, section 4); the KL in the
#   reward, summed over the completion, keeps that part. And they hold where a token's weight in the loss does not
#   depend on what was sampled: a constant divisor (``loss_type=dr_grpo``; ``dapo``'s is a whole rollout's count).
#   ``grpo`` and ``bnpo`` divide by the sampled lengths, which adds a term through the length: k1's expected gradient
#   is then ``beta · ∇E_π[(1/|o|)·…]``-shaped, a bias toward some lengths, still no pull toward the reference
#   (tested by exact expectation over every sequence of a two-step policy).
#   Tested by exact expectation over every outcome of a small categorical policy (tests/algos/test_policy_losses.py).


def kl_k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k1 = −log r = log π_θ − log π_ref``. Value: unbiased for KL(π‖ref), high variance, negative on some tokens.
    Gradient as a loss term: zero in expectation (use it in the reward, as TRL's RLOO and PPO do)."""
    return logps - ref_logps


def kl_k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k2 = (log r)² / 2``. Value: biased, low variance, never negative. Gradient as a loss term: unbiased for
    ∇ KL(π‖ref), the reverse KL (the one to put in the loss)."""
    return (ref_logps - logps) ** 2 / 2


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k3 = r − 1 − log r``; TRL's GRPO ``per_token_kl``. Value: unbiased for KL(π‖ref), low variance, never
    negative. Gradient as a loss term: unbiased for ∇ KL(ref‖π), the forward KL, not the KL its value estimates."""
    log_r = ref_logps - logps
    return torch.exp(log_r) - 1 - log_r


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""The estimator names (TRL's PPO ``kl_estimator`` has k1 and k3) → the function."""


# ---- PPO's critic and the entropy ----


@limits(cliprange_value=Range(gt=0, meaning="how far a new value may move from the rollout's value before its "
                              "loss is clipped; 0.2 is TRL's", fix=0.2))
def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
                       cliprange_value: float = 0.2) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss (TRL's ``cliprange_value``), ``[B, T]`` each → ``(per_token_loss, is_clipped)``.

    ``v' = clip(values, old_values ± cliprange_value)``; ``loss = ½ max((values − R)², (v' − R)²)`` with ``R`` the
    ``returns`` of :func:`rlhf.algos.advantages.gae`; ``is_clipped`` where the clipped term is the larger (TRL's
    ``val/clipfrac`` is its masked mean). Aggregate with :func:`masked_mean`.
    """
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    return 0.5 * torch.max(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def entropy_from_logits(logits: Tensor, chunk_rows: int = 128, temperature: float = 1.0) -> Tensor:
    """The entropy ``−Σ_v p_v log p_v`` of each position's distribution ``p = softmax(logits / temperature)``,
    ``[..., V]`` → ``[...]`` in float32.

    Computed ``chunk_rows`` positions at a time, so only one chunk's float32 probabilities ``[chunk_rows, V]`` exist
    at once, not ``[B, T, V]`` (which is several GB at a real vocabulary). Call it under ``torch.no_grad()`` to log
    TRL's ``entropy`` (its masked mean); with gradients every chunk's graph is kept until the backward pass.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start:start + chunk_rows].float()
        logp = F.log_softmax(chunk / temperature if temperature != 1 else chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    entropy = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(logits.shape[:-1])
