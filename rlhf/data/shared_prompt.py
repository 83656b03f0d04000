"""A preference pair as one sequence: chosen and rejected after one shared prompt (prefix sharing).

A pair's two sequences repeat its prompt, so a plain batch runs the prompt through every layer twice (policy and
reference alike). Prefix sharing (Wang & Hegde 2024, "Accelerating Direct Preference Optimization with Prefix
Sharing", arXiv:2410.20305) lays the pair out as one sequence under an attention mask that keeps the two answers
apart. This module's layout, with ``p`` the prompt's tokens:

    prompt[:p-1] | prompt[p-1] chosen | prompt[p-1] rejected | padding
    branch 0       branch 1             branch 2               -1

A token sees, among the tokens before it, the shared prefix (branch 0) and its own branch; both branches' position
ids go on from ``p - 1``. So every position computes what it computes in the pair's own sequence (the same keys,
values and positions, to rounding); the prompt's last token is in each branch so that each has the position that
predicts its first completion token, and the shift-by-one of next-token log-probabilities holds as in a plain batch.
A pair costs ``p + 1 + |chosen| + |rejected|`` tokens instead of ``2p + |chosen| + |rejected|``; the layers'
compute falls by the share of the prompt (the output layer scores completion tokens only either way:
``algo.completion_logits_only``).

:func:`collate` makes the batch of ``B`` padded rows (``branch_ids`` and ``position_ids`` beside the usual keys),
:func:`collate_packed` packs the ``B`` pairs into one row of their tokens, no padding (for flex attention's block
mask, which skips whole blocks of what no token sees: the other pair, the other branch); the masks a model takes for
either are :mod:`rlhf.data.layout_masks`'. :func:`split_branches` turns per-position statistics of ``B`` padded rows
into the usual ``[2B, ...]`` rows (chosen first), and :func:`unsupported` says why a model cannot take the layout, if
it cannot.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf.core.errors import UserError
from rlhf.data.collate import PACKED_ROWS, SEGMENT_IDS, pad

BRANCH_IDS = "branch_ids"  # a batch key: [B, T] 0 shared prefix, 1 chosen's branch, 2 rejected's, -1 padding
POSITION_IDS = "position_ids"  # a batch key: [B, T] each token's position in its pair's own sequence
PAIR_IDS = "pair_ids"  # a batch key of a packed layout: [1, N] the pair each position belongs to
PADDING = -1
# Families whose forward was checked to compute the same log-probabilities in this layout as in a plain batch
# (tests/data/test_shared_prompt.py builds each from a config): they take a custom 4D attention mask as it is and
# place tokens by position ids (rotary or learned positions).
CHECKED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox")
# transformers' attention implementations that apply a custom 4D mask as given (flash kernels take none)
MASKED_ATTENTION = ("sdpa", "eager", "rlhf_sdpa", "flex_attention")


def prefix_length(chosen_mask: Sequence[int], rejected_mask: Sequence[int]) -> int:
    """Tokens before a pair's first completion token (its prompt), the same in both sequences."""
    prompt = next((i for i, m in enumerate(chosen_mask) if m), len(chosen_mask))
    other = next((i for i, m in enumerate(rejected_mask) if m), len(rejected_mask))
    if prompt != other:
        raise UserError(f"a pair's chosen and rejected sequences start with prompts of {prompt} and {other} tokens: "
                        "they cannot share one. Fix: algo.shared_prompt=false")
    return prompt


def _pair_layout(c_ids: Sequence[int], c_mask: Sequence[int], r_ids: Sequence[int], r_mask: Sequence[int]
                 ) -> tuple[list[int], list[int], list[int], list[int]]:
    """One pair in the layout of the module docstring: its tokens, completion mask, branch ids and position ids."""
    prompt = prefix_length(c_mask, r_mask)
    if list(c_ids[:prompt]) != list(r_ids[:prompt]):
        raise UserError("a pair's chosen and rejected sequences start with different prompts: they cannot share "
                        "one. Fix: algo.shared_prompt=false")
    shared = max(prompt - 1, 0)  # the prefix; each branch starts at the prompt's last token
    c_branch, r_branch = list(c_ids[shared:]), list(r_ids[shared:])
    ids = list(c_ids[:shared]) + c_branch + r_branch
    # A branch's first token is predicted by the token before it, in the other branch (or the previous pair, packed):
    # never scored (with a prompt it is the prompt's last token anyway; without one, as a sequence's first token,
    # nothing predicts it).
    completion = [0] * shared + [0] + list(c_mask[shared + 1:]) + [0] + list(r_mask[shared + 1:])
    branches = [0] * shared + [1] * len(c_branch) + [2] * len(r_branch)
    positions = (list(range(shared)) + list(range(shared, shared + len(c_branch)))
                 + list(range(shared, shared + len(r_branch))))
    return ids, completion, branches, positions


