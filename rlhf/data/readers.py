"""Read local CSV and JSON/JSONL files into numbered rows, with one clear message for a file that cannot be read.

These files are read here rather than by ``datasets``' builders so that every value keeps what the file says:
in a CSV file every field is text (``3``, ``None`` and ``NA`` stay strings; an empty field is empty, never
``None`` or ``nan``), and a JSON row may hold anything, to be checked and named row by row
(:mod:`rlhf.data.checks`) before anything becomes an Arrow table.

A CSV file cannot hold lists, so a CSV column is read as conversations when its values are JSON lists of
``{role, content}`` messages (:func:`decode_conversations`); a column mixing those with plain text is refused.
Typed columns (``label``, ``margin``) are read as their types (:func:`decode_typed`).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

from rlhf.core.errors import UserError
from rlhf.data.checks import MISSING, TYPED, Origin, RowProblem, column_kind, describe_type, is_conversation

SUPPORTED = (".csv", ".json", ".jsonl", ".parquet")  # file types data.path may name
# What to use instead of an unsupported file.
FIX_SUPPORTED = ("use a .csv, .json, .jsonl or .parquet file, a folder written by Dataset.save_to_disk, or a Hub "
                  "dataset id")


@dataclass
class Records:
    """Rows read from one file: ``(row number, row)`` pairs, rows that could not be parsed, the column names."""

    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    problems: list[RowProblem] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Data rows in the file, unparsable ones included."""
        return len(self.rows) + len(self.problems)


