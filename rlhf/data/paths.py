"""A local ``data.path`` checked before anything heavy loads (the config check, before the run folder exists).

- :func:`path_problem`: a local-looking path that does not exist, or a folder named like a data file
  (``rows.jsonl/``) that holds no data file;
- :func:`first_columns`: the column names of a local file, read from its first row (a CSV or Parquet file's
  header), so that a file without the columns the algorithm needs is refused in a second, not after the model
  has loaded. When the first row lacks them, the whole file is read (rows of a JSON file may differ in keys).

:class:`rlhf.data.source.DataSource` reads the data later with the same messages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhf.core.errors import UserError
from rlhf.data import readers

# Extensions of data files no reader handles: such a path is a local file (never a Hub id), reported as unsupported.
OTHER_FILES = (".txt", ".tsv", ".xlsx", ".xls", ".gz", ".zip", ".tar", ".arrow", ".pkl", ".pickle", ".yaml", ".yml",
               ".xml", ".html", ".md")
# Files that mark a folder written by `save_to_disk`.
SAVED_MARKERS = ("dataset_dict.json", "state.json")


def looks_local(path: str) -> bool:
    """Whether `path` names a local file or folder rather than a Hub dataset id."""
    return Path(path).suffix.lower() in readers.SUPPORTED + OTHER_FILES or path.startswith((".", "/", "~"))


def path_problem(data_path: str) -> str | None:
    """The message for a local ``data.path`` that cannot be data, else None (a Hub id is checked when loaded)."""
    path = os.path.expanduser(str(data_path))
    where = f"data.path={data_path}"
    suffix = Path(path).suffix.lower()
    if looks_local(path) and not os.path.exists(path):
        also = f" Note: {readers.not_supported(path)} either: {readers.FIX_SUPPORTED}." if suffix in OTHER_FILES else ""
        return (f"{where}: no such file or folder. Fix: check the path (it is relative to {os.getcwd()}, the "
                f"directory train.py was started from).{also}")
    if suffix and os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in SAVED_MARKERS):
        inside = [p for p in Path(path).rglob("*") if p.is_file() and p.suffix.lower() in readers.SUPPORTED]
        if not inside:
            return (f"{where} is a folder, not a {suffix} file, and holds no .csv, .json, .jsonl or .parquet file. "
                    "Fix: point data.path at the data file itself.")
    return None


def check_path(values: dict, where: str) -> None:
    """A check across arguments (:func:`rlhf.core.limits.limits`) of a data source: its ``path`` can be data."""
    path = values.get("path")
    if isinstance(path, str) and path:
        problem = path_problem(path)
        if problem:
            raise UserError(problem)


def _first_json_row(handle) -> Any:
    """The first value of a JSON Lines file or the first element of a JSON array (read from its first MiB)."""
    head = handle.read(1 << 20).lstrip()
    if head.startswith("["):
        head = head[1:].lstrip()
    return json.JSONDecoder().raw_decode(head)[0]


def first_columns(data_path: str) -> list[str] | None:
    """The column names of a local ``.csv``/``.json``/``.jsonl``/``.parquet`` file from its first row (a CSV or
    Parquet file's header); None for anything else, or a file that does not parse (its reader says why, later)."""
    path = os.path.expanduser(str(data_path))
    suffix = Path(path).suffix.lower()
    if not os.path.isfile(path) or suffix not in readers.SUPPORTED:
        return None
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        with open(path, encoding="utf-8-sig") as handle:
            if suffix == ".csv":
                import csv

                return next(csv.reader(handle), None)
            row = _first_json_row(handle)
        return list(row) if isinstance(row, dict) else None
    except Exception:  # whatever a damaged file raises: the reader gives the message, with the row
        return None


def first_row(data_path: str) -> dict | None:
    """The first row of a local ``.jsonl``/``.json``/``.csv`` file (a CSV's values as text); None for anything else,
    or a file that does not parse (its reader says why, later)."""
    path = os.path.expanduser(str(data_path))
    if not os.path.isfile(path) or Path(path).suffix.lower() not in (".jsonl", ".json", ".csv"):
        return None
    try:
        with open(path, encoding="utf-8-sig") as handle:
            if path.lower().endswith(".csv"):
                import csv

                return next(csv.DictReader(handle), None)
            row = _first_json_row(handle)
        return row if isinstance(row, dict) else None
    except Exception:  # whatever a damaged file raises: the reader gives the message, with the row
        return None


def all_columns(data_path: str) -> list[str] | None:
    """Every column of a local JSON/JSONL file (the union of its rows' keys); the first row's for other files."""
    path = os.path.expanduser(str(data_path))
    if Path(path).suffix.lower() in (".json", ".jsonl") and os.path.isfile(path):
        try:
            records, _ = readers.read_file(path, f"data.path={data_path}")
        except UserError:
            return None  # a file that cannot be read: the reader says so when the run loads it
        return records.columns
    return first_columns(data_path)


def one_answer_per_prompt(path: str | None, task: Any) -> bool:
    """Whether the data's every prompt has one checkable answer (the embedded task: no ``data.path``, a ``task``):
    what an algorithm's answer metrics (``exact_match``) need to mean anything. Data of one's own is not assumed to."""
    return path is None and task is not None
