"""Where training data comes from: the embedded task, a local file, or a Hub dataset.

Whatever the source, every row is checked before anything trains (:mod:`rlhf.data.checks`): a bad row stops the
run with one message naming the file, the row, the column and the fix, or, with ``data.on_bad_row=skip``, is left
out and counted (:attr:`DataSource.skipped_rows`, and a warning in the log). Loaded splits carry, next to the text
columns, :data:`~rlhf.data.checks.ROW_COLUMN`: where each row came from, so that later steps (tokenization) can
name a row too.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from rlhf.core.errors import UserError
from rlhf.core.hub import check_dataset_reachable
from rlhf.core.limits import Range, limits, show
from rlhf.data import paths, readers
from rlhf.data.checks import (
    ROW_COLUMN,
    Origin,
    RowProblem,
    check_on_bad_row,
    check_rows,
    column_kind,
    require_rows,
    settle,
)
from rlhf.data.columns import column_map, missing_mapped, renamed, replaced
from rlhf.data.formats import pick_format, standardize
from rlhf.data.tasks import ReverseTask

log = logging.getLogger(__name__)



def _numbered(dataset: Dataset) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number, row)`` for every row of `dataset`, numbered from 1, read in batches."""
    number = 0
    for batch in dataset.iter(batch_size=1024):
        names = list(batch)
        for values in zip(*batch.values()):
            number += 1
            yield number, dict(zip(names, values))


def _learns_answers(columns: Sequence[str]) -> bool:
    """Whether an algorithm asking for `columns` learns answers (a conversation must end with one), or takes
    prompts only."""
    return any(column != "prompt" for column in columns)


def _plain(value: Any, column: str) -> Any:
    """A checked value as stored: text as it is, a conversation as ``{role, content}`` messages only, a number of a
    typed column as a float (a JSON column of 1 and 1.5 is one Arrow type)."""
    if isinstance(value, list):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    if column_kind(column) == "number":
        return float(value)
    return value


def _fraction_or_count(values: dict, where: str) -> None:
    """``eval_size`` is a fraction (< 1) or a whole count of rows (>= 1): 1.5 rows means nothing."""
    size = values.get("eval_size")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 1 and not float(size).is_integer():
        raise UserError(f"{where}.eval_size={show(size)} is neither a fraction of the rows (< 1) nor a whole count "
                        f"of rows (>= 1). Fix: {where}.eval_size=0.05 (5% of the rows) or {where}.eval_size="
                        f"{max(1, round(size))} (rows)")


EVALUATE_ON = ("held_out", "validation")  # the split that a run's evaluations score (data.evaluate_on)


def _validation(values: dict, where: str) -> None:
    """``evaluate_on`` is one of :data:`EVALUATE_ON`; ``validation`` needs ``validation_size`` rows."""
    evaluate_on, size = values.get("evaluate_on", "held_out"), values.get("validation_size")
    if evaluate_on not in EVALUATE_ON:
        raise UserError(f"{where}.evaluate_on={show(evaluate_on)} is not a split a run evaluates on. Fix: "
                        f"{where}.evaluate_on=held_out (the figures to report) or {where}.evaluate_on=validation "
                        f"(to choose settings; with {where}.validation_size)")
    if evaluate_on == "validation" and size is None:
        raise UserError(f"{where}.evaluate_on=validation needs validation rows, and {where}.validation_size is null. "
                        f"Fix: {where}.validation_size=0.5 (half of the held-out rows score a search; the other "
                        "half, the figures reported)")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 1 and not float(size).is_integer():
        raise UserError(f"{where}.validation_size={show(size)} is neither a fraction of the held-out rows (< 1) nor "
                        f"a whole count of rows (>= 1). Fix: {where}.validation_size=0.5")


