"""The run folder is written by one run at a time, and never mixes two runs' results.

- :func:`claim` takes an exclusive ``fcntl.flock`` on ``<run dir>/.lock`` for the duration of the run; a second
  run into the same folder stops with a message naming the first one's PID. The kernel drops the lock when its
  process dies, so a lock left by a killed run never blocks.
- :func:`prepare` turns ``resume`` into a checkpoint (or none) and refuses a new run into a folder that holds
  checkpoints; :func:`clear_previous_results` sets a previous run's ``final/`` and ``summary.json`` aside in
  ``previous/`` before a new or resumed run writes its first metrics, so that they never sit beside metrics they do
  not belong to, and :func:`drop_previous_results` removes them once the run's own are written: a kill at any
  moment leaves the folder a loadable model if it had one.
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


# What a run leaves in its folder before it trains: Hydra's record and log, the lock, the tokenized data.
_BEFORE_TRAINING = {".hydra", "train.log", LOCK, ".cache"}


def remove_if_never_started(run_dir: Path) -> None:
    """Remove the run folder (and the folders made with it) that Hydra made for this run, when the run stopped
    before it wrote anything of its own (a bad row, a model that cannot load): no folder for a run that never
    started. A folder that existed before this run, or holds anything else (metrics, checkpoints), is kept."""
    from rlhf.config import made_by_this_run

    made = made_by_this_run()
    folder = Path(run_dir).absolute()
    if made is None or str(folder) != made[0] or not folder.is_dir():
        return
    if not {p.name for p in folder.iterdir()} <= _BEFORE_TRAINING:
        return
    shutil.rmtree(folder, ignore_errors=True)
    while folder != Path(made[1]) and folder.parent != folder:
        folder = folder.parent
        try:
            folder.rmdir()  # only when empty: e.g. outputs/<date>/ made for this run alone
        except OSError:
            return


PREVIOUS = "previous"  # a previous run's final/ and summary.json, set aside until this run's are complete


def clear_previous_results(run_dir: Path) -> None:
    """Set a previous run's ``final/`` and ``summary.json`` aside in ``previous/`` (called by the loop once the
    model is loaded, which may be that very ``final/``, and before the first metrics of this run are written), so
    that they never sit beside metrics they do not belong to, while a folder that had a loadable model keeps one
    until this run's own is complete (:func:`drop_previous_results`). A ``final/`` newer than the one already in
    ``previous/`` replaces it there; a half-written ``final.tmp/`` is removed."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / "final.tmp", ignore_errors=True)
    final = run_dir / "final"
    if not final.exists() and (run_dir / "final.old").is_dir():  # a save killed between its two renames
        os.replace(run_dir / "final.old", final)
    shutil.rmtree(run_dir / "final.old", ignore_errors=True)
    moved = []
    for name in ("summary.json", "final"):
        path = run_dir / name
        if not path.exists():
            continue
        aside = run_dir / PREVIOUS / name
        aside.parent.mkdir(exist_ok=True)
        if aside.is_dir():
            shutil.rmtree(aside)  # older than the one set aside now, which stays in place until the rename
        os.replace(path, aside)
        moved.append(name)
    if moved:
        fd = os.open(run_dir, os.O_RDONLY)  # the renames are on disk before this run writes anything
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("set the previous run's %s aside in %s until this run's are complete",
                 " and ".join(moved), run_dir / PREVIOUS)


def drop_previous_results(run_dir: Path) -> None:
    """Remove the results :func:`clear_previous_results` set aside: this run's own are complete."""
    shutil.rmtree(Path(run_dir) / PREVIOUS, ignore_errors=True)
