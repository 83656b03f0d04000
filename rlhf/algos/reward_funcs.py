"""Reward functions for online algorithms, and scoring a batch of completions with several of them.

A reward function is any Python callable ``fn(prompts, completions, **columns) -> list[float]`` (TRL's reward
function signature): ``prompts`` and ``completions`` are lists of strings of equal length, ``columns`` the dataset's
other columns of those rows (``algo.reward_columns``), each a list. A value may be ``None`` (or NaN) where the
function does not apply to a sample. The config names them by ``_target_`` (``_partial_: true`` for a function),
under ``algo.reward_funcs`` (``conf/algo/reward_funcs/``), one name each: the name is the metric's
``rewards/<name>/mean``. A reward model saved by ``algo=reward`` is one more such callable: :class:`RewardModel`
(``conf/algo/reward_funcs/reward_model.yaml``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from difflib import SequenceMatcher
from typing import Any

import torch
from torch import Tensor

from rlhf.algos.reward_shaping import weighted_rewards
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, limits
from rlhf.data.chat_tasks import SumsTask
from rlhf.data.collate import collate_sequences
from rlhf.data.encoding import encode
from rlhf.data.tasks import ReverseTask

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


# The embedded task's rewards score a completion against the prompt reversed: they fit only that task's prompts
# (``fits_prompt``), and a run that would train or evaluate with them on data whose first prompt is another is refused
# before anything loads (rlhf.config.checks). A reward function of one's own leaves the attribute unset.
exact_match.fits_prompt = ReverseTask.is_prompt
char_similarity.fits_prompt = ReverseTask.is_prompt


def sum_answer(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
    """The sums chat task's reward (:meth:`rlhf.data.chat_tasks.SumsTask.reward`, ``data=sums``): 1.0 where the
    completion's first whole number is the sum the prompt asks for ("The answer is 85." counts), else 0.0; None for
    a prompt that asks no such question. Prompts as online algorithms and ``eval=generate`` hand them over: rendered
    by the chat template (the question is found inside the rendered text)."""
    return SumsTask.reward(prompts, completions)


# Refused on data whose first prompt asks no sum (rlhf.config.checks), as the embedded task's rewards are elsewhere.
sum_answer.fits_prompt = SumsTask.is_prompt


def functions_and_weights(functions: Mapping[str, Callable] | None, weights: Sequence[float] | None, where: str
                          ) -> tuple[dict[str, Callable], list[float] | None]:
    """``(name -> function, weights)`` as configured under ``where`` (``algo``, ``eval``): the embedded task's exact
    match when none is given; one weight per function, or None (all 1), else a UserError naming the fix."""
    functions = dict(functions or {"exact_match": exact_match})
    for name, function in functions.items():
        if not callable(function):
            raise UserError(not_a_function(f"{where}.reward_funcs", name, function))
    weights = None if weights is None else [float(w) for w in weights]
    if weights is not None and len(weights) != len(functions):
        raise UserError(f"{where}.reward_weights has {len(weights)} values for {len(functions)} reward functions "
                        f"({', '.join(functions)}). Fix: one weight per function, in their order, or "
                        f"{where}.reward_weights=null (all 1)")
    return functions, weights


def not_a_function(where: str, name: str, value: Any) -> str:
    """Why ``<where>.<name>`` (an entry of the reward functions, after instantiation) is refused: it is not callable
    (no ``_target_``). An entry named ``reward_funcs`` or ``reward_weights`` is an option file's own keys one level
    down: its ``# @package`` line was not the file's first (Hydra reads the header only above every other line)."""
    text = f"{where}.{name} is a {type(value).__name__}, not a function (an entry without _target_)."
    if name in ("reward_funcs", "reward_weights"):
        return (f"{text} Its keys are a reward option file's own, one level down: the file's `# @package "
                f"{where.rsplit('.', 1)[0]}` is not its first line, and Hydra reads that header only above every "
                "other line, comments included. Fix: move `# @package ...` to the file's first line")
    return (f"{text} Fix: {where}.{name}: {{_target_: my_module.my_function, _partial_: true}} (a function), or "
            f"{{_target_: my_module.MyClass, ...}} (a callable object)")


