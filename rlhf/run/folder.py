"""The run folder is written by one run at a time, and never mixes two runs' results.

- :func:`claim` takes an exclusive ``fcntl.flock`` on ``<run dir>/.lock`` for the duration of the run; a second
  run into the same folder stops with a message naming the first one's PID. The kernel drops the lock when its
  process dies, so a lock left by a killed run never blocks.
- :func:`prepare` turns ``resume`` into a checkpoint (or none) and refuses a new run into a folder that holds
  checkpoints; :func:`clear_previous_results` sets a previous run's ``summary.json`` aside in ``previous/`` before a
  new or resumed run writes its first metrics, so that it never sits beside metrics it does not belong to, and
  :func:`drop_previous_results` removes it once the run's own is written. A previous run's ``final/`` stays where
  it is until this run's is complete and swapped in (:func:`rlhf.run.checkpoint.replace_folder`): a kill, a full disk
  or a failed save at any moment leaves the old model or the new one at ``final/``.
- :func:`set_aside_newer`: a resume from an older checkpoint of the folder moves the abandoned branch (the newer
  checkpoints and the metrics lines after the resumed step) into ``checkpoints/abandoned-<time>/``, where neither
  ``resume=auto`` nor ``train.keep_last`` sees them.
- :func:`resume_overrides`: ``python train.py hydra.run.dir=<run> resume=auto`` re-applies the run's own recorded
  overrides, and records the attempt's config beside the run's original one (``.hydra/attempt-<time>/``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from rlhf.core.errors import UserError
from rlhf.run import checkpoint

log = logging.getLogger(__name__)

LOCK = ".lock"
# What a run's numbers depend on beyond its config: threads_per_process, mixed_precision, machine, num_processes, torch
ENVIRONMENT = "environment.json"
# Which trainable tensors each update rule steps, with counts and learning rates (rlhf.optim.partition.Split.record)
PARTITION = "partition.json"
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
    if found is None and (run_dir / "summary.json").exists() and resume == "auto":  # written as a run finishes
        raise UserError(f"resume=auto: {run_dir} holds a finished run (summary.json) but no checkpoint to resume from. "
                        "Fix: a new hydra.run.dir for a new run (or train.save_every_minutes / train.save_every_steps "
                        "in the next run).")
    return found


# What a run leaves in its folder before it trains: Hydra's record and log, the lock, the tokenized data.
_BEFORE_TRAINING = {".hydra", "train.log", LOCK, ".cache", ENVIRONMENT}
# (run folder, the outermost folder made with it) when Hydra made this process's single run folder, which did not
# exist before; else None (a sweep, a Python caller, an existing folder). Told by rlhf.config.checks.CheckBeforeRun.
_made_by_hydra: tuple[str, str] | None = None


def made_by_hydra(made: tuple[str, str] | None) -> None:
    """Record whether Hydra is about to make this process's single run folder (:func:`remove_if_never_started`)."""
    global _made_by_hydra
    _made_by_hydra = made


def remove_if_never_started(run_dir: Path) -> None:
    """Remove the run folder (and the folders made with it) that Hydra made for this run, when the run stopped
    before it wrote anything of its own (a bad row, a model that cannot load): no folder for a run that never
    started. A folder that existed before this run, or holds anything else (metrics, checkpoints), is kept."""
    made = _made_by_hydra
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


PREVIOUS = "previous"  # a previous run's summary.json, set aside until this run's is written


def clear_previous_results(run_dir: Path) -> None:
    """Set a previous run's ``summary.json`` aside in ``previous/`` (called by the loop before the first metrics of
    this run are written), so that it never sits beside metrics it does not belong to, until this run's own is
    written (:func:`drop_previous_results`). A previous run's ``final/`` stays in place until this run's replaces
    it whole; a save killed between its two renames (``final.old/``, where the system cannot swap two folders in one
    step) has its model put back, a half-written ``final.tmp/`` is removed, and a ``final/`` an earlier version of
    this project set aside in ``previous/`` is put back."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / "final.tmp", ignore_errors=True)
    final = run_dir / "final"
    for earlier in (run_dir / "final.old", run_dir / PREVIOUS / "final"):
        if not final.exists() and earlier.is_dir():
            os.replace(earlier, final)
    shutil.rmtree(run_dir / "final.old", ignore_errors=True)
    shutil.rmtree(run_dir / PREVIOUS / "final", ignore_errors=True)  # older than final/
    if final.is_dir():
        log.info("final/ holds the previous run's model until this run's replaces it, whole, at its end")
    summary = run_dir / "summary.json"
    if summary.exists():
        (run_dir / PREVIOUS).mkdir(exist_ok=True)
        os.replace(summary, run_dir / PREVIOUS / "summary.json")
        fd = os.open(run_dir, os.O_RDONLY)  # the rename is on disk before this run writes anything
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("set the previous run's summary.json aside in %s until this run's is written", run_dir / PREVIOUS)


def drop_earlier_model(run_dir: Path) -> None:
    """This run writes no ``final/`` (``train.save_final=false``, ``train.max_steps=0``): one an earlier run left in
    the folder would sit beside this run's ``summary.json`` as if it were this run's model. It goes with the earlier
    summary (:func:`drop_previous_results`)."""
    final = Path(run_dir) / "final"
    if final.is_dir():
        (final.parent / PREVIOUS).mkdir(exist_ok=True)
        os.replace(final, final.parent / PREVIOUS / "final")
        log.info("removed the earlier run's final/: this run writes no model (train.save_final=false or "
                 "train.max_steps=0), and it is not this run's")


def drop_previous_results(run_dir: Path) -> None:
    """Remove the results :func:`clear_previous_results` set aside: this run's own are complete."""
    shutil.rmtree(Path(run_dir) / PREVIOUS, ignore_errors=True)


