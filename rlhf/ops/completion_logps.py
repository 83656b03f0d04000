"""The forward pass every log-likelihood method shares: the log-probabilities of each sequence's completion given
its prompt (:func:`completion_stats`), for the algorithms (SFT, the DPO family, KTO, iterative SFT) and the reference
strategies alike, in one pass that computes the output layer only where a completion token is scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.data import layout_masks, shared_prompt
from rlhf.data.collate import PACKED_ROWS, SEGMENT_IDS
from rlhf.ops.output_layer import answer, token_request
from rlhf.ops.token_logps import selective_log_softmax


@dataclass
class CompletionStats:
    """Per-sequence statistics of the completion tokens of a batch (``B`` sequences, ``T`` positions)."""

    logps: Tensor  # [B] summed log-probability of the completion tokens (EOS included)
    num_tokens: Tensor  # [B] completion tokens per sequence
    greedy_match: Tensor  # [B] bool: argmax is the target at every completion position (= greedy decode matches)
    token_logps: Tensor  # [B, T-1] log-probability of each next completion token (0 elsewhere)
    mask: Tensor  # [B, T-1] bool, True on completion tokens
    every_token_logps: Tensor  # [B, T-1] log-probability of each next token, prompt and padding included (0 where
    # keep_completion_logits left it out: before LOGITS_TO_KEEP's positions, and outside SCORED_ROWS on a tapped layer)


LOGITS_TO_KEEP = "logits_to_keep"  # a batch key: compute the output layer only at the last this many positions
SCORED_ROWS = "scored_rows"  # a batch key: [N] flat indices b * W + t of the positions that score a completion token
SCORED_ROWS_WIDTH = "scored_rows_width"  # a batch key: W, an int: T - 1 when the batch was collated (padded later, the
# batch keeps its indices: rlhf.data.collate.pad_to_multiple adds positions on the right only)


def keep_completion_logits(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with :data:`LOGITS_TO_KEEP` set so that :func:`completion_stats` computes the output layer (and
    its log-softmax over the vocabulary) only from the position before the batch's earliest completion token on:
    the positions that score a completion token. The prompt's positions before it cost no ``[B, T, V]`` logits.
    Every model of transformers' ``*ForCausalLM`` takes ``logits_to_keep``. The forward pass's values are the same
    bit for bit; the output layer's gradient sums fewer rows (zeros) and may differ in the last bits.

    And :data:`SCORED_ROWS`, exactly those positions (flat indices ``b * (T - 1) + t`` into the ``[B, T - 1]`` grid
    of next-token positions, where token ``t + 1`` of sequence ``b`` is a completion token; ``T - 1`` also as
    :data:`SCORED_ROWS_WIDTH`), built here on the host where the batch is collated, a tensor that moves to the
    device with the batch: a tapped output layer (:mod:`rlhf.ops.output_layer`) computes only those rows, none of the prompt
    and padding positions after the earliest completion token either. Call it only where the statistics of the
    completion tokens are all that is read (not the prompt's: ``every_token_logps`` is then 0 elsewhere)."""
    mask = batch["completion_mask"]
    scored = mask[:, 1:].any(0)  # positions 1..T-1 that hold some sequence's completion token
    first = int(scored.float().argmax()) + 1 if bool(scored.any()) else mask.shape[1] - 1
    # a Python int: it stays on the host when the batch moves to the device, so reading it waits for nothing
    return {**batch, LOGITS_TO_KEEP: mask.shape[1] - first + 1,
            SCORED_ROWS: mask[:, 1:].reshape(-1).nonzero().squeeze(-1), SCORED_ROWS_WIDTH: mask.shape[1] - 1}


