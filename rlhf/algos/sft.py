"""Supervised fine-tuning: maximize the likelihood of demonstrations.

Loss: mean negative log-likelihood per token, over the completion tokens (``completion_only_loss=True``,
TRL's default for prompt-completion data) or over every token (``False``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf.algos.base import (
    PROMPT_TOKENS,
    SEQUENCE_TOKENS,
    Algorithm,
    completion_stats,
    keep_completion_logits,
    prompt_leaves_room,
)
from rlhf.data.collate import collate_sequences, encode, require_completion
from rlhf.models.output_layer import check_when, tap_output_layer
from rlhf.validate import limits


def nll_loss(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood over the masked tokens of the batch. Shapes ``[B, T]`` -> scalar."""
    return -(token_logps * mask).sum() / mask.sum().clamp(min=1)


@limits(prompt_leaves_room, max_prompt_length=PROMPT_TOKENS, max_length=SEQUENCE_TOKENS)
class SFT(Algorithm):
    """Supervised fine-tuning on ``prompt``/``completion`` rows (or ``messages``/``text``).

    Args:
        completion_only_loss: train on completion tokens only (True) or on prompt and completion (False).
        max_prompt_length: prompts longer than this many tokens keep their end (>= 1, < max_length, or null).
        max_length: sequences longer than this many tokens lose their end (>= 1, or null).
        completion_logits_only: compute the output layer only where it scores completion tokens (from the batch's
            earliest one on; :func:`~rlhf.algos.base.keep_completion_logits`). On by default; it saves nothing with
            ``completion_only_loss=false`` (every token is scored).
        fused_output_layer: where the output layer computes the token log-probabilities itself, a tile of logits at a time,
            the ``[B, T, V]`` logits never whole (:mod:`rlhf.models.output_layer`): ``auto`` (on a GPU), ``true``
            (also on a CPU, where it measured 0.91-1.11x) or ``false``.
    """

    columns = ("prompt", "completion")
    tokenize_reads = ("completion_only_loss", "max_prompt_length", "max_length")
    eval_metrics = ("loss", "num_tokens", "exact_match")

    def __init__(self, completion_only_loss: bool = True, max_prompt_length: int | None = 512,
                 max_length: int | None = 1024, completion_logits_only: bool = True,
                 fused_output_layer: bool | str = "auto") -> None:
        self.completion_only_loss, self.completion_logits_only = completion_only_loss, completion_logits_only
        self.fused_output_layer = check_when(fused_output_layer)
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        self.pad_id = 0

    def tokenize(self, row: dict[str, str], tokenizer) -> dict[str, list[int]]:
        out = encode(tokenizer, row["prompt"], row["completion"], self.max_prompt_length, self.max_length,
                     add_special_tokens=True)
        require_completion(out, row, "completion", self.max_length)
        if not self.completion_only_loss:
            out["completion_mask"] = [1] * len(out["input_ids"])
        return out

    def setup(self, policy, tokenizer) -> None:
        self.pad_id = tokenizer.pad_token_id
        tap_output_layer(policy, self.fused_output_layer)

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        batch = collate_sequences([r["input_ids"] for r in rows], [r["completion_mask"] for r in rows], self.pad_id)
        return keep_completion_logits(batch) if self.completion_logits_only else batch

    def loss(self, model, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        stats = completion_stats(model, batch)
        loss = nll_loss(stats.token_logps, stats.mask)
        metrics = {
            "loss": loss.detach(),
            "num_tokens": stats.num_tokens.float().mean(),
            "exact_match": stats.greedy_match.float().mean(),
        }
        return loss, metrics

    def evaluate(self, model, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.loss(model, batch)[1]