def read_text(path: str, where: str) -> str:
    """The file's text (UTF-8, a byte-order mark dropped); one message for an unreadable, empty or binary file."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise UserError(f"{where}: could not read it ({type(error).__name__}: {error}). Fix: check that the file "
                        "exists and that you may read it.") from error
    if not data.strip():
        raise UserError(f"{where} is empty ({len(data)} bytes). Fix: point data.path at a file with data.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        kind = os.path.splitext(path)[1].lower()
        raise UserError(f"{where}: not UTF-8 text (byte {error.start}: {error.reason}), so not a {kind} file, or "
                        "a damaged one. Fix: save it as UTF-8 text, or give it the extension of what it holds."
                        ) from error


def parse_csv(text: str, origin: Origin) -> Records:
    """Rows of a CSV file with a header; every field a string. Blank lines are not rows."""
    where = origin.where
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    records = Records()
    last_short: int | None = None
    try:
        header = next(reader, [])
        if not any(name.strip() for name in header):
            raise UserError(f"{where} has no header row (its first line is empty). Fix: put the column names "
                            "(e.g. prompt,completion) on the first line.")
        repeated = sorted({name for name in header if header.count(name) > 1})
        if repeated:
            raise UserError(f"{where}: the header names column(s) {repeated} more than once. Fix: give every column "
                            "its own name.")
        records.columns = list(header)
        number = 0
        for values in reader:
            if not values:
                continue
            number += 1
            last_short = number if len(values) < len(header) else None
            if len(values) > len(header):
                records.problems.append(RowProblem(
                    number, None, f"has {len(values)} fields but the header has {len(header)}",
                    "quote fields that contain commas (\"a, b\"), or remove the extra fields"))
                continue
            records.rows.append((number, dict(zip(header, values))))
    except csv.Error as error:
        if "unexpected end of data" in str(error):
            raise UserError(f"{where} looks truncated: it ends inside a quoted field (opened on or before line "
                            f"{reader.line_num}). Fix: re-create the file, or close the quote.") from error
        raise UserError(f"{where}: not valid CSV at line {reader.line_num} ({error}). Fix: quote fields that contain "
                        "commas, quotes or line breaks, doubling quotes inside them (\"say \"\"hi\"\"\").") from error
    if last_short is not None and not text.endswith(("\n", "\r")):
        raise UserError(f"{where} looks truncated: its last row, row {last_short} {origin.counting}, has fewer fields "
                        "than the header and no line end. Fix: re-create the file.")
    return records


def parse_json(text: str, origin: Origin) -> Records:
    """Rows of a JSON file: a list of objects, or one object per line (JSON Lines). Blank lines are not rows."""
    where, records = origin.where, Records()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"{where}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); the "
                            "file looks truncated or damaged. Fix: re-create it as a list of objects "
                            "([{\"prompt\": ..., ...}, ...]) or one object per line.") from error
        numbered = list(enumerate(items, 1))
    else:
        lines = [line for line in text.split("\n") if line.strip()]
        numbered = []
        for number, line in enumerate(lines, 1):
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                if number == len(lines) and not text.rstrip(" \t").endswith(("\n", "\r")):
                    raise UserError(f"{where} looks truncated: its last row, row {number} {origin.counting}, is not "
                                    f"complete JSON ({error.msg}) and has no line end. Fix: re-create the file."
                                    ) from error
                if number == 1 and _is_object(text):
                    raise UserError(f"{where} holds one JSON object, not rows. Fix: write a list of row objects "
                                    "([{\"prompt\": ..., ...}, ...]) or one object per line.") from error
                records.problems.append(RowProblem(number, None, f"is not valid JSON ({error.msg}, at character "
                                                   f"{error.colno})", "fix the line, or remove it"))
    for number, item in numbered:
        if isinstance(item, dict):
            records.rows.append((number, item))
            records.columns.extend(k for k in item if k not in records.columns)
        else:
            records.problems.append(RowProblem(number, None, f"is {describe_type(item)}, not an object",
                                               'write each row as an object: {"column": value, ...}'))
    records.problems.sort(key=lambda problem: problem.row)
    return records


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def decode_conversations(records: Records, fields: list[str]) -> Records:
    """CSV fields hold text only: read a column as conversations when it holds JSON lists of messages.

    A column among ``fields`` is conversational when at least one of its values parses as a non-empty JSON list of
    objects (``messages`` always is). Its values that start with ``[`` are then parsed (a row whose value does not
    parse is a bad row); other non-empty values stay text, which :func:`rlhf.data.checks.check_rows` refuses as a
    column mixing conversations and text. Columns with no such value keep every value as text.
    """
    decoded: dict[str, dict[int, Any]] = {}
    problems: dict[int, RowProblem] = {}
    for column in fields:
        if column == "text":
            continue
        parsed: dict[int, Any] = {}
        failed: dict[int, str] = {}
        for number, row in records.rows:
            value = row.get(column, MISSING)
            if isinstance(value, str) and value.strip().startswith("["):
                try:
                    parsed[number] = json.loads(value)
                except json.JSONDecodeError as error:
                    failed[number] = f"is not valid JSON ({error.msg}, at character {error.colno})"
        if column == "messages" or any(is_conversation(v) for v in parsed.values()):
            decoded[column] = parsed
            for number, problem in failed.items():
                fix = 'write the conversation as a JSON list of {"role": ..., "content": ...} objects, or remove the row'
                problems.setdefault(number, RowProblem(number, column, problem, fix))
    rows = [(number, {**row, **{c: decoded[c][number] for c in decoded if number in decoded[c]}})
            for number, row in records.rows if number not in problems]
    return Records(rows, records.problems + list(problems.values()), records.columns)


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def decode_typed(records: Records, fields: list[str]) -> Records:
    """CSV fields hold text only: read the typed columns among ``fields`` (:data:`rlhf.data.checks.TYPED`) as their
    types. ``label``: ``true``/``false`` (any case) or ``1``/``0``; ``margin``: a number. A value that does not
    read stays text, which :func:`rlhf.data.checks.check_rows` then names as a bad row."""
    typed = [column for column in fields if column in TYPED]
    if not typed:
        return records

    def read(column: str, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip().lower()
        if column_kind(column) == "bool":
            return True if text in _TRUE else False if text in _FALSE else value
        try:
            return float(text) if text else value
        except ValueError:
            return value

    rows = [(number, {**row, **{c: read(c, row[c]) for c in typed if c in row}}) for number, row in records.rows]
    return Records(rows, records.problems, records.columns)


def read_file(path: str, where: str) -> tuple[Records, Origin]:
    """Rows of a local ``.csv``/``.json``/``.jsonl`` file, and how to name its rows in messages."""
    text = read_text(path, where)
    origin = Origin(where, header=path.lower().endswith(".csv"))
    return (parse_csv if origin.header else parse_json)(text, origin), origin


def not_supported(path: str) -> str:
    """Why `path` cannot be read, by its extension: ``'.txt' files are not supported``."""
    suffix = os.path.splitext(path)[1]
    return f"{suffix!r} files are not supported" if suffix else "files without an extension are not supported"