@limits(
    _fraction_or_count,
    _validation,
    column_map,
    paths.check_path,
    eval_size=Range(gt=0, meaning="rows held out when data.eval_split is null: a fraction (< 1) or a count", fix=0.05),
    validation_size=Range(gt=0, meaning="held-out rows set aside to choose settings on (a fraction (< 1) or a "
                          "count); null for none", fix=0.5),
    max_train_rows=Range(ge=1, integer=True, meaning="training rows used at most; null for all", fix="null"),
    seed=Range(ge=0, lt=2**32, integer=True, meaning="which rows are held out", fix=0),
    num_workers=Range(ge=0, integer=True, meaning="worker processes collating training batches", fix=2,
                      null="2 on a GPU, none on a CPU (rlhf.data.loaders.loader_workers)"),
)
class DataSource:
    """Train and held-out splits for one run.

    Args:
        path: a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file, a folder (of data files, or written by
            ``save_to_disk``), or a Hub dataset id, as ``datasets.load_dataset`` takes it. ``None`` uses ``task``
            (the embedded default). In a CSV file every field is text; a CSV column whose values are JSON lists of
            ``{role, content}`` messages is read as conversations.
        name: the Hub dataset's configuration name, if it has several.
        split: the split to train on.
        eval_split: the held-out split; ``None`` holds out ``eval_size`` rows of ``split`` instead.
        eval_size: rows held out when there is no ``eval_split`` (a fraction if < 1, else a count).
        max_train_rows: use at most this many training rows (``None``: all).
        seed: shuffles the held-out selection.
        task: the generated task used when ``path`` is ``None``.
        validation_size: held-out rows set aside as a validation split (a fraction of the held-out split if < 1,
            else a count), drawn with ``seed``; ``None``: none. They are taken from the held-out split, not from
            the training rows, so that the training rows (and the embedded model's warm start, which learns from
            the task's training strings) are the same whichever split a run scores, and neither split is ever
            trained on. The held-out split is then what remains.
        evaluate_on: the split every evaluation of the run scores: ``"held_out"`` (the figures to report) or
            ``"validation"`` (to choose settings by: a search). Honest selection scores a search with
            ``validation`` and reports fresh runs of the chosen settings with ``held_out``; the two share no row.
        on_bad_row: what a bad row (a missing, null, empty or wrongly typed field; a conversation with an unknown
            role or no content; ``chosen`` identical to ``rejected``) does: ``"error"`` stops before training with
            one message naming the file, the row (counted from 1; in a CSV file, after the header), the column and
            the fix; ``"skip"`` leaves it out and logs how many were skipped (:attr:`skipped_rows`).
        columns: the data's own column names for the ones an algorithm takes, ``{ours: theirs}`` (e.g.
            ``{prompt: question, chosen: good, rejected: bad}``); keys among :data:`rlhf.data.columns.KNOWN_COLUMNS`. Checked before
            anything loads (a local file's first row names its columns); ``None``: the data uses TRL's names.
        cache_dir: where the tokenized data is kept across runs (under ``tokenized/``): a run with the rows,
            tokenizer, algorithm settings and code of an earlier run loads its tokens instead of tokenizing again
            (:mod:`rlhf.data.token_cache`). ``None``: tokenize on every run.
        num_workers: worker processes that collate training batches ahead of the step (forked; the order is the
            same with any count, so a resume may change it); ``None``: 2 on a GPU (whose batches are also pinned
            and copied without a wait), none on a CPU, where a worker would take a core from the step's threads
            (:func:`rlhf.data.loaders.loader_workers`).

    Attributes:
        skipped_rows: after :meth:`load`, the bad rows left out, over both splits (0 with ``on_bad_row="error"``).
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
        on_bad_row: str = "error",
        validation_size: float | None = None,
        evaluate_on: str = "held_out",
        cache_dir: str | None = "~/.cache/rlhf",
        columns: Mapping[str, str] | None = None,
        num_workers: int | None = None,
    ) -> None:
        if path is None and task is None:
            raise UserError("data: set data.path=<file or hub dataset> (or use data=reverse for the embedded task)")
        self.path, self.name, self.split, self.eval_split = path, name, split, eval_split
        self.eval_size, self.max_train_rows, self.seed, self.task = eval_size, max_train_rows, seed, task
        self.on_bad_row = check_on_bad_row(on_bad_row)
        self.validation_size, self.evaluate_on = validation_size, evaluate_on
        _validation({"validation_size": validation_size, "evaluate_on": evaluate_on}, "data")
        self.cache_dir, self.num_workers = cache_dir, num_workers
        column_map({"columns": columns, "path": path}, "data")
        self.columns = dict(columns) if columns else None
        self.skipped_rows = 0

    @property
    def one_answer_per_prompt(self) -> bool:
        """Whether every prompt has one checkable answer (the embedded task): what an algorithm's answer metrics
        (``exact_match``) need to mean anything. Data of one's own (``path``) is not assumed to."""
        return paths.one_answer_per_prompt(self.path, self.task)

    @staticmethod
    def check_columns(values: Mapping[str, Any], columns: Sequence[str]) -> None:
        """Refuse, before anything loads, a local data file that lacks the columns an algorithm needs (`columns`):
        its first row (a CSV or Parquet header) is read, and the whole file only when that row lacks them. Called
        by :func:`rlhf.config.checks.check_config` with the ``data`` node's values; the load would say the same later."""
        path = values.get("path")
        if not isinstance(path, str) or not path or not columns:
            return
        names = paths.first_columns(path)
        if names is None:
            return
        mapping = values.get("columns") or None
        try:
            missing_mapped(names, mapping, f"data.path={path}")
            pick_format(renamed(names, mapping), columns, f"data.path={path}")
        except UserError:
            names = paths.all_columns(path)
            if names is not None:
                missing_mapped(names, mapping, f"data.path={path}")
                pick_format(renamed(names, mapping), columns, f"data.path={path}")

    # ---- reading and checking one split -------------------------------------------------------------------
    def _settle(self, problems: Sequence[RowProblem], total: int, origin: Origin) -> None:
        warning = settle(problems, total, self.on_bad_row, origin)
        if warning:
            log.warning(warning)
            self.skipped_rows += len(problems)

    def _check_records(self, records: readers.Records, columns: Sequence[str], origin: Origin,
                       optional: Sequence[str] = ()) -> Dataset:
        """Rows read from a CSV/JSON file -> the checked rows of the format's columns (and of the `optional` columns
        the file has), as a Dataset."""
        require_rows(records.total, origin)
        if not records.rows:  # no row could be parsed: this raises
            self._settle(records.problems, records.total, origin)
        if self.columns:
            missing_mapped(records.columns, self.columns, origin.where)
            kept = [c for c in records.columns if c not in replaced(records.columns, self.columns)]
            ours = dict(zip(kept, renamed(kept, self.columns)))
            records = readers.Records([(number, {ours[k]: v for k, v in row.items() if k in ours})
                                       for number, row in records.rows], records.problems, list(ours.values()))
        fields = _with_optional(pick_format(records.columns, columns, origin.where), records.columns, optional)
        if origin.header:  # CSV: conversations are written as JSON, and every value is text
            records = readers.decode_typed(readers.decode_conversations(records, list(fields)), list(fields))
        checked = check_rows(records.rows, fields, origin, answers=_learns_answers(columns))
        self._settle(records.problems + checked.problems, records.total, origin)
        rows = [records.rows[i] for i in checked.kept]
        return Dataset.from_list([{**{f: _plain(row[f], f) for f in fields}, ROW_COLUMN: origin.label(number)}
                                  for number, row in rows])

    def _check_dataset(self, dataset: Dataset, columns: Sequence[str], origin: Origin,
                       optional: Sequence[str] = ()) -> Dataset:
        """A loaded (Arrow) split -> the checked rows of the format's columns (and of the `optional` ones it has)."""
        require_rows(len(dataset), origin)
        if self.columns:
            missing_mapped(dataset.column_names, self.columns, origin.where)
            dataset = dataset.remove_columns(replaced(dataset.column_names, self.columns)).rename_columns(
                {theirs: ours for ours, theirs in self.columns.items()})
        fields = _with_optional(pick_format(dataset.column_names, columns, origin.where), dataset.column_names,
                                optional)
        dataset = dataset.select_columns(list(fields))
        checked = check_rows(_numbered(dataset), fields, origin, answers=_learns_answers(columns))
        self._settle(checked.problems, len(dataset), origin)
        if checked.problems:
            dataset = dataset.select(checked.kept)
        return dataset.add_column(ROW_COLUMN, [origin.label(i + 1) for i in checked.kept])

    def _read_split(self, split: str, columns: Sequence[str], optional: Sequence[str] = ()) -> Dataset:
        path = os.path.expanduser(str(self.path))
        where = f"data.path={self.path}"
        if os.path.isfile(path):
            suffix = Path(path).suffix.lower()
            if suffix not in readers.SUPPORTED:
                raise UserError(f"{where}: {readers.not_supported(path)}. Fix: {readers.FIX_SUPPORTED}.")
            if suffix == ".parquet":
                if os.path.getsize(path) == 0:
                    raise UserError(f"{where} is empty (0 bytes). Fix: point data.path at a file with data.")
                metadata = _read_local(where, lambda: pq.read_metadata(path))  # damaged: one message, no datasets log
                require_rows(metadata.num_rows, Origin(where))
                dataset = _read_local(where, lambda: load_dataset("parquet", data_files={split: path}, split=split))
                return self._check_dataset(dataset, columns, Origin(where), optional)
            records, origin = readers.read_file(path, where)
            return self._check_records(records, columns, origin, optional)
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in paths.SAVED_MARKERS):
            saved = _read_local(where, lambda: load_from_disk(path))  # a folder written by Dataset(Dict).save_to_disk
            if isinstance(saved, DatasetDict):
                if split not in saved:
                    raise UserError(f"data.path={self.path} has splits {list(saved)}, not {split!r}. Fix: set "
                                    "data.split / data.eval_split to one of them.")
                return self._check_dataset(saved[split], columns, Origin(f"{where} (split {split!r})"), optional)
            return self._check_dataset(saved, columns, Origin(where), optional)
        problem = paths.path_problem(str(self.path))
        if problem:
            raise UserError(problem)
        return self._check_dataset(self._load_hub(path, split), columns, Origin(f"{where} (split {split!r})"),
                                   optional)

    def _load_hub(self, path: str, split: str) -> Dataset:
        """A split of a Hub dataset, or of a local folder of data files, through ``datasets.load_dataset``."""
        if not os.path.exists(path):  # a Hub id: without network, one message in seconds, not a minute of retries
            check_dataset_reachable(self.path, "data.path")
        try:
            return load_dataset(path, self.name, split=split)
        except StopIteration as error:  # datasets reads a first table from every file: an empty one has none
            raise UserError(_empty_files_message(self.path, path)) from error
        except ValueError as error:
            if os.path.isdir(path) and _blank_files(path):  # white space only: "corresponds to no data"
                raise UserError(_empty_files_message(self.path, path)) from error
            if "split" in str(error).lower():
                raise UserError(f"data: split {split!r} not found in {self.path} ({error}). Fix: set "
                                "data.split / data.eval_split to an existing split.") from error
            raise
        except (FileNotFoundError, ConnectionError, OSError) as error:
            raise UserError(f"data.path={self.path}: could not load it ({type(error).__name__}: {error}). "
                            "Fix: give an existing local file/folder, or a Hub dataset id while online "
                            "(HF_DATASETS_OFFLINE=1 means cached datasets only).") from error

    # ---- both splits --------------------------------------------------------------------------------------
    def load_raw(self, columns: Sequence[str], optional: Sequence[str] = ()) -> DatasetDict:
        """Train/eval splits, checked, in whatever format the source has (plus :data:`ROW_COLUMN`, and the
        `optional` columns a file has)."""
        if self.path is None:
            splits = self.task.load(columns)
            return self._scored(DatasetDict({
                k: v.add_column(ROW_COLUMN, [Origin(f"the embedded task ({k} split)").label(i + 1) for i in range(len(v))])
                for k, v in splits.items()}))
        train = self._read_split(self.split, columns, optional)
        if self.eval_split is not None:
            evaluation = self._read_split(self.eval_split, columns, optional)
        else:
            size = self.eval_size if self.eval_size < 1 else int(self.eval_size)
            if len(train) < 2:
                skipped = f" left after skipping {self.skipped_rows} bad row(s)" if self.skipped_rows else ""
                raise UserError(f"data.path={self.path} has {len(train)} row(s){skipped}; need at least 2 to hold "
                                "some out. Fix: add rows, or set data.eval_split to a held-out split.")
            held_out = math.ceil(size * len(train)) if size < 1 else size
            kept = math.floor((1 - size) * len(train)) if size < 1 else len(train) - size
            if kept < 1:
                skipped = f" (after skipping {self.skipped_rows} bad row(s))" if self.skipped_rows else ""
                raise UserError(
                    f"data.eval_size={show(self.eval_size)} holds out {min(held_out, len(train))} of the "
                    f"{len(train)} rows of data.path={self.path}{skipped}, leaving none to train on. Fix: a smaller "
                    f"data.eval_size: a fraction such as 0.05, or a count below {len(train)}.")
            parts = train.train_test_split(test_size=size, seed=self.seed)
            train, evaluation = parts["train"], parts["test"]
        return self._scored(DatasetDict({"train": train, "eval": evaluation}))

    def _scored(self, splits: DatasetDict) -> DatasetDict:
        """`splits` with ``eval`` the split this run scores: with ``validation_size``, the held-out rows are parted
        into validation and held-out rows (by ``seed``), and ``eval`` is the part ``evaluate_on`` names."""
        if self.validation_size is None:
            return splits
        held_out = splits["eval"]
        size = self.validation_size if self.validation_size < 1 else int(self.validation_size)
        validation = math.ceil(size * len(held_out)) if size < 1 else size
        if validation >= len(held_out):
            raise UserError(f"data.validation_size={show(self.validation_size)} sets aside {validation} of the "
                            f"{len(held_out)} held-out rows, leaving none to report on. Fix: data.validation_size=0.5 "
                            "(half of them), or hold out more rows")
        parts = held_out.train_test_split(test_size=validation, seed=self.seed)
        scored = parts["test"] if self.evaluate_on == "validation" else parts["train"]
        return DatasetDict({"train": splits["train"], "eval": scored})

    def load(self, columns: Sequence[str], tokenizer, optional: Sequence[str] = ()) -> DatasetDict:
        """Train/eval splits with the columns `columns` (text rendered with the chat template where rows are
        conversations; typed columns such as ``label`` as they are), the `optional` columns that the data has (e.g. a
        reward model's ``margin``), and :data:`ROW_COLUMN`; sets :attr:`skipped_rows`. Paired preference rows become
        two unpaired rows where `columns` ask for ``completion`` and ``label`` (:func:`rlhf.data.formats.to_rows`)."""
        self.skipped_rows = 0
        raw = self.load_raw(columns, optional)
        if self.max_train_rows is not None:
            raw["train"] = raw["train"].select(range(min(self.max_train_rows, len(raw["train"]))))
        where = "the embedded task" if self.path is None else f"data.path={self.path}"
        return DatasetDict({k: standardize(v, columns, tokenizer, f"{where} ({k} split)", optional)
                            for k, v in raw.items()})


