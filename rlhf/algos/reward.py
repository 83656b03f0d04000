"""Reward modeling: a Bradley–Terry model of pairwise preferences on a sequence-classification head.

The model reads each prompt + completion and returns one scalar ``r`` at its last token. The loss is
``-log sigmoid(r_chosen - r_rejected)`` (Bradley & Terry 1952; as in InstructGPT, Ouyang et al. 2022,
arXiv:2203.02155), optionally with a per-pair margin subtracted inside the sigmoid (Llama 2, Touvron et al. 2023,
arXiv:2307.09288) and a reward-centering term ``c * mean((r_chosen + r_rejected)^2)`` that keeps rewards near 0
(Eisenstein et al. 2023, arXiv:2312.09244), as TRL's ``RewardTrainer`` computes them. The saved model is an
``AutoModelForSequenceClassification`` with one label: what an online algorithm loads as its learned reward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.algos.base import PROMPT_TOKENS, SEQUENCE_TOKENS, Algorithm, prompt_leaves_room
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data.collate import collate_sequences, require_completion
from rlhf.data.encoding import FORMAT_COLUMN, TEXT, TRUNCATED, encode_answers

MARGIN = "margin"  # an optional numeric column of preference rows: how much better chosen is than rejected


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None) -> Tensor:
    """Per-pair loss ``-log sigmoid(r_chosen - r_rejected - margin)``, ``[B]``; ``margin`` ``[B]`` or None (0).
    With equal rewards and no margin it is ``log 2``."""
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    return -F.logsigmoid(difference)


def centering_penalty(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """``mean((r_chosen + r_rejected)^2)``: 0 when each pair's rewards sum to 0 (Eisenstein et al. 2023)."""
    return ((chosen_rewards + rejected_rewards) ** 2).mean()


def _sequence_classification(values: dict[str, Any], where: str) -> None:
    head = values.get("head", "sequence_classification")
    if head != "sequence_classification":
        raise UserError(f"{where}.head={head}: a reward model is trained on a sequence-classification head (one "
                        f"scalar per sequence). Fix: {where}.head=sequence_classification")


@limits(
    _sequence_classification,
    prompt_leaves_room,
    center_rewards_coefficient=Range(ge=0, meaning="weight of the reward-centering term; 0 turns it off, 0.01 is "
                                     "common", fix=0.01),
    max_prompt_length=PROMPT_TOKENS,
    max_length=SEQUENCE_TOKENS,
)
class Reward(Algorithm):
    """A reward model on ``prompt``/``chosen``/``rejected`` rows (and ``margin`` where rows carry one); chosen and
    rejected share one forward pass.

    Args:
        head: the model head this algorithm trains, ``sequence_classification``; the ``model`` group reads it
            (``model.head: ${oc.select:algo.head,causal_lm}``), so ``algo=reward`` builds the right model.
        center_rewards_coefficient: weight (>= 0) of ``mean((r_chosen + r_rejected)^2)``; 0 turns it off.
        max_prompt_length: prompts longer than this many tokens keep their end (>= 1, < max_length, or null).
        max_length: sequences longer than this many tokens lose their end (>= 1, or null).
    """

    columns = ("prompt", "chosen", "rejected")
    eval_metrics = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "rewards/chosen",
                    "rewards/rejected")
    optional_columns = (MARGIN,)  # a data file's numeric margin column reaches tokenize (rlhf.data)
    tokenize_reads = ("max_prompt_length", "max_length")

    def __init__(self, head: str = "sequence_classification", center_rewards_coefficient: float = 0.0,
                 max_prompt_length: int | None = 512, max_length: int | None = 1024) -> None:
        self.head = head
        self.center_rewards_coefficient = center_rewards_coefficient
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        self.pad_id = 0

    def tokenize(self, row: dict[str, Any], tokenizer) -> dict[str, Any]:
        out: dict[str, Any] = {TRUNCATED: 0}
        sides = encode_answers(tokenizer, row["prompt"], {side: row[side] for side in ("chosen", "rejected")},
                               row.get(FORMAT_COLUMN, TEXT), self.max_prompt_length, self.max_length)
        for side, encoded in sides.items():
            require_completion(encoded, row, side, self.max_length)
            out[f"{side}_input_ids"] = encoded["input_ids"]
            out[TRUNCATED] |= encoded[TRUNCATED]
        if row.get(MARGIN) is not None:
            out[MARGIN] = float(row[MARGIN])
        return out

    def setup(self, policy, tokenizer) -> None:
        self.pad_id = tokenizer.pad_token_id

    def samples(self, batch: dict[str, Any]) -> int:
        return int(batch["input_ids"].shape[0]) // 2  # pairs: chosen and rejected sequences

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        """Chosen sequences first, then rejected: ``[2B, T]`` for one forward pass; ``margin`` ``[B]`` if given."""
        ids = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
        batch = collate_sequences(ids, [[1] * len(s) for s in ids], self.pad_id)
        if rows and MARGIN in rows[0]:
            batch[MARGIN] = torch.tensor([float(r[MARGIN]) for r in rows])
        return batch

    def rewards(self, model, batch: dict[str, Tensor]) -> Tensor:
        """One scalar per sequence, ``[2B]`` (the head reads each sequence at its last non-pad token)."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise UserError(f"algo=reward got model outputs of shape {list(logits.shape)}, not one scalar per "
                            "sequence: the model has another head. Fix: model.head=sequence_classification")
        return logits.squeeze(-1).float()

    def loss(self, model, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        rewards = self.rewards(model, batch)
        n = rewards.shape[0] // 2
        chosen, rejected = rewards[:n], rewards[n:]
        loss = bradley_terry_loss(chosen, rejected, batch.get(MARGIN)).mean()
        if self.center_rewards_coefficient:
            loss = loss + self.center_rewards_coefficient * centering_penalty(chosen, rejected)
        chosen, rejected, rewards = chosen.detach(), rejected.detach(), rewards.detach()
        # Names as TRL's RewardTrainer logs them, plus the two sides' means.
        metrics = {
            "loss": loss.detach(),
            "accuracy": (chosen > rejected).float().mean(),  # ties count as wrong
            "margin": (chosen - rejected).mean(),
            "mean_reward": rewards.mean(),
            "min_reward": rewards.min(),
            "max_reward": rewards.max(),
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
        }
        return loss, metrics

    def evaluate(self, model, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.loss(model, batch)[1]