def completion_stats(model: torch.nn.Module, batch: dict[str, Tensor]) -> CompletionStats:
    """One forward pass; log-probabilities of each sequence's completion given its prompt. With
    :data:`LOGITS_TO_KEEP` in the batch (:func:`keep_completion_logits`) only the last positions get logits; the
    statistics keep their ``[B, T-1]`` shape, 0 (and masked out) before them. A model whose output layer is tapped
    (:func:`rlhf.ops.output_layer.tap_output_layer`) answers with the log-probabilities themselves, the logits
    never whole; any other computes logits and :func:`selective_log_softmax` reads them. A batch of pairs laid out
    around a shared prompt (:mod:`rlhf.data.shared_prompt`: ``B`` padded rows, or one packed row) gives the
    statistics of its ``2B`` answers, chosen first, as a plain batch of the pairs' ``2B`` sequences would."""
    keep = int(batch.get(LOGITS_TO_KEEP) or 0)
    extra = {"logits_to_keep": keep} if keep else {}
    shared = shared_prompt.BRANCH_IDS in batch
    packed = PACKED_ROWS in batch  # several sequences in one row: padding-free, or pairs packed around their prompts
    # their mask (or position ids), built at the batch's first forward pass and kept in it for the next (reference)
    inputs = (layout_masks.model_inputs(batch, model) if shared or packed
              else {"attention_mask": batch["attention_mask"]})
    length = batch["input_ids"].shape[1]
    rows = batch.get(SCORED_ROWS)
    if rows is not None:  # b * W + t -> b * L + t - skipped: the [B, L] window from position skipped = T - keep
        width, window = max(int(batch[SCORED_ROWS_WIDTH]), 1), (keep or length) - 1
        rows = rows // width * window + rows % width - (length - (keep or length))
    # A tapped output layer answers only if it sees the positions asked for (the last `keep`, or all)
    with token_request(batch["input_ids"][:, length - (keep or length) + 1:], with_argmax=True, rows=rows) as request:
        logits = model(input_ids=batch["input_ids"], **inputs, **extra).logits
    answered = answer(request, logits)
    if answered is not None:
        skipped = length - (keep or length)  # leading positions without logits
        every_token_logps, greedy_tokens = answered, request.argmax
    else:
        if logits.dim() != 3 or logits.shape[-1] == 1:  # a sequence-classification or value head: one scalar each
            raise UserError(f"this algorithm needs next-token logits, but the model outputs shape "
                            f"{list(logits.shape)}: it has another head. Fix: model.head=causal_lm")
        skipped = length - logits.shape[1]  # leading positions without logits
        every_token_logps, greedy_tokens = selective_log_softmax(logits, batch["input_ids"][:, skipped + 1:],
                                                                 with_argmax=True)  # positions 0..T-2
    labels = batch["input_ids"][:, skipped + 1:]
    mask = batch["completion_mask"][:, skipped + 1:].bool()
    token_logps = every_token_logps * mask
    hits = (greedy_tokens == labels) | ~mask
    if skipped:
        every_token_logps, token_logps = (torch.nn.functional.pad(x, (skipped, 0)) for x in (every_token_logps,
                                                                                             token_logps))
        mask, hits = (torch.nn.functional.pad(x, (skipped, 0), value=value) for x, value in ((mask, False),
                                                                                         (hits, True)))
    if shared and not packed:  # B rows -> 2B answers; every_token_logps: both branches in each row (nll_on_prompt)
        token_logps, mask, hits = shared_prompt.split_branches(batch[shared_prompt.BRANCH_IDS], token_logps, mask,
                                                               hits)
        hits |= ~mask
        every_token_logps = torch.cat([every_token_logps, every_token_logps])
    if packed:  # per packed sequence (answer): sums over the positions whose next token is the sequence's
        rows, segments = batch[PACKED_ROWS], batch[SEGMENT_IDS][0, 1:]

        def per_row(values: Tensor) -> Tensor:
            return values.new_zeros(rows).index_add_(0, segments, values[0])

        return CompletionStats(per_row(token_logps), per_row(mask.long()), per_row((~hits).long()) == 0,
                               token_logps, mask, every_token_logps)
    greedy = hits.all(-1)
    return CompletionStats(token_logps.sum(-1), mask.sum(-1), greedy, token_logps, mask, every_token_logps)