ABANDONED = "abandoned-"  # checkpoints/abandoned-<time>/: a branch given up by a resume from an older checkpoint


def make_room(run_dir: Path, resumed_step: int | None, metrics_file: str = "metrics.jsonl") -> None:
    """Before a run writes its first metrics (main process): a resume from an older checkpoint sets the newer branch
    aside (:func:`set_aside_newer`), a new run an earlier attempt's logs (:func:`set_aside_earlier_attempt`); then
    the previous results go aside until this run's are written (:func:`clear_previous_results`)."""
    if resumed_step is not None:
        set_aside_newer(run_dir, resumed_step, metrics_file)
    else:
        set_aside_earlier_attempt(run_dir, metrics_file)
    clear_previous_results(run_dir)


def _abandoned_folder(run_dir: Path) -> Path:
    """A new ``checkpoints/abandoned-<time>/`` folder."""
    root = run_dir / checkpoint.FOLDER
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    aside, n = root / f"{ABANDONED}{stamp}", 1
    while aside.exists():
        n += 1
        aside = root / f"{ABANDONED}{stamp}-{n}"
    aside.mkdir(parents=True)
    return aside


def _logged_steps(path: Path) -> list[int] | None:
    """The steps of a run's log file (JSON lines with a ``step``; a line cut off by a kill is skipped), or None for
    a file that is not one (the user's own data)."""
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            return None
        steps.append(entry["step"])
    return steps


def set_aside_earlier_attempt(run_dir: Path, metrics_file: str = "metrics.jsonl") -> None:
    """A new run (no checkpoint to resume from) into a folder where an earlier run logged metrics, e.g. one killed
    before its first checkpoint and started again with the same command: that run's logs (``metrics_file`` and the
    loggers' other ``*.jsonl`` tables, whose lines carry a step) go into ``checkpoints/abandoned-<time>/``, as a
    branch given up by a resume does, and one line says what was found and where it went."""
    run_dir = Path(run_dir)
    metrics = run_dir / metrics_file
    steps = _logged_steps(metrics) if metrics.is_file() else None
    if not steps:
        return
    logs = [metrics, *(p for p in sorted(run_dir.glob("*.jsonl")) if p != metrics and _logged_steps(p) is not None)]
    aside = _abandoned_folder(run_dir)
    for path in logs:
        os.replace(path, aside / path.name)
    checkpoint._fsync_dir(run_dir)
    what = "an earlier run that finished" if (run_dir / "summary.json").exists() else \
        "an earlier attempt that stopped without a checkpoint to resume from"
    log.warning("this folder holds %s at step %d: its logs are set aside in %s, and this run starts at step 1", what,
                max(steps), aside)


def set_aside_newer(run_dir: Path, step: int, metrics_file: str = "metrics.jsonl") -> Path | None:
    """This run resumes at ``step``: move the folder's newer complete checkpoints, and a copy of the lines of
    ``metrics_file`` logged after ``step`` (the logger then cuts the file back), into
    ``checkpoints/abandoned-<time>/``, so that a later ``resume=auto`` never continues the branch given up, and
    ``keep_last`` counts only the branch that goes on. Return that folder (None when nothing was newer)."""
    run_dir = Path(run_dir)
    newer = [c for c in checkpoint.complete(run_dir) if checkpoint.step_of(c) > step]
    if not newer:
        return None
    aside = _abandoned_folder(run_dir)
    lines = []
    metrics = run_dir / metrics_file
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                if json.loads(line)["step"] > step:
                    lines.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by a kill: it and whatever follows are dropped, as the logger does
        (aside / metrics_file).write_text("".join(lines))
    for folder in newer:
        os.replace(folder, aside / folder.name)
    checkpoint._fsync_dir(aside.parent)
    log.info("resuming at step %d: the newer checkpoint(s) %s and %d %s line(s) after step %d were moved to %s",
             step, ", ".join(c.name for c in newer), len(lines), metrics_file, step, aside)
    return aside