def collate(chosen_ids: Sequence[Sequence[int]], chosen_masks: Sequence[Sequence[int]],
            rejected_ids: Sequence[Sequence[int]], rejected_masks: Sequence[Sequence[int]], pad_id: int
            ) -> dict[str, Tensor]:
    """``B`` pairs as ``B`` right-padded sequences in the layout of the module docstring: ``input_ids``,
    ``attention_mask`` (1 on tokens: what a step computes), ``completion_mask`` (1 on both answers' tokens, EOS
    included), :data:`BRANCH_IDS` and :data:`POSITION_IDS`, each ``[B, T]``."""
    pairs = [_pair_layout(*pair) for pair in zip(chosen_ids, chosen_masks, rejected_ids, rejected_masks, strict=True)]
    ids, completion, branches, positions = (list(column) for column in zip(*pairs, strict=True))
    return {"input_ids": pad(ids, pad_id), "attention_mask": pad([[1] * len(s) for s in ids], 0),
            "completion_mask": pad(completion, 0), BRANCH_IDS: pad(branches, PADDING), POSITION_IDS: pad(positions, 0)}


def collate_packed(chosen_ids: Sequence[Sequence[int]], chosen_masks: Sequence[Sequence[int]],
                   rejected_ids: Sequence[Sequence[int]], rejected_masks: Sequence[Sequence[int]]
                   ) -> dict[str, Tensor | int]:
    """``B`` pairs packed into one row ``[1, N]`` of their tokens, no padding: each pair in the layout of the module
    docstring, one after the other. Beside :func:`collate`'s keys (``attention_mask`` all ones), :data:`PAIR_IDS`
    (the pair of each position: a token sees no other pair's), :data:`~rlhf.data.collate.SEGMENT_IDS` (the answer
    whose statistics each position's token counts in: pair ``i``'s chosen ``i``, its rejected ``B + i``, its
    prefix ``i``, never scored) and :data:`~rlhf.data.collate.PACKED_ROWS` ``= 2B``: the statistics come out as a
    plain batch's ``2B`` sequences, chosen first (:func:`rlhf.ops.completion_logps.completion_stats`)."""
    pairs = [_pair_layout(*pair) for pair in zip(chosen_ids, chosen_masks, rejected_ids, rejected_masks, strict=True)]
    rows = len(pairs)
    answers = [[i if branch < 2 else rows + i for branch in layout[2]] for i, layout in enumerate(pairs)]
    flat = lambda column: torch.tensor([t for row in column for t in row], dtype=torch.long).unsqueeze(0)  # noqa: E731
    ids, completion, branches, positions = (flat(column) for column in zip(*pairs, strict=True))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
            BRANCH_IDS: branches, POSITION_IDS: positions, PAIR_IDS: flat([[i] * len(p[0]) for i, p in enumerate(pairs)]),
            SEGMENT_IDS: flat(answers), PACKED_ROWS: 2 * rows}


def split_branches(branch: Tensor, *per_position: Tensor) -> list[Tensor]:
    """Per-position ``[B, T-1]`` statistics of predicted tokens ``1..T-1`` (``branch``: the batch's ``[B, T]``
    :data:`BRANCH_IDS`) as ``[2B, T-1]``: the chosen branch's positions in rows ``0..B-1`` (others 0/False), the
    rejected's in rows ``B..2B-1``, as a plain batch's sequences are laid out."""
    predicted = branch[:, 1:]
    chosen, rejected = predicted == 1, predicted == 2
    return [torch.cat([x * chosen, x * rejected]) if x.dtype != torch.bool else torch.cat([x & chosen, x & rejected])
            for x in per_position]


def scored_sequences(batch: dict[str, Tensor]) -> int:
    """How many sequences' statistics a forward pass of ``batch`` gives (:func:`rlhf.ops.completion_logps.completion_stats`):
    the sequences it packs where it packs rows (padding-free, :func:`rlhf.data.collate.collate_packed`, or pairs
    around their prompts, :func:`collate_packed`), two a row where its padded rows share prompts (chosen and
    rejected), else one a row."""
    if PACKED_ROWS in batch:
        return int(batch[PACKED_ROWS])
    rows = int(batch["input_ids"].shape[0])
    return 2 * rows if BRANCH_IDS in batch else rows


def unsupported(model: Any, max_length: int | None) -> str | None:
    """Why ``model`` cannot take the layout (None if it can): its family is not one checked here
    (:data:`CHECKED_FAMILIES`), its attention takes no custom mask, or it has a sliding window shorter than
    ``max_length`` (the custom mask would lift it)."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in CHECKED_FAMILIES:
        return f"model family {family!r} is not one checked to take it ({', '.join(CHECKED_FAMILIES)})"
    attention = attention_of(model)
    if attention not in MASKED_ATTENTION:
        return f"attention {attention!r} takes no custom mask (it needs one of {', '.join(MASKED_ATTENTION)})"
    window = getattr(config, "sliding_window", None)
    uses_window = any(kind == "sliding_attention" for kind in getattr(config, "layer_types", None) or ()) or (
        window is not None and getattr(config, "use_sliding_window", True))
    if uses_window and window is not None and (max_length is None or window < max_length):
        return f"its sliding window ({window} tokens) is shorter than algo.max_length={max_length}"
    forward = inspect.signature(type(model).forward).parameters
    if "position_ids" not in forward and not any(p.kind is p.VAR_KEYWORD for p in forward.values()):
        return "its forward takes no position_ids"
    return None


def attention_of(model: Any) -> str | None:
    """The attention implementation of ``model``, through the wrappers a strategy puts around it (DDP's and
    DeepSpeed's ``module``; DeepSpeed's engine has a ``config`` of its own, not the model's)."""
    while not hasattr(getattr(model, "config", None), "_attn_implementation") and hasattr(model, "module"):
        model = model.module
    return getattr(getattr(model, "config", None), "_attn_implementation", None)
