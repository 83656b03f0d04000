"""The embedded task: reverse a short lowercase string. Generated, offline, with a checkable answer.

One generator gives every data format the algorithms need (TRL's standard formats):

- SFT demonstrations: ``{"prompt": "abc=", "completion": "cba"}``
- preference pairs: ``{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}`` (the rejected answer is a
  plausible mistake: the string unreversed, one letter changed, two neighbours swapped, one letter dropped or
  doubled)
- prompts for online algorithms: ``{"prompt": "abc="}``, scored by :meth:`ReverseTask.reward`.
- for unpaired rows (``prompt``, ``completion``, ``label``: KTO), the preference pairs: the data layer splits each
  into a desirable and an undesirable row, as it does any paired data (:func:`rlhf.data.formats.to_rows`).

The train/eval split is decided by a hash of the string itself, so held-out strings never appear in training
data, whatever seed or size is asked for.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Sequence

from datasets import Dataset, DatasetDict

SEPARATOR = "="  # ends every prompt; cannot occur in an answer


class ReverseTask:
    """Reverse a lowercase string of `min_chars`-`max_chars` letters (`abc=` -> `cba`)."""

    def __init__(
        self,
        min_chars: int = 3,
        max_chars: int = 8,
        num_train: int = 10_000,
        num_eval: int = 512,
        eval_one_in: int = 16,
        seed: int = 0,
    ) -> None:
        if not 1 <= min_chars <= max_chars:
            raise ValueError(f"need 1 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
        self.min_chars, self.max_chars = min_chars, max_chars
        self.num_train, self.num_eval = num_train, num_eval
        self.eval_one_in, self.seed = eval_one_in, seed

    # ---- the task itself -------------------------------------------------------------------------------
    def is_eval(self, word: str) -> bool:
        """True for strings reserved for the held-out split (a fixed 1/`eval_one_in` of all strings)."""
        return zlib.crc32(word.encode()) % self.eval_one_in == 0

    @staticmethod
    def prompt(word: str) -> str:
        return word + SEPARATOR

    @staticmethod
    def is_prompt(text: str) -> bool:
        """Whether ``text`` is one of this task's prompts: lowercase letters, then the separator."""
        word = text.removesuffix(SEPARATOR)
        return text.endswith(SEPARATOR) and word.isascii() and word.isalpha() and word.islower()

    @staticmethod
    def answer(prompt: str) -> str:
        return prompt.removesuffix(SEPARATOR)[::-1]

    def reward(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """1.0 where the completion is exactly the reversed string, else 0.0."""
        return [float(c.strip() == self.answer(p)) for p, c in zip(prompts, completions)]

    # ---- generation ------------------------------------------------------------------------------------
    def words(self, split: str) -> list[str]:
        """`num_train` or `num_eval` distinct strings of the split, deterministic from `seed`."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        count = self.num_train if split == "train" else self.num_eval
        rng = random.Random(f"{self.seed}-{split}")
        out: list[str] = []
        seen: set[str] = set()
        while len(out) < count:
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_chars, self.max_chars)))
            if word not in seen and self.is_eval(word) == (split == "eval"):
                seen.add(word)
                out.append(word)
        return out

    @staticmethod
    def corrupt(answer: str, rng: random.Random) -> str:
        """A plausible wrong answer: unreversed, one letter changed, a swap, a drop or a doubling."""
        while True:
            kind = rng.randrange(5)
            i = rng.randrange(len(answer))
            if kind == 0:
                wrong = answer[::-1]
            elif kind == 1:
                wrong = answer[:i] + rng.choice(string.ascii_lowercase.replace(answer[i], "")) + answer[i + 1 :]
            elif kind == 2 and len(answer) > 1:
                i = min(i, len(answer) - 2)
                wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
            elif kind == 3 and len(answer) > 1:
                wrong = answer[:i] + answer[i + 1 :]
            else:
                wrong = answer[: i + 1] + answer[i:]
            if wrong != answer:
                return wrong

    def rows(self, split: str, columns: Sequence[str]) -> list[dict[str, str]]:
        """Rows of `split` in the format whose columns are `columns`."""
        rng = random.Random(f"{self.seed}-{split}-rejected")
        rows = []
        for word in self.words(split):
            prompt, answer = self.prompt(word), word[::-1]
            row = {"prompt": prompt}
            if "completion" in columns and "label" not in columns:
                row["completion"] = answer
            if "chosen" in columns or "label" in columns:  # unpaired rows are made from the pairs
                row["chosen"], row["rejected"] = answer, self.corrupt(answer, rng)
            rows.append(row)
        return rows

    def load(self, columns: Sequence[str]) -> DatasetDict:
        """Train and eval splits with the given columns (any of prompt, completion, chosen, rejected); asked for a
        ``label``, the preference pairs."""
        return task_splits(self, columns, "the reverse task", ValueError(
            f"the reverse task has no column(s) {sorted(set(columns) - set(COLUMNS))}"))


COLUMNS = ("prompt", "completion", "chosen", "rejected", "label")  # what a generated task's rows can hold


def task_splits(task, columns: Sequence[str], name: str, unknown_error: Exception | None = None) -> DatasetDict:
    """A generated task's train and eval splits with ``columns`` (of :data:`COLUMNS`), from its ``rows(split,
    columns)``; another column raises ``unknown_error`` (default: a ValueError naming ``name`` and the columns)."""
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        raise unknown_error or ValueError(f"{name} has no column(s) {sorted(unknown)}")
    return DatasetDict({s: Dataset.from_list(task.rows(s, columns)) for s in ("train", "eval")})
