"""A generated chat task for real chat models: add two whole numbers. Offline, deterministic, with a checkable answer.

The embedded task (:class:`rlhf.data.tasks.ReverseTask`) is plain text for a model built from scratch; this one is
written as conversations in TRL's conversational formats (https://huggingface.co/docs/trl/dataset_formats), so that
a pretrained chat model (``model=smollm2-135m``) sees its own chat template:

- SFT demonstrations: ``{"prompt": [{"role": "user", "content": "What is 37 + 48? Reply with the number only."}],
  "completion": [{"role": "assistant", "content": "85"}]}``
- preference pairs: ``prompt`` as above, ``chosen`` and ``rejected`` as one assistant message each; the rejected
  answer is a plausible slip: off by one, off by ten, a carry dropped, or two neighbouring digits swapped
- prompts for online algorithms: ``{"prompt": [...]}``, scored by :meth:`SumsTask.reward` (the first whole number
  of the reply against the sum)
- for unpaired rows (KTO), the preference pairs, which the data layer splits (:func:`rlhf.data.formats.to_rows`).

Answers are a few tokens, so the greedy-token ``exact_match`` of SFT/DPO (the answer and the template's end of turn
exactly) and generation-based evaluation are cheap. The train/eval split is decided by a hash of the unordered pair
of operands: a held-out question is never trained on in either order (``a + b`` or ``b + a``), whatever the seed.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from typing import Any

from datasets import DatasetDict

from rlhf.core.errors import UserError
from rlhf.data.tasks import COLUMNS, task_splits

QUESTION = "What is {a} + {b}? Reply with the number only."
# The question as it appears in a prompt, plain or rendered by a chat template (the last one counts).
_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\? Reply with the number only\.")
# A whole number in a reply: digits, with thousands separated by commas ("1,085") or not.
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")


def _text(prompt: Any) -> str:
    """A prompt as text: a string as it is, a conversation as its messages' contents joined."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict))
    return str(prompt)


def first_number(reply: str) -> int | None:
    """The first whole number written in ``reply`` ("The answer is 1,085." -> 1085), or None."""
    found = _NUMBER.search(reply)
    return int(found.group().replace(",", "")) if found else None


