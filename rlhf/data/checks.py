"""Row checks that stop bad training data before training, with one message naming file, row, column and fix.

Every input path (CSV, JSON/JSONL, Parquet, ``save_to_disk`` folders, Hub datasets) goes through
:func:`check_rows`. A row is bad when a field the format needs is missing, null, empty (or only whitespace) or
of the wrong type; when a conversation (a list of ``{role, content}`` messages) is empty, has a message with an
unknown role or without content, or an answer (``completion``, ``chosen``, ``rejected``, and SFT's ``messages``)
that does not end with the assistant's message; when a typed column's value is not of its type (``label``:
true/false; ``margin``: a finite number); or when a preference pair's ``chosen`` is identical to its ``rejected``.
A column that holds conversations in some rows and plain text in others is refused as a whole.

Row numbers count data rows from 1, in file order: the first object of a JSON/JSONL file (blank lines are not
rows), the first row after the header of a CSV file, index 0 of a Parquet file, saved dataset or Hub split.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.core.errors import UserError

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
ON_BAD_ROW = ("error", "skip")  # data.on_bad_row: stop at the first bad row, or drop bad rows with a warning
ROW_COLUMN = "_row"  # kept next to the text columns: where each row came from, for messages after loading
MISSING = object()  # a field a row does not have at all (JSON rows without the key, short CSV rows)

# Columns whose rows may be text or conversations (all rows of one column alike); the others have one kind.
_EITHER = ("prompt", "completion", "chosen", "rejected")
_KIND = {"messages": "conversation", "text": "text", "label": "bool", "margin": "number"}
# Columns that hold no text: a value of a fixed type, passed through to the algorithm as it is (KTO's ``label``:
# true for a desirable completion, false for an undesirable one; a reward model's ``margin``).
TYPED = tuple(column for column, kind in _KIND.items() if kind in ("bool", "number"))
_CONVERSATION_FIX = ('write it as a list of {"role": ..., "content": ...} messages (in a CSV file: as JSON, '
                     'e.g. [{"role": "user", "content": "hi"}])')


@dataclass(frozen=True)
class Origin:
    """Where rows come from, for messages: ``data.path=...`` (and split), and how its rows are counted."""

    where: str
    header: bool = False  # a CSV file: row 1 is the first row after the header

    @property
    def counting(self) -> str:
        return "(counting data rows from 1, after the header)" if self.header else "(counting from 1)"

    def label(self, row: int) -> str:
        """``data.path=x.csv, row 7 (data rows count from 1, after the header)``: one row, in messages."""
        return f"{self.where}, row {row} {self.counting}"


@dataclass(frozen=True)
class RowProblem:
    """Why one row is bad: ``row`` (1-based), the ``column`` at fault (None: the row as a whole) and the fix."""

    row: int
    column: str | None
    problem: str  # e.g. "is empty"
    fix: str

    def describe(self, counting: str = "") -> str:
        """``row 7 (counting from 1), column 'chosen' is empty``, with `counting` saying how rows are counted."""
        row = f"row {self.row} {counting}".rstrip()
        return f"{row}, column {self.column!r} {self.problem}" if self.column else f"{row} {self.problem}"


@dataclass
class Checked:
    """The outcome of :func:`check_rows`: positions (0-based, in input order) of good rows, and the bad ones."""

    kept: list[int] = field(default_factory=list)
    problems: list[RowProblem] = field(default_factory=list)


def describe_type(value: Any) -> str:
    """``a number``, ``a list``, ...: a JSON-ish name for the type of ``value``, for messages."""
    if value is None:
        return "null"
    names = {bool: "true/false", int: "a number", float: "a number", str: "a string", dict: "an object",
             list: "a list"}
    return names.get(type(value), f"of type {type(value).__name__}")


def is_conversation(value: Any) -> bool:
    """A non-empty list of objects: what counts as a conversation when telling conversational columns apart."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def conversation_problem(messages: list) -> tuple[str, str] | None:
    """(problem, fix) for a list of messages that is not a usable conversation, else None."""
    if not messages:
        return "is an empty list of messages", "give it at least one {role, content} message, or remove the row"
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            kind = describe_type(message)
            return f"has message {i} that is {kind}, not a {{role, content}} object", _CONVERSATION_FIX
        role, content = message.get("role"), message.get("content")
        if role is None:
            if "from" in message:
                return (f"has message {i} without a role (it has 'from': ShareGPT style)",
                        "rename each message's 'from'/'value' to 'role'/'content'")
            return f"has message {i} without a role", f"give every message a role: one of {', '.join(ROLES)}"
        if role not in ROLES:
            return f"has message {i} with unknown role {role!r}", f"use one of the roles {', '.join(ROLES)}"
        if content is None or (isinstance(content, str) and not content.strip()):
            return f"has message {i} ({role}) without content", "give every message a non-empty 'content' string"
        if not isinstance(content, str):
            return f"has message {i} ({role}) whose content is {describe_type(content)}, not text", \
                "write every message's content as a string"
    return None


