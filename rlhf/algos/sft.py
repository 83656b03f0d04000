"""Supervised fine-tuning: maximize the likelihood of demonstrations.

Loss: mean negative log-likelihood per token, over the completion tokens (``completion_only_loss=True``,
TRL's default for prompt-completion data) or over every token (``False``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from rlhf.algos.base import PROMPT_TOKENS, SEQUENCE_TOKENS, Algorithm, prompt_leaves_room
from rlhf.core.limits import limits
from rlhf.data import layout_masks
from rlhf.data.collate import collate_packed, collate_sequences, require_completion
from rlhf.data.encoding import FORMAT_COLUMN, TEXT, encode
from rlhf.ops.completion_logps import completion_stats, keep_completion_logits
from rlhf.ops.output_layer import check_when, tap_output_layer


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
            earliest one on; :func:`~rlhf.ops.completion_logps.keep_completion_logits`). On by default; it saves nothing with
            ``completion_only_loss=false`` (every token is scored).
        fused_output_layer: where the output layer computes the token log-probabilities itself, a tile of logits at a time,
            the ``[B, T, V]`` logits never whole (:mod:`rlhf.ops.output_layer`): ``auto`` (on a GPU), ``true``
            (also on a CPU, where it measured 0.91-1.11x), ``triton`` (the Triton kernel on a GPU) or ``false``.
        padding_free: a micro-batch's rows packed into one sequence without padding, position ids restarting in
            each row (TRL's ``padding_free``; :func:`~rlhf.data.collate.collate_packed`): no token is padding, and
            the rows are kept apart by their position ids (the variable-length kernel under flash attention, a
            block mask of the rows under flex attention; on a CPU, a block-diagonal causal mask under sdpa and
            eager). On a GPU, a model under ``sdpa`` or ``eager`` (whose mask grows with the packed length squared)
            is switched to ``flex_attention``, or refused at setup where it does not support it
            (:func:`~rlhf.data.layout_masks.attention_for_packing`). The same loss and metrics as padded batches
            (tested); a model that cannot take it is refused at setup.
    """

    columns = ("prompt", "completion")
    tokenize_reads = ("completion_only_loss", "max_prompt_length", "max_length")
    answer_metrics = ("exact_match",)  # the embedded task's one answer (Algorithm.answer_metrics)
    eval_metrics = ("loss", "num_tokens", "exact_match")

    def __init__(self, completion_only_loss: bool = True, max_prompt_length: int | None = 512,
                 max_length: int | None = 1024, completion_logits_only: bool = True,
                 fused_output_layer: bool | str = "auto", padding_free: bool = False) -> None:
        self.completion_only_loss, self.completion_logits_only = completion_only_loss, completion_logits_only
        self.padding_free = padding_free
        self.fused_output_layer = check_when(fused_output_layer)
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        self.pad_id = 0

    def tokenize(self, row: dict[str, str], tokenizer) -> dict[str, list[int]]:
        out = encode(tokenizer, row["prompt"], row["completion"], self.max_prompt_length, self.max_length,
                     row.get(FORMAT_COLUMN, TEXT))
        require_completion(out, row, "completion", self.max_length)
        if not self.completion_only_loss:
            out["completion_mask"] = [1] * len(out["input_ids"])
        return out

    def setup(self, policy, tokenizer) -> None:
        self.pad_id = tokenizer.pad_token_id
        tap_output_layer(policy, self.fused_output_layer)
        if self.padding_free:  # on a GPU, flex attention where sdpa would need an N x N mask (or refused)
            if (switch := layout_masks.attention_for_packing(policy, on_gpu=layout_masks.computes_on_gpu())) is not None:
                policy.set_attn_implementation(switch)
            require_packing(policy)

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        ids, masks = [r["input_ids"] for r in rows], [r["completion_mask"] for r in rows]
        batch = collate_packed(ids, masks) if self.padding_free else collate_sequences(ids, masks, self.pad_id)
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


def require_packing(model, warn: bool = True) -> None:
    """Refuse ``padding_free`` for a model whose attention does not keep packed rows apart by their position ids:
    two rows of three tokens, packed and alone, must give the same logits (checked where the model is, before a
    strategy places it: on a CPU for a model that trains on a GPU). Flash and flex attention keep them apart by
    construction (variable-length sequences, a block mask) and have no CPU kernel to check with: not checked."""
    import torch

    from rlhf.core.errors import UserError

    attention = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
    if attention.startswith(("flash_attention", "flex_attention")):
        return
    if warn:
        logging.getLogger(__name__).warning(
            "algo.padding_free=true under %s attention: a packed micro-batch of N tokens (rows x their lengths) takes "
            "an N x N mask, whose memory grows with the square of N; model.attn_implementation=flash_attention_2 (or "
            "flex_attention) keeps the rows apart without one", attention or "this model's")

    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            alone = model(input_ids=ids[:, 3:], use_cache=False).logits.float()
    finally:
        model.train(training)
    if not torch.allclose(packed[:, 3:], alone, atol=1e-3, rtol=1e-3):
        name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise UserError(f"algo.padding_free=true: this model ({name}) lets packed rows attend to each other (its "
                        "attention does not separate rows by their position ids). Fix: algo.padding_free=false")