def _with_optional(fields: Sequence[str], names: Sequence[str], optional: Sequence[str]) -> tuple[str, ...]:
    """The format's `fields` and those of the `optional` columns that the data has (its column `names`)."""
    return (*fields, *(column for column in optional if column in names and column not in fields))


def _read_local(where: str, read):
    """``read()`` a local Parquet file or saved folder; one message when it is damaged or truncated."""
    try:
        return read()
    except Exception as error:  # whatever pyarrow/datasets raise for a damaged file: the user's file, not a bug
        raise UserError(f"{where}: could not read it ({type(error).__name__}: {error}); it looks truncated or "
                        "damaged. Fix: re-create it (DataFrame.to_parquet, Dataset.to_parquet or "
                        "Dataset.save_to_disk).") from error


def _blank_files(folder: str) -> list[str]:
    """The data files under ``folder`` with no bytes or white space only (read only where they are small)."""
    def blank(file: Path) -> bool:
        size = file.stat().st_size
        return size == 0 or (size < 4096 and not file.read_bytes().strip())

    return sorted(str(Path(root, name).relative_to(folder)) for root, _, names in os.walk(folder) for name in names
                  if Path(name).suffix.lower() in readers.SUPPORTED and blank(Path(root, name)))


def _empty_files_message(given: Any, folder: str) -> str:
    """The message for a local folder of data files of which one holds no rows (``datasets`` fails on it)."""
    empty = _blank_files(folder) if os.path.isdir(folder) else []
    named = f" ({', '.join(empty)})" if empty else ""
    return (f"data.path={given}: a data file in this folder holds no rows{named}. Fix: remove the empty file(s), or "
            f"point data.path at a file or folder with data.")
