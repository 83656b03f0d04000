"""Where training data comes from: the embedded task, a local file, or a Hub dataset."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from rlhf.data.formats import standardize
from rlhf.data.tasks import ReverseTask
from rlhf.errors import UserError

# File extension -> the `datasets` builder that reads it.
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Files that mark a folder written by `save_to_disk`.
_SAVED_MARKERS = ("dataset_dict.json", "state.json")


class DataSource:
    """Train and held-out splits for one run.

    Args:
        path: a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file, a folder (of data files, or written by
            ``save_to_disk``), or a Hub dataset id, as ``datasets.load_dataset`` takes it. ``None`` uses ``task`` (the embedded default).
        name: the Hub dataset's configuration name, if it has several.
        split: the split to train on.
        eval_split: the held-out split; ``None`` holds out ``eval_size`` rows of ``split`` instead.
        eval_size: rows held out when there is no ``eval_split`` (a fraction if < 1, else a count).
        max_train_rows: use at most this many training rows (``None``: all).
        seed: shuffles the held-out selection.
        task: the generated task used when ``path`` is ``None``.
    """

    def __init__(
        self,
        path: str | None = None,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_size: float = 0.05,
        max_train_rows: int | None = None,
        seed: int = 0,
        task: ReverseTask | None = None,
    ) -> None:
        if path is None and task is None:
            raise UserError("data: set data.path=<file or hub dataset> (or use data=reverse for the embedded task)")
        self.path, self.name, self.split, self.eval_split = path, name, split, eval_split
        self.eval_size, self.max_train_rows, self.seed, self.task = eval_size, max_train_rows, seed, task

    def _load_split(self, split: str) -> Dataset:
        path = os.path.expanduser(str(self.path))
        suffix = Path(path).suffix.lower()
        looks_local = suffix in _FILE_BUILDERS or path.startswith((".", "/", "~")) or os.path.exists(path)
        if looks_local and not os.path.exists(path):
            raise UserError(f"data.path={self.path}: no such file or folder. Fix: check the path (it is "
                            f"relative to {os.getcwd()}, the directory train.py was started from).")
        try:
            if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in _SAVED_MARKERS):
                saved = load_from_disk(path)  # a folder written by Dataset(Dict).save_to_disk
                if isinstance(saved, DatasetDict):
                    if split not in saved:
                        raise UserError(f"data.path={self.path} has splits {list(saved)}, not {split!r}. Fix: set "
                                        "data.split / data.eval_split to one of them.")
                    return saved[split]
                return saved
            if suffix in _FILE_BUILDERS and os.path.isfile(path):
                return load_dataset(_FILE_BUILDERS[suffix], data_files={split: path}, split=split)
            return load_dataset(path, self.name, split=split)
        except UserError:
            raise
        except ValueError as error:
            if "split" in str(error).lower():
                raise UserError(f"data: split {split!r} not found in {self.path} ({error}). Fix: set "
                                "data.split / data.eval_split to an existing split.") from error
            raise
        except (FileNotFoundError, ConnectionError, OSError) as error:
            raise UserError(f"data.path={self.path}: could not load it ({type(error).__name__}: {error}). "
                            "Fix: give an existing local file/folder, or a Hub dataset id while online "
                            "(HF_DATASETS_OFFLINE=1 means cached datasets only).") from error

    def load_raw(self, columns: Sequence[str]) -> DatasetDict:
        """Train/eval splits in whatever format the source has."""
        if self.path is None:
            return self.task.load(columns)
        train = self._load_split(self.split)
        if self.eval_split is not None:
            evaluation = self._load_split(self.eval_split)
        else:
            size = self.eval_size if self.eval_size < 1 else int(self.eval_size)
            if len(train) < 2:
                raise UserError(f"data.path={self.path} has {len(train)} row(s); need at least 2 to hold some out.")
            parts = train.train_test_split(test_size=size, seed=self.seed)
            train, evaluation = parts["train"], parts["test"]
        return DatasetDict({"train": train, "eval": evaluation})

    def load(self, columns: Sequence[str], tokenizer) -> DatasetDict:
        """Train/eval splits as text columns `columns` (conversational rows rendered with the chat template)."""
        raw = self.load_raw(columns)
        if self.max_train_rows is not None:
            raw["train"] = raw["train"].select(range(min(self.max_train_rows, len(raw["train"]))))
        where = "the embedded task" if self.path is None else f"data.path={self.path}"
        return DatasetDict({k: standardize(v, columns, tokenizer, f"{where} ({k} split)") for k, v in raw.items()})