def value_problem(value: Any, column: str) -> tuple[str, str] | None:
    """(problem, fix) for one field of a row, else None. ``column`` decides the kinds of value allowed."""
    kind = column_kind(column)
    if value is MISSING:
        return "is missing", f"give every row a non-empty {column!r}, or remove the row"
    if value is None:
        return "is null", "give it a value, or remove the row"
    if kind in ("bool", "number"):
        return typed_problem(value, kind)
    if isinstance(value, str):
        if kind == "conversation":
            return "is text, not a list of messages", _CONVERSATION_FIX
        if not value.strip():
            return ("is empty" if not value else "is empty (only whitespace)"), "give it text, or remove the row"
        return None
    if isinstance(value, list) and kind != "text":
        return conversation_problem(value)
    wanted = {"text": "text", "conversation": "a list of messages", "either": "text or a list of messages"}[kind]
    fix = ("use a 'messages' column for conversations, or write it as a string" if isinstance(value, list)
           else "write it as a string" if kind != "conversation" else _CONVERSATION_FIX)
    return f"is {describe_type(value)}, not {wanted}", fix


def column_kind(column: str) -> str:
    """What a column holds: ``text``, ``conversation``, ``either`` of those, ``bool`` or ``number``."""
    return _KIND.get(column, "either")


def typed_problem(value: Any, kind: str) -> tuple[str, str] | None:
    """(problem, fix) for a value of a typed column (``kind`` ``bool`` or ``number``), else None."""
    if kind == "bool":
        if isinstance(value, bool):
            return None
        return (f"is {describe_type(value)} {value!r}, not true/false",
                "write true (a desirable completion) or false (an undesirable one); in a CSV file: true or false")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return None
    return f"is {describe_type(value)} {value!r}, not a finite number", "write a number, e.g. 1.5"


def _same_answer(chosen: Any, rejected: Any) -> bool:
    if isinstance(chosen, list) and isinstance(rejected, list):
        return [(m["role"], m["content"]) for m in chosen] == [(m["role"], m["content"]) for m in rejected]
    return chosen == rejected


# Columns whose conversations are the answer trained on: they must end with the assistant's message.
_ANSWERS = ("completion", "chosen", "rejected")


def answer_problem(messages: list, column: str) -> tuple[str, str] | None:
    """(problem, fix) for a conversation that should end with the assistant's answer but does not, else None."""
    role = messages[-1].get("role")
    if role == "assistant":
        return None
    if column == "messages":
        fix = ("end each conversation with the assistant's message (what is learned), or remove the row; rows "
               "without one teach nothing")
    else:
        fix = (f"write {column!r} as the assistant's answer (its last message has the role 'assistant'); the "
               "conversation before it belongs in 'prompt'")
    return f"ends with a {role!r} message, not the assistant's answer", fix


