"""Reward functions for online algorithms, and scoring a batch of completions with several of them.

A reward function is any Python callable ``fn(prompts, completions, **columns) -> list[float]`` (TRL's reward
function signature): ``prompts`` and ``completions`` are lists of strings of equal length, ``columns`` the dataset's
other columns of those rows (``algo.reward_columns``), each a list. A value may be ``None`` (or NaN) where the
function does not apply to a sample. The config names them by ``_target_`` (``_partial_: true`` for a function),
under ``algo.reward_funcs`` (``conf/algo/reward_funcs/``), one name each: the name is the metric's
``rewards/<name>/mean``. A reward model saved by ``algo=reward`` would be one more such callable (not written yet).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from difflib import SequenceMatcher
from typing import Any

import torch
from torch import Tensor

from rlhf.algos.reward_shaping import weighted_rewards
from rlhf.data.tasks import ReverseTask
from rlhf.errors import UserError

RewardFunction = Callable[..., Sequence[float | None]]


def exact_match(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """The embedded task's reward (:meth:`rlhf.data.tasks.ReverseTask.reward`): 1.0 where the completion is exactly
    the reversed string of the prompt (surrounding white space ignored), else 0.0."""
    return ReverseTask.reward(ReverseTask(), prompts, completions)


def char_similarity(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """A graded reward for the embedded task, in [0, 1]: the similarity of the completion to the right answer,
    ``2·M / (len(answer) + len(completion))`` with ``M`` the characters of the longest matching blocks
    (:class:`difflib.SequenceMatcher`'s ratio). 1.0 exactly where :func:`exact_match` is 1."""
    return [SequenceMatcher(None, ReverseTask.answer(p), c.strip(), autojunk=False).ratio()
            for p, c in zip(prompts, completions)]


def score(functions: Mapping[str, RewardFunction], weights: Sequence[float] | None, prompts: Sequence[str],
          completions: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None) -> tuple[Tensor, Tensor]:
    """Every function on every sample: ``(reward [B], per_function [B, F])`` in float32. ``reward`` is the weighted
    sum that trains (:func:`rlhf.algos.reward_shaping.weighted_rewards`); ``per_function`` holds each function's own
    values (NaN where one does not apply), whose column means are logged as ``rewards/<name>/mean``."""
    columns = dict(columns or {})
    values = []
    for name, function in functions.items():
        got = list(function(prompts=list(prompts), completions=list(completions), **columns))
        if len(got) != len(completions):
            raise UserError(f"reward function {name!r} returned {len(got)} values for {len(completions)} completions. "
                            "Fix: return one float (or None where it does not apply) per completion, in order")
        values.append([math.nan if v is None else float(v) for v in got])
    per_function = torch.tensor(values, dtype=torch.float32).T.reshape(len(completions), len(values))
    weight = None if weights is None else torch.tensor(list(weights), dtype=torch.float32)
    reward, _ = weighted_rewards(per_function, weight)
    return reward, per_function
