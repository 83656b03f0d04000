"""Tokenized rows into padded (or packed) batches; what truncation cut, counted; rows with no answer token refused.

The tokenizing itself is :mod:`rlhf.data.encoding`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN
from rlhf.data.encoding import END_CUT, PROMPT_CUT, TRUNCATED


def truncated_rows(rows) -> dict[str, int]:
    """``{"rows", "prompt_cut", "end_cut", "either"}``: how many tokenized ``rows`` (a ``datasets.Dataset``) truncation
    cut, by what (:data:`TRUNCATED`; rows without the column count as uncut)."""
    flags = rows[TRUNCATED] if TRUNCATED in rows.column_names else []
    return {"rows": len(rows), "prompt_cut": sum(1 for f in flags if f & PROMPT_CUT),
            "end_cut": sum(1 for f in flags if f & END_CUT), "either": sum(1 for f in flags if f)}


def require_completion(encoded: dict[str, list[int]], row: dict, column: str, max_length: int | None) -> None:
    """Refuse a row of which not one completion token survived truncation (:func:`rlhf.data.encoding.encode`'s ``completion_mask``).

    A long prompt is cut as usual; only when the prompt alone fills ``max_length`` is the row an error, naming the
    row by its :data:`~rlhf.data.checks.ROW_COLUMN` (file and row number) when it has one.
    """
    if any(encoded["completion_mask"]):
        return
    where = row.get(ROW_COLUMN) or "a row"
    raise UserError(f"{where}: not one token of {column!r} fits in algo.max_length={max_length}: the prompt fills "
                    "it. Fix: raise algo.max_length, set algo.max_prompt_length below it (long prompts then keep "
                    "their end), or shorten the prompt.")


def pad(sequences: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ints to one ``[len(sequences), longest]`` tensor."""
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), value, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate_sequences(input_ids: Sequence[Sequence[int]], completion_masks: Sequence[Sequence[int]], pad_id: int):
    """A right-padded batch: ``input_ids``, ``attention_mask`` and ``completion_mask``, each ``[B, T]``."""
    ids = pad(input_ids, pad_id)
    return {
        "input_ids": ids,
        "attention_mask": pad([[1] * len(s) for s in input_ids], 0),
        "completion_mask": pad(completion_masks, 0),
    }


PACKED_ROWS = "packed_rows"  # a batch key: how many rows a padding-free batch packs (a Python int)
SEGMENT_IDS = "segment_ids"  # a batch key: the packed row each position belongs to, [1, N]


def collate_packed(input_ids: Sequence[Sequence[int]], completion_masks: Sequence[Sequence[int]]):
    """A padding-free batch: every row's tokens one after the other in one sequence ``[1, N]`` (``N`` the rows'
    tokens, no padding), ``position_ids`` starting at 0 in each row (what makes transformers' attention keep the
    rows apart: a block-diagonal causal mask, or flash attention's variable-length kernel), ``segment_ids`` (the
    row of each position), ``completion_mask`` with each row's first token off (no row predicts the next row's
    first token, as no padded row predicts its own), an all-ones ``attention_mask`` (the loop counts tokens with
    it; the model is not given it) and :data:`PACKED_ROWS`."""
    flat = lambda rows: torch.tensor([t for row in rows for t in row], dtype=torch.long).unsqueeze(0)  # noqa: E731
    ids = flat(input_ids)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": flat([[0, *mask[1:]] for mask in completion_masks]),
        "position_ids": flat([range(len(row)) for row in input_ids]),
        SEGMENT_IDS: flat([[i] * len(row) for i, row in enumerate(input_ids)]),
        PACKED_ROWS: len(input_ids),
    }


def pad_to_multiple(batch: dict, multiple_tokens: int, pad_id: int = 0) -> dict:
    """``batch`` (a right-padded :func:`collate_sequences` batch, maybe with more keys) with its sequence length
    ``T`` (``input_ids``' second dimension) padded on the right to a multiple of ``multiple_tokens``: every 2-D tensor
    of ``T`` columns gains columns of zeros, ``input_ids`` of ``pad_id`` (masked positions: no mask covers them, and a
    sequence-classification head, which reads each row's last token that is not the pad id, reads the same one), and
    an int ``logits_to_keep`` (:func:`rlhf.ops.completion_logps.keep_completion_logits`, counted from the end) as
    many positions. A compiled model then sees few lengths (each new one a recompile). Layouts whose padding means
    more than zeros are returned as they are: packed (:data:`PACKED_ROWS`), pairs around a shared prompt (their
    ``position_ids``), and any batch without ``completion_mask`` (left-padded prompts)."""
    ids = batch.get("input_ids")
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or PACKED_ROWS in batch or "position_ids" in batch
            or "completion_mask" not in batch):
        return batch
    length = ids.shape[1]
    extra = -(-length // multiple_tokens) * multiple_tokens - length
    if extra == 0:
        return batch
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == length:
            # the tokens with the pad id (a sequence-classification head reads each row's last token that is not
            # the pad id), masks and labels with 0
            value = torch.nn.functional.pad(value, (0, extra), value=pad_id if key == "input_ids" else 0)
        elif key == "logits_to_keep" and isinstance(value, int) and value:
            value = value + extra
        out[key] = value
    return out


def collate_in_buckets(collate, multiple_tokens: int, pad_id: int, rows):
    """``collate(rows)`` with its length padded to a multiple of ``multiple_tokens`` (:func:`pad_to_multiple`, the
    tokens with ``pad_id``); a loader's ``collate_fn`` as ``functools.partial(collate_in_buckets, collate,
    multiple_tokens, pad_id)``."""
    return pad_to_multiple(collate(rows), multiple_tokens, pad_id)