def row_problem(number: int, row: Mapping[str, Any], fields: Sequence[str],
                answers: bool = True) -> RowProblem | None:
    """The first problem of one row (its ``fields``, as the chosen format names them), else None. ``answers``:
    the algorithm learns answers (a ``messages`` conversation must then end with one); False for prompts only."""
    for column in fields:
        value = row.get(column, MISSING)
        found = value_problem(value, column)
        if not found and isinstance(value, list) and (column in _ANSWERS or (column == "messages" and answers)):
            found = answer_problem(value, column)
        if found:
            return RowProblem(number, column, *found)
    if "chosen" in fields and "rejected" in fields and _same_answer(row["chosen"], row["rejected"]):
        return RowProblem(number, "rejected", "is identical to 'chosen'",
                          "a preference pair needs two different answers: fix the pair, or remove the row")
    return None


def check_rows(rows: Iterable[tuple[int, Mapping[str, Any]]], fields: Sequence[str], origin: Origin,
               answers: bool = True) -> Checked:
    """Check numbered rows; raise :class:`UserError` for a column mixing conversations and plain text.

    Args:
        rows: ``(row number, row)`` pairs in file order.
        fields: the columns of the chosen format (e.g. ``prompt``, ``chosen``, ``rejected``).
        origin: where the rows come from, for messages.
        answers: the algorithm learns answers (False: it takes prompts only); see :func:`row_problem`.
    """
    checked = Checked()
    first_text: dict[str, int] = {}
    first_conversation: dict[str, int] = {}
    for position, (number, row) in enumerate(rows):
        for column in fields:
            value = row.get(column)
            if column in _EITHER and isinstance(value, str) and value.strip():
                first_text.setdefault(column, number)
            elif column in _EITHER and is_conversation(value):
                first_conversation.setdefault(column, number)
        problem = row_problem(number, row, fields, answers)
        if problem is None:
            checked.kept.append(position)
        else:
            checked.problems.append(problem)
    for column in fields:
        if column in first_text and column in first_conversation:
            raise UserError(
                f"{origin.where}: column {column!r} mixes lists of messages (first: row {first_conversation[column]}) "
                f"and plain text (first: row {first_text[column]}), {origin.counting[1:-1]}. Fix: write every row "
                "of a column the same way: all text, or all lists of {role, content} messages."
            )
    return checked


def require_rows(total: int, origin: Origin) -> None:
    """Refuse an empty dataset (``total`` data rows, bad ones included)."""
    if total == 0:
        raise UserError(f"{origin.where} has no rows{' after its header' if origin.header else ''}. Fix: point "
                        "data.path at a file (or split) with data.")


def settle(problems: Sequence[RowProblem], total: int, on_bad_row: str, origin: Origin) -> str | None:
    """Apply ``data.on_bad_row``: raise for bad rows (``error``) or when no row is left; else the warning to log.

    Args:
        problems: the bad rows, any order.
        total: data rows read, bad ones included.
        on_bad_row: ``error`` or ``skip``.
        origin: where the rows come from.
    Returns:
        None when every row is good, else the warning for the skipped rows.
    """
    require_rows(total, origin)
    if not problems:
        return None
    first = min(problems, key=lambda p: p.row)
    first_row = first.describe(origin.counting)
    if len(problems) == total:
        raise UserError(f"{origin.where}: every one of its {total} row(s) is bad, so none is left to train on; "
                        f"first: {first_row}. Fix: {first.fix}.")
    if on_bad_row == "error":
        others = (f"{len(problems)} of its {total} rows are bad; data.on_bad_row=skip would leave them out"
                  if len(problems) > 1 else "or set data.on_bad_row=skip to leave such rows out")
        raise UserError(f"{origin.where}: {first_row}. Fix: {first.fix} ({others}).")
    return (f"skipped {len(problems)} bad row(s) of {total} in {origin.where} (data.on_bad_row=skip); "
            f"first: {first_row}")


def check_on_bad_row(value: Any) -> str:
    """``value`` if it is a valid ``data.on_bad_row``, else a :class:`UserError` saying what is."""
    if value not in ON_BAD_ROW:
        raise UserError(f"data.on_bad_row={value!r} is not one of {', '.join(ON_BAD_ROW)}. Fix: "
                        "data.on_bad_row=error (stop at the first bad row) or data.on_bad_row=skip (leave bad rows "
                        "out, counted in the log).")
    return value