def score(functions: Mapping[str, RewardFunction], weights: Sequence[float] | None, prompts: Sequence[str],
          completions: Sequence[str], columns: Mapping[str, Sequence[Any]] | None = None,
          device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Every function on every sample: ``(reward [B], per_function [B, F])`` in float32 on ``device`` (the samples'
    device: what the rewards are combined with lives there). ``reward`` is the weighted sum that trains
    (:func:`rlhf.algos.reward_shaping.weighted_rewards`); ``per_function`` holds each function's own values (NaN where
    one does not apply), whose column means are logged as ``rewards/<name>/mean``."""
    columns = dict(columns or {})
    values = []
    for name, function in functions.items():
        try:
            got = list(function(prompts=list(prompts), completions=list(completions), **columns))
        except Exception as error:  # the user's code: one message naming the function, not a traceback
            target = getattr(function, "func", function)
            ours = str(getattr(target, "__module__", "") or type(target).__module__).startswith("rlhf.")
            if ours or isinstance(error, (UserError, torch.OutOfMemoryError)):  # ours (RewardModel), or no bug
                raise
            raise UserError(_raised(name, function, error, sorted(columns))) from error
        if len(got) != len(completions):
            raise UserError(f"reward function {name!r} returned {len(got)} values for {len(completions)} completions. "
                            "Fix: return one float (or None where it does not apply) per completion, in order")
        values.append([math.nan if v is None else float(v) for v in got])
    per_function = torch.tensor(values, dtype=torch.float32).T.reshape(len(completions), len(values))
    weight = None if weights is None else torch.tensor(list(weights), dtype=torch.float32)
    reward, _ = weighted_rewards(per_function, weight)
    return reward.to(device), per_function.to(device)


def _raised(name: str, function: Callable, error: Exception, columns: list[str]) -> str:
    """The message for reward function ``name`` raising ``error``: which function (its signature, the line of its own
    code that raised), how it is called, and that no checkpoint was lost."""
    import inspect
    import traceback

    target = getattr(function, "func", function)  # a partial (``_partial_: true``): the function itself
    where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    try:
        where += str(inspect.signature(target))
        source = inspect.getsourcefile(target)
    except (TypeError, ValueError):
        source = None
    frames = [f for f in traceback.extract_tb(error.__traceback__) if source and f.filename == source]
    line = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    call = ", ".join(["prompts=[...]", "completions=[...]", *(f"{c}=[...]" for c in columns)])
    return (f"reward function algo.reward_funcs.{name}, {where}, raised {type(error).__name__}{line}: {error}. It is "
            f"called as fn({call}), lists of one entry per completion, and returns one float (or None) per "
            f"completion; a function takes the arguments it reads by name and ends its signature with **kwargs. "
            f"No checkpoint was lost: those saved before (if any) are complete, and resume=auto continues from the "
            f"last one")


def _reward_model_folder(values: dict[str, Any], where: str) -> None:
    """A check across arguments (:func:`rlhf.core.limits.limits`): ``path`` is a folder with a saved model (a run's
    ``final/``, not the run folder), before anything runs."""
    path = values.get("path")
    if not isinstance(path, str):
        return  # ??? is refused by the config check, naming the key
    folder = os.path.expanduser(path)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return
    final = os.path.join(path.rstrip("/"), "final")
    if os.path.isfile(os.path.join(os.path.expanduser(final), "config.json")):
        raise UserError(f"{where}.path={path} is a run folder; its reward model is in {final}. Fix: {where}.path={final}")
    looked = f"no such folder (looked in {os.path.abspath(folder)})" if not os.path.isdir(folder) else \
        "no config.json in it (not a saved model, or a run that has not finished)"
    raise UserError(f"{where}.path={path}: {looked}. Fix: {where}.path=<run dir>/final of a run of algo=reward")


@limits(_reward_model_folder,
        batch_size=Range(ge=1, integer=True, meaning="sequences scored per forward pass", fix=32),
        max_prompt_length=Range(ge=1, integer=True, meaning="tokens a prompt keeps (its end), as algo=reward's "
                                "option", fix=512),
        max_length=Range(ge=1, integer=True, meaning="tokens of prompt + completion (the rest is cut), as "
                         "algo=reward's option", fix=1024))
class RewardModel:
    """A reward model saved by ``algo=reward`` (a run's ``final/``: a one-label sequence-classification model and its
    tokenizer) as a reward function: ``reward_model(prompts, completions) -> [float]``, one scalar per prompt +
    completion.

    Each text pair is tokenized as ``algo=reward`` tokenized plain-text chosen and rejected sides
    (:func:`rlhf.data.encoding.encode` as plain text: the tokenizer's specials unless the prompt starts with BOS, EOS
    appended to the completion; a rollout's prompt rendered by a chat template and its completion then end in EOS,
    not in the template's own end of turn (ChatML's ``<|im_end|>`` and a newline) that a reward model trained on
    conversational rows saw,
    ``max_prompt_length`` and ``max_length`` as there), right-padded, and read at its last token. The model is loaded
    once, at the first call (so a config that names it builds without reading it), on ``device`` (``None``: the
    calling process's device, accelerate's ``PartialState().device``), in eval mode, and scores without gradients,
    ``batch_size`` sequences at a time. Every process holds a whole copy: it is not sharded or trained.

    Args:
        path: the saved model's folder (``<run dir>/final`` of an ``algo=reward`` run).
        batch_size: sequences per forward pass.
        max_prompt_length, max_length: truncation, as the reward model was trained with (``algo=reward``'s
            defaults: 512, 1024); ``None``: none.
        dtype: the parameter dtype it runs in (``float32``, ``bfloat16``, ``float16``).
        device: where it runs; ``None``: the calling process's device.
    """

    def __init__(self, path: str, batch_size: int = 32, max_prompt_length: int | None = 512,
                 max_length: int | None = 1024, dtype: str = "float32", device: str | None = None) -> None:
        self.path, self.batch_size = path, batch_size
        self.max_prompt_length, self.max_length = max_prompt_length, max_length
        self.dtype, self.device = dtype, device
        self.model, self.tokenizer = None, None

    def load(self) -> None:
        """Read the model and its tokenizer (once)."""
        if self.model is not None:
            return
        # transformers' model classes, imported only when a reward model is used
        from rlhf.models.loading import load_policy

        _reward_model_folder({"path": self.path}, "reward_model")
        policy = load_policy(self.path, dtype=self.dtype, head="sequence_classification")
        if self.device is None:
            from accelerate import PartialState

            self.device = str(PartialState().device)
        self.model = policy.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = policy.tokenizer

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        self.load()
        tokenizer, out = self.tokenizer, []
        pairs = list(zip(prompts, completions))
        for start in range(0, len(pairs), self.batch_size):
            ids = [encode(tokenizer, p, c, self.max_prompt_length, self.max_length)["input_ids"]
                   for p, c in pairs[start:start + self.batch_size]]
            batch = collate_sequences(ids, [[1] * len(s) for s in ids], tokenizer.pad_token_id)
            logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                attention_mask=batch["attention_mask"].to(self.device)).logits
            if logits.dim() != 2 or logits.shape[-1] != 1:
                raise UserError(f"the reward model in {self.path} outputs shape {list(logits.shape)}, not one scalar "
                                "per sequence. Fix: a model saved by algo=reward (a sequence-classification head "
                                "with one label)")
            out.extend(logits[:, 0].float().tolist())
        return out
