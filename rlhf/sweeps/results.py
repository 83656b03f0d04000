"""Reading run folders: the one place that knows how a run's results lie on disk.

A run folder (Hydra's run dir) holds ``.hydra/config.yaml`` and ``overrides.yaml``, ``metrics.jsonl`` (one JSON
object per log call: ``{"step": N, "train/loss": ...}``), ``checkpoints/step_<N>/`` and, once the run has finished,
``summary.json`` (``{"final": {...}}``), and ``environment.json`` (:data:`ENVIRONMENT`: how the run ran, for
reports to say where compared runs did not run alike). :class:`Run` reads one folder, each file when first asked; :func:`find`
finds them under multirun folders. Only reading: the lock is tested for an instant, never held.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from rlhf.core.errors import UserError
from rlhf.run.checkpoint import complete
from rlhf.run.folder import ATTEMPT, ENVIRONMENT, LOCK, RECORDED, RESUMED_FROM

MARKERS = ("metrics.jsonl", "summary.json", ".hydra")  # a folder holding any of these is a run folder
NONFINITE = ("nan", "inf", "-inf")  # metrics.jsonl writes a non-finite value as one of these strings


class Status:
    """Where a run stands (:attr:`Run.status`), checked in this order. RUNNING: a live process holds the folder's
    lock. FINISHED: ``summary.json`` is there. STOPPED: complete checkpoints but no summary (a signal or a kill;
    ``resume=auto`` continues it). FAILED: neither, and no process writes it (it ended before its first checkpoint).
    """

    RUNNING, FINISHED, STOPPED, FAILED = "running", "finished", "stopped", "failed"


def is_run_folder(path: Path) -> bool:
    return any((Path(path) / marker).exists() for marker in MARKERS)


def is_locked(lock_file: Path) -> bool:
    """Whether a live process holds ``lock_file`` (``rlhf.run.folder.claim``'s exclusive flock). Tested with a
    shared lock, released at once, so that readers never see one another as writers."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the shared lock, if taken


@dataclasses.dataclass(frozen=True, order=True)
class Run:
    """One run folder; ``Run(path)`` raises :class:`UserError` for a path that is not one."""

    path: Path

    def __post_init__(self) -> None:
        path = Path(self.path)
        object.__setattr__(self, "path", path)
        if not is_run_folder(path):
            below = [str(run.path) for run in find([path])[:2]] if path.is_dir() else []
            what = ("does not exist" if not path.exists() else "is a file, not a run folder" if not path.is_dir()
                    else f"is not a run folder (it has none of {', '.join(MARKERS)})")
            hint = f"; it holds run folders such as {' and '.join(below)}" if below else ""
            raise UserError(f"{path} {what}{hint}. Fix: give the folder of one run (its hydra.run.dir, e.g. "
                            "outputs/<date>/<time>, or one job's folder of a multirun).")

    def _yaml(self, name: str) -> Any:
        """A file of the run's Hydra record: its newest resumed attempt's (``.hydra/attempt-<time>/``, which holds
        the run's overrides and those the resume changed), else the run's original one."""
        recorded = self.path / RECORDED
        attempts = sorted(recorded.glob(f"{ATTEMPT}*/{RESUMED_FROM}"))
        file = (attempts[-1].parent if attempts else recorded) / name
        return yaml.safe_load(file.read_text()) if file.is_file() else None

    @cached_property
    def config(self) -> dict[str, Any]:
        """``.hydra/config.yaml``, the composed config as Hydra saved it (interpolations as written), or ``{}``; for
        a resumed run, its newest attempt's."""
        return self._yaml("config.yaml") or {}

    @cached_property
    def overrides(self) -> list[str]:
        """The command line's overrides (``.hydra/overrides.yaml``; for a resumed run, its newest attempt's), or
        ``[]``."""
        return [str(o) for o in self._yaml("overrides.yaml") or []]

    @cached_property
    def choices(self) -> dict[str, str]:
        """The option of each config group as chosen (``{"algo": "ipo", "algo/loss": "ipo", "optimizer": "lion"}``:
        Hydra's record of the run, ``.hydra/hydra.yaml``), without Hydra's own groups; ``{}`` without a record."""
        record = self._yaml("hydra.yaml") or {}
        choices = ((record.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
        return {str(k): str(v) for k, v in choices.items() if not str(k).startswith("hydra/") and v is not None}

    @property
    def override_values(self) -> dict[str, str]:
        """The overrides of the form ``key=value`` as {key: value} (``+key=v`` keeps its ``+``)."""
        return dict(o.split("=", 1) for o in self.overrides if "=" in o)

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        """The lines of ``metrics.jsonl``, oldest first; a last line cut short by a kill is left out."""
        file = self.path / "metrics.jsonl"
        lines = file.read_text().splitlines() if file.is_file() else []
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append({k: float(v) if v in NONFINITE else v for k, v in json.loads(line).items()})
            except ValueError as error:
                if number < len(lines):  # only the last line can be cut short, by a kill while writing it
                    raise UserError(f"{file}, line {number}, is not JSON ({error}). Fix: repair or remove that "
                                    "line.") from None
        return records

    @cached_property
    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` (written when the run finished), or None."""
        file = self.path / "summary.json"
        try:
            return json.loads(file.read_text()) if file.is_file() else None
        except ValueError as error:
            raise UserError(f"{file} is not JSON ({error}): the run was killed while writing it. Fix: finish it "
                            "again with resume=auto (or delete summary.json).") from None

    @cached_property
    def environment(self) -> dict[str, Any] | None:
        """``environment.json``: how the run ran (``threads_per_process``, ``mixed_precision``, ``machine``,
        ``num_processes``, ``torch``), or None: a run older than the file, or one killed while writing it (what it
        holds only annotates a report, so an unreadable file is no error)."""
        file = self.path / ENVIRONMENT
        try:
            environment = json.loads(file.read_text()) if file.is_file() else None
        except (OSError, ValueError):
            return None
        return environment if isinstance(environment, dict) else None

    @property
    def final(self) -> dict[str, Any] | None:
        """The final metrics (``summary["final"]``: held-out ``eval/*`` and the last ``train/*``), or None."""
        return None if self.summary is None else self.summary.get("final")

    def final_metrics(self) -> dict[str, Any]:
        """:attr:`final`, or a :class:`UserError` that says where the run stands."""
        if self.final is None:
            raise UserError(f"{self.path} has no final metrics: the run is {self.status} (no summary.json). Fix: "
                            "wait for it to finish, or continue it: resume=auto hydra.run.dir=<that folder>.")
        return self.final

    @property
    def status(self) -> str:
        """One of :class:`Status`, read anew on every access."""
        if is_locked(self.path / LOCK):
            return Status.RUNNING
        if (self.path / "summary.json").is_file():
            return Status.FINISHED
        return Status.STOPPED if complete(self.path) else Status.FAILED

    def history(self, metric: str) -> list[tuple[int, float]]:
        """``(step, value)`` of every line that logged ``metric``, oldest first."""
        return [(record["step"], float(record[metric])) for record in self.metrics if metric in record]

    def first(self, metric: str) -> float | None:
        """The first value logged of ``metric`` (None if it never was); :meth:`last` the last."""
        return next((value for _, value in self.history(metric)), None)

    def last(self, metric: str) -> float | None:
        return next((value for _, value in reversed(self.history(metric))), None)

    def at(self, step: int) -> dict[str, Any]:
        """Every metric logged at ``step`` (``{}`` if none); ``at(0)``: the evaluation before training."""
        return {key: value for record in self.metrics if record.get("step") == step for key, value in record.items()}


def find(paths: Iterable[Path]) -> list[Run]:
    """The run folders at or under each of ``paths`` (not searching inside a run folder), in the order of ``paths``,
    each one's sorted by folder. A path that is not a folder raises :class:`UserError`."""
    runs: list[Run] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise UserError(f"{path} {'is a file' if path.exists() else 'does not exist'}. Fix: give run folders, or "
                            "folders that hold them (e.g. a multirun's folder).")
        found = []
        for folder, subfolders, _ in os.walk(path):
            if is_run_folder(Path(folder)):
                found.append(Run(Path(folder)))
                subfolders.clear()
        runs += sorted(found)
    return runs
