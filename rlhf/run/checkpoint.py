"""Checkpoints that a run resumes from exactly, written so that a crash never replaces a good one.

A checkpoint is a folder ``<run dir>/checkpoints/step_<N>/``, taken only at a step boundary (after the optimizer
step, the scheduler step and the step's logging and evaluation, never inside an accumulation window):

- the model and optimizer state, written by the hardware strategy (``strategy.save_state``): one safetensors file
  and one optimizer file for a replicated model, each rank's shards for FSDP2 (``torch.distributed.checkpoint``)
  and ZeRO (DeepSpeed's own ``save_checkpoint``);
- ``scheduler.pt``: the learning-rate schedule's state (the same on every rank);
- ``rank_<r>.pt``: each rank's own state: every random generator (Python, NumPy, torch, CUDA), the loop's
  :class:`~rlhf.core.train_state.TrainState` (step, epoch, position in the epoch, the sums behind the averaged log window, counters) and
  the algorithm's state (``algo.state_dict()``, empty for most);
- ``config.json``: what of the run's config and data a resume must keep (:mod:`rlhf.run.resume_check`);
- ``meta.json``, written last: what the checkpoint is (step, processes, versions). A folder without it is not a
  checkpoint.

Every rank writes into ``.tmp-step_<N>``; then the main process renames it to ``step_<N>`` and removes the oldest
checkpoints beyond ``keep_last``. A run killed at any moment leaves the previous checkpoints whole. Files are read
back with ``torch.load(weights_only=True)``: a checkpoint never runs code when it is loaded; each tensor onto the
resuming process's device (:func:`rlhf.core.file_io.load_torch`), so a checkpoint written on a GPU resumes on a CPU.

Why not Accelerate's ``save_state`` for all of it: it saves the optimizer from the main process only (wrong for
FSDP2 and ZeRO, whose optimizer states are split over the ranks) and pickles the random states (its loader needs
``weights_only=False``). Its recipe is kept: the seedable sampler, ``set_epoch`` and ``skip_first_batches``
(:mod:`rlhf.data.loaders`), per-rank random states, and checkpoints only at step boundaries.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.core.errors import UserError
from rlhf.core.file_io import is_write_failure, load_torch, save_torch, use_umask
from rlhf.core.train_state import TrainState
from rlhf.ops.collectives import any_process

log = logging.getLogger(__name__)

FOLDER = "checkpoints"
PREFIX = "step_"
META = "meta.json"
CONFIG = "config.json"  # the run's config and data fingerprint (rlhf.run.resume_check), written before meta.json
FORMAT = 1  # bumped when the layout changes; an older checkpoint is refused with a clear message


# --- random generators ---------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every random generator a run draws from, in types ``torch.load(weights_only=True)`` reads back."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())  # generator states are CPU tensors, whatever device they are for
    if "cuda" in state and torch.cuda.is_available():
        # one per GPU of the machine that wrote it; a machine with fewer sets those it has
        torch.cuda.set_rng_state_all([each.cpu() for each in state["cuda"][:torch.cuda.device_count()]])


# --- finding checkpoints -----------------------------------------------------------------------------------------
def step_of(folder: Path) -> int:
    return int(folder.name[len(PREFIX):])


def complete(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (those with ``meta.json``), oldest first."""
    root = Path(run_dir) / FOLDER
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / META).is_file()]
    return sorted(found, key=step_of)


