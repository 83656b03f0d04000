"""Tokenize prompt/completion pairs as TRL does, and pad them into batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN

TRUNCATED = "_truncated"  # a tokenized row's key: what truncation cut (bit flags below; 0: nothing)
PROMPT_CUT = 1  # the prompt was longer than max_prompt_length and kept its end
END_CUT = 2  # prompt + completion were longer than max_length and lost their end


def encode(
    tokenizer,
    prompt: str,
    completion: str,
    max_prompt_length: int | None = None,
    max_length: int | None = None,
    add_special_tokens: bool = False,
) -> dict[str, list[int]]:
    """Token ids of prompt + completion + EOS, and a mask that is 1 on the completion (EOS included).

    Prompt and completion are tokenized separately and EOS is appended to the completion, as TRL's DPO
    trainer does, so log-probabilities match TRL's on the same model and data. ``add_special_tokens`` adds the
    tokenizer's own specials (e.g. BOS) to the prompt, as TRL's SFT trainer does. A prompt longer than
    ``max_prompt_length`` keeps its last tokens; a sequence longer than ``max_length`` loses its end: what was cut
    is :data:`TRUNCATED`'s flags (:data:`PROMPT_CUT`, :data:`END_CUT`), counted before training
    (:func:`truncated_rows`).
    """
    if add_special_tokens and tokenizer.bos_token and prompt.startswith(tokenizer.bos_token):
        add_special_tokens = False  # a rendered chat template already starts with BOS: do not double it
    prompt_ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    cut = 0
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids, cut = (prompt_ids[-max_prompt_length:] if max_prompt_length > 0 else []), PROMPT_CUT
    input_ids = prompt_ids + completion_ids
    completion_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    if max_length is not None and len(input_ids) > max_length:
        input_ids, completion_mask, cut = input_ids[:max_length], completion_mask[:max_length], cut | END_CUT
    return {"input_ids": input_ids, "completion_mask": completion_mask, TRUNCATED: cut}


def truncated_rows(rows) -> dict[str, int]:
    """``{"rows", "prompt_cut", "end_cut", "either"}``: how many tokenized ``rows`` (a ``datasets.Dataset``) truncation
    cut, by what (:data:`TRUNCATED`; rows without the column count as uncut)."""
    flags = rows[TRUNCATED] if TRUNCATED in rows.column_names else []
    return {"rows": len(rows), "prompt_cut": sum(1 for f in flags if f & PROMPT_CUT),
            "end_cut": sum(1 for f in flags if f & END_CUT), "either": sum(1 for f in flags if f)}


def require_completion(encoded: dict[str, list[int]], row: dict, column: str, max_length: int | None) -> None:
    """Refuse a row of which not one completion token survived truncation (:func:`encode`'s ``completion_mask``).

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