class SumsTask:
    """Add two whole numbers of `min_operand`-`max_operand` ("What is 37 + 48? ..." -> "85"), as chat rows.

    Args:
        min_operand, max_operand: the range of each operand (inclusive). 10-99 gives 8,100 ordered questions.
        num_train, num_eval: distinct questions in each split.
        eval_one_in: 1 in N unordered operand pairs is reserved for the held-out split.
        seed: which questions are drawn (the split itself does not depend on it).
        shots: worked examples (earlier user/assistant turns) before each question, the same in every row: few-shot
            prompting (Brown et al. 2020, https://arxiv.org/abs/2005.14165). SmolLM2-135M-Instruct asked with none
            restates the question ("75 + 16 = ") instead of answering, so that a run would first learn the format;
            with two, it answers with a number (measured: docs/how-to/real-chat-model.md). Drawn from training
            questions, never held-out ones.
    """

    def __init__(
        self,
        min_operand: int = 10,
        max_operand: int = 99,
        num_train: int = 4000,
        num_eval: int = 128,
        eval_one_in: int = 16,
        seed: int = 0,
        shots: int = 2,
    ) -> None:
        if not 0 <= min_operand <= max_operand:
            raise UserError(f"data.task: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}. "
                            "Fix: e.g. data.task.min_operand=10 data.task.max_operand=99")
        if eval_one_in < 2:
            raise UserError(f"data.task.eval_one_in={eval_one_in} leaves no question to train on (1 in N is held out). "
                            "Fix: data.task.eval_one_in=16")
        self.min_operand, self.max_operand = min_operand, max_operand
        self.num_train, self.num_eval = num_train, num_eval
        if shots < 0:
            raise UserError(f"data.task.shots={shots} is not a count of worked examples. Fix: data.task.shots=2 (or 0)")
        self.eval_one_in, self.seed, self.shots = eval_one_in, seed, shots

    # ---- the task itself -------------------------------------------------------------------------------
    def is_eval(self, a: int, b: int) -> bool:
        """True for questions reserved for the held-out split: a fixed 1/`eval_one_in` of unordered operand pairs."""
        low, high = min(a, b), max(a, b)
        return zlib.crc32(f"{low}+{high}".encode()) % self.eval_one_in == 0

    @staticmethod
    def question(a: int, b: int) -> str:
        return QUESTION.format(a=a, b=b)

    @staticmethod
    def is_prompt(text: Any) -> bool:
        """Whether ``text`` (plain, rendered by a chat template, or a list of messages) asks this task's question."""
        return _QUESTION.search(_text(text)) is not None

    @staticmethod
    def answer(prompt: Any) -> int | None:
        """The sum the prompt's last question asks for; None if it asks none."""
        found = _QUESTION.findall(_text(prompt))
        return int(found[-1][0]) + int(found[-1][1]) if found else None

    @staticmethod
    def reward(prompts: Sequence[Any], completions: Sequence[Any]) -> list[float | None]:
        """1.0 where the reply's first whole number is the sum, else 0.0; None for a prompt that is not this task's
        (the reward does not apply). Prompts and completions as text or as message lists."""
        out: list[float | None] = []
        for prompt, completion in zip(prompts, completions):
            answer = SumsTask.answer(prompt)
            out.append(None if answer is None else float(first_number(_text(completion)) == answer))
        return out

    # ---- generation ------------------------------------------------------------------------------------
    def _available(self, split: str) -> int:
        span = range(self.min_operand, self.max_operand + 1)
        return sum(self.is_eval(a, b) == (split == "eval") for a in span for b in span)

    def pairs(self, split: str) -> list[tuple[int, int]]:
        """`num_train` or `num_eval` distinct ordered operand pairs of the split, deterministic from `seed`."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        count = self.num_train if split == "train" else self.num_eval
        available = self._available(split)
        if count > available:
            key = "num_train" if split == "train" else "num_eval"
            raise UserError(f"data.task.{key}={count}, but operands {self.min_operand}-{self.max_operand} give only "
                            f"{available} distinct {split} questions. Fix: data.task.{key}={available} or less, or "
                            "a wider range (data.task.max_operand)")
        rng = random.Random(f"{self.seed}-{split}")
        out: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        while len(out) < count:
            pair = (rng.randint(self.min_operand, self.max_operand), rng.randint(self.min_operand, self.max_operand))
            if pair not in seen and self.is_eval(*pair) == (split == "eval"):
                seen.add(pair)
                out.append(pair)
        return out

    @staticmethod
    def corrupt(a: int, b: int, rng: random.Random) -> int:
        """A plausible wrong sum of ``a + b`` (never the sum, never negative): off by one, off by ten, a carry dropped
        (each column's digits added mod 10), or two neighbouring digits of the sum swapped."""
        right = a + b
        while True:
            kind = rng.randrange(4)
            if kind == 0:
                wrong = right + rng.choice((-1, 1))
            elif kind == 1:
                wrong = right + rng.choice((-10, 10))
            elif kind == 2:  # every column added without its carry (the most common child's slip)
                x, y, wrong, place = a, b, 0, 1
                while x or y:
                    wrong += ((x % 10 + y % 10) % 10) * place
                    x, y, place = x // 10, y // 10, place * 10
            else:
                digits = list(str(right))
                if len(digits) < 2:
                    continue
                i = rng.randrange(len(digits) - 1)
                digits[i], digits[i + 1] = digits[i + 1], digits[i]
                if digits[0] == "0":  # 10 -> "01" is no number anyone writes
                    continue
                wrong = int("".join(digits))
            if wrong != right and wrong >= 0:
                return wrong

    def examples(self) -> list[dict[str, str]]:
        """The `shots` worked examples as user/assistant turns: training questions, fixed by `seed`."""
        rng, turns = random.Random(f"{self.seed}-shots"), []
        while len(turns) < 2 * self.shots:
            a, b = rng.randint(self.min_operand, self.max_operand), rng.randint(self.min_operand, self.max_operand)
            if not self.is_eval(a, b):
                turns += [{"role": "user", "content": self.question(a, b)}, {"role": "assistant", "content": str(a + b)}]
        return turns

    def rows(self, split: str, columns: Sequence[str]) -> list[dict[str, list[dict[str, str]]]]:
        """Rows of `split` in the conversational format whose columns are `columns`."""
        rng = random.Random(f"{self.seed}-{split}-rejected")
        rows, examples = [], self.examples()
        for a, b in self.pairs(split):
            row = {"prompt": [*examples, {"role": "user", "content": self.question(a, b)}]}
            answer = [{"role": "assistant", "content": str(a + b)}]
            if "completion" in columns and "label" not in columns:
                row["completion"] = answer
            if "chosen" in columns or "label" in columns:  # unpaired rows are made from the pairs
                row["chosen"] = answer
                row["rejected"] = [{"role": "assistant", "content": str(self.corrupt(a, b, rng))}]
            rows.append(row)
        return rows

    def load(self, columns: Sequence[str]) -> DatasetDict:
        """Train and eval splits with the given columns (any of prompt, completion, chosen, rejected); asked for a
        ``label``, the preference pairs."""
        return task_splits(self, columns, "the sums task", UserError(
            f"the sums task has no column(s) {sorted(set(columns) - set(COLUMNS))}. Fix: an algorithm that takes "
            "prompts, demonstrations or preference pairs (algo=sft, dpo, kto, grpo, ...)"))
