"""Iterative SFT (expert iteration, rejection-sampling fine-tuning) through the one loop.

Per rollout, ``num_generations`` completions are sampled for each prompt and scored by the reward functions
(:mod:`rlhf.algos.reward_funcs`); :func:`keep_best` chooses which of them to learn from (the ``keep_top_k`` best of each
prompt's group, and only those whose reward reaches ``keep_threshold``); the loss is SFT's
(:func:`rlhf.algos.sft.nll_loss`): the mean negative log-likelihood of the kept completions' tokens (EOS included)
given their prompts, the sequences laid out as ``algo=sft`` lays out its rows (prompt + completion, right-padded).
Then the next rollout samples from the improved policy: the loop of Anthony et al. 2017 (expert iteration),
RAFT (Dong et al. 2023, arXiv:2304.06767) and ReST-EM (Singh et al. 2023, arXiv:2312.06585); what TRL's former
``IterativeSFTTrainer`` left to the user's own loop (``scripts/iterative_sft.py`` does it by hand with ``step()``).

Watch ``train/reward`` (all samples, before filtering), ``train/kept_fraction`` and ``eval/reward`` (greedy, held
out); ``train/loss`` is the NLL of what was kept, which falls as the policy learns its own best answers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf.algos.online import (
    OnlineAlgorithm,
)
from rlhf.algos.sft import nll_loss
from rlhf.core.limits import Range, limits
from rlhf.data.collate import collate_sequences
from rlhf.ops.completion_logps import completion_stats


def keep_best(rewards: Tensor, num_generations: int, top_k: int | None = None,
              threshold: float | None = None) -> Tensor:
    """Which completions to learn from, ``[N]`` bool, of ``rewards [N]`` in groups of ``num_generations`` (one
    prompt's completions next to each other).

    A completion is kept when both hold: it is among the ``top_k`` highest rewards of its group (``None``: every
    completion of the group; equal rewards are ranked in sampling order, the first sampled first), and its reward is
    ``>= threshold`` (``None``: any reward). So ``top_k=1`` alone is best-of-n, ``threshold`` alone keeps every
    good enough completion (several per prompt, none for a prompt without one), and both keep at most ``top_k``
    good enough ones per prompt. A NaN reward (no reward function applied) is never kept."""
    finite = ~torch.isnan(rewards)
    keep = finite.clone()
    if threshold is not None:
        keep &= rewards >= threshold
    if top_k is not None:
        grouped = torch.where(finite, rewards, torch.full_like(rewards, -torch.inf)).view(-1, num_generations)
        order = torch.sort(grouped, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(num_generations).expand_as(order))
        keep &= (rank < top_k).view(-1)
    return keep


def kept_sequences(batch: dict[str, Tensor], keep: Tensor, pad_id: int) -> tuple[dict[str, Tensor], bool]:
    """The kept rows of a training micro-batch (:func:`rlhf.algos.online.training_batch`: left-padded prompts, then
    completions) as ``algo=sft`` collates its rows: prompt + completion without padding, right-padded
    (``input_ids``, ``attention_mask``, ``completion_mask``). When nothing is kept, the first row stands in (with
    ``False``): its loss is weighted 0, so that every process still runs a forward and backward pass."""
    rows = keep.nonzero().flatten().tolist()
    any_kept = bool(rows)
    ids, masks = [], []
    for row in rows or [0]:
        real = batch["attention_mask"][row].bool()
        ids.append(batch["input_ids"][row][real].tolist())
        masks.append(batch["completion_mask"][row][real].tolist())
    out = collate_sequences(ids, masks, pad_id)
    return {k: v.to(batch["input_ids"].device) for k, v in out.items()}, any_kept


@limits(keep_top_k=Range(ge=1, integer=True, meaning="completions kept per prompt, the best by reward; null keeps "
                         "every one that passes keep_threshold", fix=1))
class IterativeSFT(OnlineAlgorithm):
    """Expert iteration on ``prompt`` rows: sample, keep the best by reward, SFT on what was kept.

    Args (TRL's ``GRPOConfig`` names for the sampling options):
        num_generations: completions sampled per prompt; ``train.per_device_batch_size`` counts prompts.
        keep_top_k: keep at most this many completions per prompt, the highest-rewarded (``None``: no limit).
        keep_threshold: keep only completions whose reward is ``>= keep_threshold`` (``None``: no threshold).
            Both together: the best ``keep_top_k`` of those that reach it (:func:`keep_best`).
        num_iterations: SFT passes over each rollout's kept completions.
        steps_per_generation: micro-batches each rollout is split into (whole prompt groups; each keeps what
            its groups kept, so micro-batches hold different numbers of sequences).
        temperature, top_p, top_k, max_completion_length: sampling of training completions (held-out ones are
            greedy); ``max_prompt_length``: prompts keep their last tokens.
        seed: the run's seed, from which every prompt batch's sampling seed derives.
        reward_funcs, reward_weights, reward_columns: the reward functions by name (:mod:`rlhf.algos.reward_funcs`), one
            weight each (``None``: all 1), and the dataset columns passed to them; the filter reads the weighted
            reward.
        log_completions, log_completions_every_steps, num_completions_to_print: every N steps (and at the
            first), the first completions of the latest rollout with their rewards go to the loggers
            (``samples.jsonl`` in the run folder, a W&B table with ``logger=wandb``).
    """

    def __init__(self, num_generations: int = 4, keep_top_k: int | None = None, keep_threshold: float | None = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(num_generations=num_generations, **kwargs)  # the options of every online algorithm
        self.keep_top_k, self.keep_threshold = keep_top_k, keep_threshold

    def rollout(self, model, prompts: dict[str, Any], seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        group = self.num_generations
        sampled = self.sample(model, prompts, group, seed)
        reward, per_function = self.score(prompts, sampled, group)
        keep = keep_best(reward, group, self.keep_top_k, self.keep_threshold)
        metrics = self.reward_metrics(reward, per_function, sampled)
        metrics["kept_fraction"] = keep.float().mean()
        samples = {k: sampled[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           "truncated")}
        samples["rewards"], samples["keep"] = reward, keep
        return samples, metrics

    def loss(self, model, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        sequences, any_kept = kept_sequences(batch, batch["keep"], self.pad_id)
        stats = completion_stats(model, sequences)
        mask = stats.mask if any_kept else torch.zeros_like(stats.mask)  # nothing kept: 0, with a graph
        loss = nll_loss(stats.token_logps, mask)
        return loss, {"loss": loss.detach(), **batch.get("rollout_metrics", {})}
