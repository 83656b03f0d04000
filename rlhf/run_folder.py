"""The run folder is written by one run at a time, and never mixes two runs' results.

- :func:`claim` takes an exclusive ``fcntl.flock`` on ``<run dir>/.lock`` for the duration of the run; a second
  run into the same folder stops with a message naming the first one's PID. The kernel drops the lock when its
  process dies, so a lock left by a killed run never blocks.
- :func:`prepare` turns ``resume`` into a checkpoint (or none) and refuses a new run into a folder that holds
  checkpoints; :func:`clear_previous_results` removes a previous run's ``final/`` and ``summary.json`` before a new
  or resumed run writes its first metrics, so that they never sit beside metrics they do not belong to.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rlhf import checkpoint
from rlhf.errors import UserError

log = logging.getLogger(__name__)

LOCK = ".lock"
# Set for the ranks a run starts itself: their parent holds the lock and has prepared the folder.
OWNED = "RLHF_RUN_FOLDER_OWNED"


@contextlib.contextmanager
def claim(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock for the duration of the block."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise UserError(f"another run (PID {holder}) is writing the run folder {run_dir}. Fix: wait for it to "
                            "end, or give this run its own folder (hydra.run.dir=<another folder>).") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        previous = os.environ.get(OWNED)
        os.environ[OWNED] = "1"  # inherited by the ranks this process starts
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(OWNED, None)
            else:
                os.environ[OWNED] = previous
    finally:
        os.close(fd)  # releases the lock


def owned_by_parent() -> bool:
    return os.environ.get(OWNED) == "1"


def prepare(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint this run resumes from (``None`` for a new run); clear a previous run's results."""
    run_dir = Path(run_dir)
    found = checkpoint.resolve(resume, run_dir)
    if found is None and (run_dir / "final").exists() and resume == "auto":
        raise UserError(f"resume=auto: {run_dir} holds a finished run (final/) but no checkpoint to resume from. "
                        "Fix: a new hydra.run.dir for a new run (or train.save_every_steps=N in the next run).")
    return found


def clear_previous_results(run_dir: Path) -> None:
    """Remove a previous run's ``final/`` and ``summary.json`` (called by the loop once the model is loaded, which
    may be that very ``final/``, and before the first metrics of this run are written)."""
    run_dir = Path(run_dir)
    stale = [run_dir / name for name in ("final", "final.tmp", "final.old", "summary.json") if (run_dir / name).exists()]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if stale:
        log.info("removed the previous run's %s from %s", ", ".join(p.name for p in stale), run_dir)