# --- resuming without retyping the command ---------------------------------------------------------------------
RECORDED = ".hydra"  # Hydra's record of a run: config.yaml, hydra.yaml, overrides.yaml
ATTEMPT = "attempt-"  # .hydra/attempt-<time>/: the record of one resumed attempt, beside the run's original one
_NOT_CARRIED = ("resume", "resume_changes")  # a resume says these anew: never taken from an earlier attempt
RESUMED_FROM = "resumed_from.txt"  # in an attempt's record once its resume passed the check: the checkpoint


def record_resume(checkpoint_folder: Path) -> None:
    """Mark this Hydra job's record (``.hydra/attempt-<time>/``) as an attempt that resumed the run, once the resume
    check let it, naming the checkpoint; :func:`resume_overrides` re-applies only such attempts' overrides."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return
        hydra = HydraConfig.get()
        if not hydra.output_subdir:
            return
        record = Path(hydra.runtime.output_dir) / hydra.output_subdir
    except Exception:  # not under Hydra (rlhf.train called from Python)
        return
    if record.name.startswith(ATTEMPT) and record.is_dir():
        (record / RESUMED_FROM).write_text(f"{checkpoint_folder}\n")


def resume_overrides(args: list[str]) -> list[str]:
    """The command line of a resume into a run folder that Hydra has recorded: ``train.py``'s arguments ``args``
    with ``hydra.run.dir=<run>`` and ``resume=auto`` (or ``resume=<checkpoint>``) become the run's recorded
    overrides (its latest attempt's, else its original ones), with those given now on top (the deliberate changes,
    which the resume check refuses unless ``resume_changes`` lists them), and
    ``hydra.output_subdir=.hydra/attempt-<time>`` so that the run's original ``.hydra/`` is never overwritten.
    Any other command line (a new run, a new folder, a sweep) is returned as it is."""
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    if any(a in ("-m", "--multirun") for a in args):
        return args
    values = {_key(o): o.split("=", 1)[1] for o in overrides}
    run_dir, resume = values.get("hydra.run.dir"), values.get("resume")
    if not run_dir or resume in (None, "", "null"):
        return args
    recorded_dir = Path(os.path.expanduser(run_dir)) / RECORDED
    source = _recorded_overrides(recorded_dir, _target_step(Path(os.path.expanduser(run_dir)), resume))
    try:
        recorded = [str(o) for o in yaml.safe_load(source.read_text()) or []]
    except (OSError, yaml.YAMLError):
        return args  # no record (a new folder, or hydra.output_subdir=null): the command line is all there is
    given = {_key(o) for o in overrides}
    plus = {_key(o) for o in recorded if o.startswith("+") and not o.startswith("++")}
    carried = [o for o in recorded if _key(o) not in given and _key(o) not in _NOT_CARRIED]
    # A key the run added with +key=... exists only through that override: a new value of it needs ++.
    now = [f"++{o}" if _key(o) in plus and not o.startswith(("+", "~")) else o for o in overrides]
    subdir = [] if "hydra.output_subdir" in given else [f"hydra.output_subdir={RECORDED}/{_attempt_name(recorded_dir)}"]
    if carried and os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"resume: re-applying the run's overrides from {source}: {' '.join(carried)}", file=sys.stderr)
    flags = [a for a in args if a not in overrides]
    return [*flags, *carried, *now, *subdir]


def _target_step(run_dir: Path, resume: str) -> int | None:
    """The step of the checkpoint this resume will continue (None: none yet, or not a step_<N> folder)."""
    folder = checkpoint.latest(run_dir) if resume == "auto" else Path(os.path.expanduser(resume))
    try:
        return checkpoint.step_of(folder) if folder is not None else None
    except ValueError:
        return None


def _recorded_overrides(recorded_dir: Path, step: int | None) -> Path:
    """The overrides of the attempt that wrote the checkpoint of ``step``: the newest attempt that the resume check
    let through and that began below that step (a refused attempt, or one that wrote nothing, is not it), else the
    run's original record."""
    def began_below(marker: Path) -> bool:
        try:
            return step is None or checkpoint.step_of(Path(marker.read_text().strip())) < step
        except (OSError, ValueError):
            return False

    attempts = [m for m in sorted(recorded_dir.glob(f"{ATTEMPT}*/{RESUMED_FROM}")) if began_below(m)]
    return attempts[-1].with_name("overrides.yaml") if attempts else recorded_dir / "overrides.yaml"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("~+")


def _attempt_name(recorded_dir: Path) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name, n = f"{ATTEMPT}{stamp}", 1
    while (recorded_dir / name).exists():
        n += 1
        name = f"{ATTEMPT}{stamp}-{n}"
    return name
