"""What the loop expects from an algorithm, and the forward pass every log-likelihood method shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rlhf.errors import UserError
from rlhf.validate import Range

# Allowed lengths for algorithms that tokenize prompt + completion (see rlhf.validate.limits).
PROMPT_TOKENS = Range(ge=1, integer=True, meaning="tokens a prompt keeps; null for no limit", fix=512)
SEQUENCE_TOKENS = Range(ge=1, integer=True, meaning="tokens of prompt + completion; null for no limit", fix=1024)


def prompt_leaves_room(values: dict[str, Any], where: str) -> None:
    """Refuse ``max_prompt_length >= max_length``: a prompt that long leaves no completion token to learn from."""
    prompt, total = values.get("max_prompt_length"), values.get("max_length")
    if isinstance(prompt, int) and isinstance(total, int) and prompt >= total:
        raise UserError(f"{where}.max_prompt_length={prompt} must be < {where}.max_length={total}: a prompt that long "
                        f"leaves no room for the completion, so nothing is learned from it. Fix: "
                        f"{where}.max_prompt_length={max(1, total // 2)} (or a larger {where}.max_length)")


class Algorithm(Protocol):
    """The contract between the loop and an algorithm. The loop never asks which algorithm it runs."""

    columns: tuple[str, ...]

    def tokenize(self, row: dict[str, str], tokenizer) -> dict[str, list[int]]: ...

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]: ...

    def setup(self, policy: torch.nn.Module, tokenizer, accelerator) -> None: ...

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]: ...

    def evaluate(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]: ...


@dataclass
class CompletionStats:
    """Per-sequence statistics of the completion tokens of a batch (``B`` sequences, ``T`` positions)."""

    logps: Tensor  # [B] summed log-probability of the completion tokens (EOS included)
    num_tokens: Tensor  # [B] completion tokens per sequence
    greedy_match: Tensor  # [B] bool: argmax is the target at every completion position (= greedy decode matches)
    token_logps: Tensor  # [B, T-1] log-probability of each next token
    mask: Tensor  # [B, T-1] bool, True on completion tokens


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materializing the full log-softmax. Shapes [B,T,V],[B,T]."""
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def completion_stats(model: torch.nn.Module, batch: dict[str, Tensor]) -> CompletionStats:
    """One forward pass; log-probabilities of each sequence's completion given its prompt."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["input_ids"][:, 1:]
    mask = batch["completion_mask"][:, 1:].bool()
    token_logps = selective_log_softmax(logits, labels) * mask
    greedy = ((logits.argmax(-1) == labels) | ~mask).all(-1)
    return CompletionStats(token_logps.sum(-1), mask.sum(-1), greedy, token_logps, mask)
