"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306) on unpaired rows.

Each row is a prompt, a completion and a ``label``: true where the completion is desirable, false where not (paired
``prompt``/``chosen``/``rejected`` data is split into such rows by :mod:`rlhf.data.formats`). With the implied reward
``r = log pi(y|x) - log ref(y|x)`` (summed over completion tokens, EOS included) and a reference point ``z``, the
loss of a row is ``w_D (1 - sigmoid(beta (r - z)))`` if desirable, ``w_U (1 - sigmoid(beta (z - r)))`` if not (the
paper's eq. 7 with ``1 - v``), averaged over the rows of the batch.

``z`` estimates ``KL(pi || ref)`` from mismatched pairs, as TRL's ``KTOTrainer`` computes it: each prompt of the batch
with the completion of the row before it (the completions rotated by one within the batch), ``z = max(0, mean(r))``
over those pairs, averaged over the processes and not differentiated.
"""

from __future__ import annotations

from typing import Any

import torch
from hydra.utils import get_object
from torch import Tensor

from rlhf.algos.regularized import ReferenceRegularized
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data.collate import collate_sequences, require_completion
from rlhf.data.encoding import FORMAT_COLUMN, TEXT, TRUNCATED, encode
from rlhf.models.reference import FrozenCopy
from rlhf.ops.collectives import processes, sum_over_every_process
from rlhf.ops.completion_logps import completion_stats
from rlhf.ops.output_layer import check_when

KL = "kl_"  # prefix of the mismatched (prompt, completion) sequences in a batch


def kto_loss(logratios: Tensor, desirable: Tensor, kl: Tensor, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> Tensor:
    """Per-row KTO loss, ``[B]``: ``w_D (1 - s(beta (r - z)))`` where ``desirable``, else ``w_U (1 - s(beta (z - r)))``.

    Args:
        logratios: ``[B]`` ``r``, the policy's minus the reference's summed completion log-probability.
        desirable: ``[B]`` bool, the rows' labels.
        kl: the reference point ``z`` (a scalar tensor), see :func:`kl_estimate`.
        beta: the KL strength (> 0).
        desirable_weight, undesirable_weight: ``w_D`` and ``w_U`` (> 0).
    """
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, chosen, rejected)


def kl_estimate(mismatched_logratios: Tensor) -> Tensor:
    """KTO's reference point: the mean log-ratio of the batch's mismatched pairs, averaged over the processes (each
    process's mean, as TRL gathers them), floored at 0, without gradient. A collective when several processes run:
    every process calls it once per batch."""
    kl = sum_over_every_process(mismatched_logratios.detach().mean()) / processes()
    return kl.clamp(min=0)


def _reference_scores_mismatched_pairs(values: dict[str, Any], where: str) -> None:
    """Refuse a reference strategy that scores only precomputed rows: the mismatched pairs exist per batch."""
    node = values.get("reference")
    target = node.get("_target_") if isinstance(node, dict) else None
    if isinstance(target, str) and not getattr(get_object(target), "scores_any_batch", True):
        raise UserError(_PRECOMPUTED.format(where=where))


_PRECOMPUTED = ("{where}: algo=kto pairs each prompt with another row's completion in every micro-batch, so the "
                "reference must score sequences that exist only during training; this reference strategy gives the "
                "log-probabilities of precomputed rows only. Fix: algo/reference=copy (or model, shared_layers).")


@limits(_reference_scores_mismatched_pairs,
        desirable_weight=Range(gt=0, meaning="weight of the desirable rows' losses (w_D)", fix=1.0),
        undesirable_weight=Range(gt=0, meaning="weight of the undesirable rows' losses (w_U)", fix=1.0))
class KTO(ReferenceRegularized):
    """KTO on ``prompt``/``completion``/``label`` rows (or preference pairs, split into such rows).

    Args:
        beta: strength of the implicit KL penalty (> 0); rewards are ``beta * log(pi/ref)``.
        reference: builds the frozen reference model (the config group ``algo/reference``).
        desirable_weight: ``w_D`` (> 0), weight of the desirable rows' losses.
        undesirable_weight: ``w_U`` (> 0), weight of the undesirable rows' losses. TRL advises
            ``w_D n_D / (w_U n_U)`` in [1, 4/3] for ``n_D`` desirable and ``n_U`` undesirable rows.
        disable_dropout: turn every dropout off in policy and reference, so log-ratios start at 0.
        max_prompt_length: prompts longer than this many tokens keep their end (>= 1, < max_length, or null).
        max_length: sequences longer than this many tokens lose their end (>= 1, or null); the mismatched
            sequences too.
        fused_output_layer: where the output layer computes the token log-probabilities itself, a tile of logits at a time,
            the ``[B, T, V]`` logits never whole (:mod:`rlhf.ops.output_layer`): ``auto`` (on a GPU), ``true``
            (also on a CPU), ``triton`` (the Triton kernel on a GPU) or ``false``.
    """

    columns = ("prompt", "completion", "label")
    tokenize_reads = ("max_prompt_length", "max_length")
    answer_metrics = ("exact_match",)  # the embedded task's one answer (Algorithm.answer_metrics)
    eval_metrics = ("loss", "kl")  # the rest depend on which labels a batch holds

    def __init__(self, beta: float = 0.1, reference: Any = None, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, disable_dropout: bool = True, max_prompt_length: int | None = 512,
                 max_length: int | None = 1024, fused_output_layer: bool | str = "auto") -> None:
        self.fused_output_layer = check_when(fused_output_layer)
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.reference = reference if reference is not None else FrozenCopy()
        self.disable_dropout = disable_dropout
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        if not self.reference.scores_any_batch:
            raise UserError(_PRECOMPUTED.format(where="algo.reference"))

    def tokenize(self, row: dict[str, Any], tokenizer) -> dict[str, Any]:
        encoded = encode(tokenizer, row["prompt"], row["completion"], self.max_prompt_length, self.max_length,
                         row.get(FORMAT_COLUMN, TEXT))
        require_completion(encoded, row, "completion", self.max_length)
        if self.max_length is not None:  # the completion kept whole: collate pairs it with another row's prompt for
            # the KL estimate and cuts each sequence to max_length after pairing (as TRL's KTO collator does)
            whole = encode(tokenizer, row["prompt"], row["completion"], self.max_prompt_length, None,
                           row.get(FORMAT_COLUMN, TEXT))
            encoded = {**whole, TRUNCATED: encoded[TRUNCATED]}
        start = encoded["completion_mask"].index(1)
        ids = encoded["input_ids"]
        return {"prompt_ids": ids[:start], "completion_ids": ids[start:], "label": bool(row["label"]),
                TRUNCATED: encoded[TRUNCATED]}

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """The rows' sequences (``input_ids``, ``attention_mask``, ``completion_mask``, ``[B, T]``), ``label``
        ``[B]``, and the mismatched sequences under :data:`KL` + the same names: prompt ``i`` with completion
        ``i - 1`` (the last completion goes to the first prompt), cut to ``max_length``."""
        prompts = [r["prompt_ids"] for r in rows]
        completions = [r["completion_ids"] for r in rows]
        batch = self._sequences(prompts, completions)
        mismatched = self._sequences(prompts, completions[-1:] + completions[:-1])
        batch.update({KL + name: value for name, value in mismatched.items()})
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
        return batch

    def _sequences(self, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, Tensor]:
        end = self.max_length
        ids = [(p + c)[:end] for p, c in zip(prompts, completions)]
        masks = [([0] * len(p) + [1] * len(c))[:end] for p, c in zip(prompts, completions)]
        return collate_sequences(ids, masks, self.pad_id)

    def logratios(self, model, batch: dict[str, Tensor], held_out: bool = False):
        """Completion statistics of the policy on ``batch``'s sequences (with gradient), and their log-ratios."""
        policy = completion_stats(model, batch)
        reference = self.reference_logps(batch, model, held_out=held_out,
                                         policy_logps=policy.logps if held_out else None)
        return policy, policy.logps - reference

    def loss(self, model, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        desirable = batch["label"]
        if training and desirable.shape[0] < 2:
            raise UserError("algo=kto estimates its KL term from each prompt paired with another row's completion of "
                            "the same micro-batch, so a micro-batch needs at least 2 rows; it has 1. Fix: "
                            "train.per_device_batch_size=2 or more.")
        policy, logratios = self.logratios(model, batch, held_out=not training)
        with torch.no_grad():  # the reference point is not differentiated: no graph for the mismatched pairs
            mismatched = {name.removeprefix(KL): value for name, value in batch.items() if name.startswith(KL)}
            kl = kl_estimate(self.logratios(model, mismatched, held_out=not training)[1])
        loss = kto_loss(logratios, desirable, kl, self.beta, self.desirable_weight, self.undesirable_weight).mean()
        rewards, logps = self.beta * logratios.detach(), policy.logps.detach()
        metrics = {"loss": loss.detach(), "kl": kl}  # TRL's names; a side absent from the batch is not logged
        for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
            if rows.any():
                metrics[f"rewards/{name}"] = rewards[rows].mean()
                metrics[f"logps/{name}"] = logps[rows].mean()
        if desirable.any():
            metrics["exact_match"] = policy.greedy_match[desirable].float().mean()
            if not desirable.all():
                metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return loss, metrics

    def evaluate(self, model, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.loss(model, batch, training=False)[1]
