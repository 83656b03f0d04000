"""``data.columns``: the data's own column names for those an algorithm takes (``{prompt: question, chosen: good,
rejected: bad}``), checked before anything loads and applied as each split is read (:mod:`rlhf.data.source`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN

# What data.columns may name: the columns some algorithm takes, in any of TRL's formats.
KNOWN_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "text", "label", "margin")


def column_map(values: Mapping[str, Any], where: str) -> None:
    """A check across arguments (:func:`rlhf.core.limits.limits`): ``columns`` maps names this project knows to the
    data's own column names, one each, and only for data of one's own (``path``)."""
    columns = values.get("columns")
    if columns is None:
        return
    example = f"{where}.columns={{prompt: question, chosen: good, rejected: bad}}"
    if not isinstance(columns, Mapping):
        raise UserError(f"{where}.columns={columns!r} is not a mapping. Fix: e.g. {example}")
    unknown = [key for key in columns if key not in KNOWN_COLUMNS]
    if unknown:
        raise UserError(f"{where}.columns names {unknown}, which no algorithm takes: its keys are this project's "
                        f"column names ({', '.join(KNOWN_COLUMNS)}), its values the data's. Fix: e.g. {example}")
    bad = [key for key, name in columns.items() if not isinstance(name, str) or not name]
    if bad:
        raise UserError(f"{where}.columns.{bad[0]}={columns[bad[0]]!r} is no column name. Fix: e.g. {example}")
    names = list(columns.values())
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"{where}.columns gives the data's column {twice[0]!r} to more than one name. Fix: one each, "
                        f"e.g. {example}")
    if values.get("path") is None:
        raise UserError(f"{where}.columns renames the columns of data of one's own, but {where}.path is null (the "
                        f"embedded task, whose columns are already these). Fix: {where}.path=<file or Hub dataset>, "
                        f"or {where}.columns=null")


def renamed(names: Sequence[str], columns: Mapping[str, str] | None) -> list[str]:
    """The data's column ``names`` as the algorithm sees them under ``data.columns`` (``{ours: theirs}``)."""
    if not columns:
        return list(names)
    ours = {theirs: our for our, theirs in columns.items()}
    return [ours.get(name, name) for name in names]


def replaced(names: Sequence[str], columns: Mapping[str, str]) -> list[str]:
    """The data's columns that carry a name ``data.columns`` gives to another of its columns (a ``prompt`` column
    beside ``columns.prompt=question``): left out, so that the named one is the one read."""
    return [name for name in names if name in columns and name not in columns.values()]


def missing_mapped(names: Sequence[str], columns: Mapping[str, str] | None, where: str) -> None:
    """Refuse a ``data.columns`` that names a column the data does not have."""
    missing = {our: theirs for our, theirs in (columns or {}).items() if theirs not in names}
    if missing:
        our, theirs = next(iter(missing.items()))
        shown = [name for name in names if name != ROW_COLUMN]
        raise UserError(f"{where} has no column {theirs!r} (data.columns.{our}={theirs}); its columns are {shown}. "
                        f"Fix: data.columns.{our}=<one of them>")