def latest(run_dir: Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names: ``None`` (a new run), ``auto`` (the run folder's newest, or none yet), or
    a checkpoint folder. Refuses a new run into a folder that holds checkpoints."""
    run_dir = Path(run_dir)
    if resume is None:
        newest = latest(run_dir)
        if newest is not None:
            raise UserError(
                f"the run folder {run_dir} already holds checkpoints (newest: {newest.name}), and a new run would "
                f"mix its metrics with theirs. Fix: resume=auto to continue that run from {newest.name}, or a new "
                "folder (hydra.run.dir=<another folder>, or leave hydra.run.dir out for a fresh timestamped one).")
        return None
    if str(resume) == "auto":
        newest = latest(run_dir)
        if newest is None:
            log.info("resume=auto: no checkpoint in %s yet, so this is a new run", run_dir)
        return newest
    path = Path(os.path.expanduser(str(resume)))
    if (path / META).is_file():
        return path
    if latest(path) is not None:
        raise UserError(f"resume={resume} is a run folder, not a checkpoint. Fix: resume={latest(path)} (its newest), "
                        f"or resume=auto hydra.run.dir={path}")
    if path.is_dir():
        raise UserError(f"resume={resume} is not a complete checkpoint (no {META}; an interrupted save leaves only a "
                        f".tmp- folder). Fix: a folder <run dir>/{FOLDER}/{PREFIX}<N> that has {META}, or resume=auto.")
    raise UserError(f"resume={resume}: no such checkpoint. Fix: resume=auto (the newest checkpoint of hydra.run.dir), "
                    f"or the path of a folder <run dir>/{FOLDER}/{PREFIX}<N>.")


def read_meta(folder: Path) -> dict[str, Any]:
    meta = json.loads((Path(folder) / META).read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"{folder} was written by another version of rlhf (checkpoint format {meta.get('format')}, "
                        f"this one reads {FORMAT}). Fix: resume with the version that wrote it.")
    return meta


# --- writing -------------------------------------------------------------------------------------------------------
def _fsync_tree(folder: Path) -> None:
    """Every file and every folder below ``folder`` (``sharded/``, DeepSpeed's ``global_step*/``), deepest first,
    then ``folder`` itself: what ``meta.json`` vouches for is on disk before the folder is renamed into place."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False


def replace_folder(staging: Path, folder: Path) -> None:
    """Put the complete folder ``staging`` at ``folder``. An existing ``folder`` is swapped out in one atomic
    step where the system allows it, so that a kill at any moment leaves a whole folder at ``folder``; else it is
    first renamed to ``<folder>.old`` (a kill then leaves the previous one there)."""
    use_umask(staging)  # safetensors writes its files 0600: give them the modes the user's umask says
    if not folder.exists():
        os.replace(staging, folder)
    elif _exchange(staging, folder):
        shutil.rmtree(staging)  # now holds the previous folder
    else:
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old)
    _fsync_dir(folder.parent)


def save_pretrained_atomically(model, tokenizer, folder: Path, state_dict: dict | None = None) -> None:
    """Write a Hugging Face model and its tokenizer to a sibling folder, then swap it in: an interrupted or failed
    save never replaces a good model. ``state_dict``: the whole model's weights when the model itself is sharded
    (FSDP2, ZeRO-3). Called by the main process, through ``strategy.save_model``."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
    except Exception as error:  # e.g. the disk is full: an OSError, or safetensors' own SafetensorError
        if not is_write_failure(error):
            raise
        shutil.rmtree(staging, ignore_errors=True)
        before = f"the model saved there before is still at {folder}" if folder.exists() else \
            f"nothing was at {folder} before"
        raise UserError(f"could not save the model to {folder} ({error}); the checkpoints and the metrics are kept, "
                        f"{before}. Fix: free disk space, then resume=auto.") from error
    replace_folder(staging, folder)


def save(run_dir: Path, state: TrainState, *, model, optimizer, scheduler, algo, strategy, accelerator,
         keep_last: int | None, meta: dict[str, Any], config: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``state.step`` (a collective: every rank calls it) and prune to ``keep_last``.
    ``config``: the run's record for resumes (``config.json``, :func:`rlhf.run.resume_check.record`)."""
    root = Path(run_dir) / FOLDER
    final = root / f"{PREFIX}{state.step:08d}"
    staging = root / f".tmp-{final.name}"
    rank = accelerator.process_index
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        strategy.save_state(model, optimizer, staging)
        own = {"train": state.to_dict(), "rng": rng_state(), "algo": algo.state_dict()}
        save_torch(own, staging / f"rank_{rank}.pt")
        if accelerator.is_main_process:
            save_torch(scheduler.state_dict(), staging / "scheduler.pt")
        error = None
    except Exception as failure:  # e.g. the disk is full: keep the previous checkpoints, say so, stop
        if not is_write_failure(failure):
            raise
        error = failure
    _agree_or_stop(error, accelerator, staging, state.step, root)
    accelerator.wait_for_everyone()
    error = None
    if accelerator.is_main_process:  # the small files, then the rename: a full disk can still refuse them
        try:
            if config is not None:
                (staging / CONFIG).write_text(json.dumps(config, indent=2))
            (staging / META).write_text(json.dumps({"format": FORMAT, "step": state.step, **meta}, indent=2))
            _fsync_tree(staging)
            replace_folder(staging, final)
        except Exception as failure:
            if not is_write_failure(failure):
                raise
            error = failure
    _agree_or_stop(error, accelerator, staging, state.step, root)
    if accelerator.is_main_process:
        prune(run_dir, keep_last, written=final)
    accelerator.wait_for_everyone()
    return final


def _agree_or_stop(error: BaseException | None, accelerator, staging: Path, step: int, root: Path) -> None:
    """Every rank learns whether any rank failed to write its part; if one did, the partial checkpoint goes and every
    rank stops with the same message (none is left waiting for the others)."""
    if any_process({"failed": error is not None}, accelerator)["failed"]:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"could not write the checkpoint of step {step} in {root} ({error or 'on another rank'}); "
                        "the previous checkpoints and the metrics are kept. Fix: free disk space (or lower "
                        "train.keep_last), then resume=auto.")


REMOVING = ".removing-"  # a checkpoint being deleted: renamed first, so it never looks complete while half gone


def prune(run_dir: Path, keep_last: int | None, written: Path) -> None:
    """Remove the oldest complete checkpoints beyond ``keep_last``, never ``written`` (the one just saved). Each is
    first renamed to ``.removing-step_<N>`` (one atomic rename), then deleted: a kill during the deletion leaves a
    folder that no one takes for a checkpoint, and the next prune finishes it."""
    root = Path(run_dir) / FOLDER
    for leftover in root.glob(f"{REMOVING}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if not keep_last:
        return
    for old in complete(run_dir)[:-keep_last]:
        if old == written:
            continue
        doomed = old.with_name(REMOVING + old.name)
        os.replace(old, doomed)
        _fsync_dir(root)
        shutil.rmtree(doomed, ignore_errors=True)


def load(folder: Path, *, model, optimizer, scheduler, algo, strategy, accelerator) -> TrainState:
    """Restore everything :func:`save` wrote into the live objects; return this rank's :class:`TrainState`."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta.get("processes") != accelerator.num_processes:
        raise UserError(f"{folder} was written by {meta.get('processes')} process(es) and this run has "
                        f"{accelerator.num_processes}: the data order and the per-rank state would not continue. "
                        f"Fix: resume with hardware.num_processes={meta.get('processes')}.")
    written_by = meta.get("strategy")
    if written_by is not None and written_by != type(strategy).__name__:
        raise UserError(f"{folder} was written by the {written_by} strategy and this run uses "
                        f"{type(strategy).__name__}: its model and optimizer files are laid out differently. "
                        "Fix: resume with the hardware option that wrote it.")
    own_file = folder / f"rank_{accelerator.process_index}.pt"
    if not own_file.is_file():
        raise UserError(f"{folder} has no {own_file.name}: the checkpoint is incomplete. Fix: resume from an older "
                        "one (resume=<run dir>/checkpoints/step_<N>).")
    strategy.load_state(model, optimizer, folder)
    # Onto this process's device: a checkpoint written on a GPU resumes on a CPU (rlhf.core.file_io.load_torch)
    scheduler.load_state_dict(load_torch(folder / "scheduler.pt", accelerator.device))
    own = load_torch(own_file, accelerator.device)
    algo.load_state_dict(own.get("algo", {}))
    set_rng_state(own["rng"])
    return TrainState.from_dict(own["train"])
