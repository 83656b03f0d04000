"""A disk that fills up while a run saves: one message, nothing half-written left, the previous results kept.

The disk is a real one where the machine allows it: a 16 MB tmpfs mounted for the test (root with the right to
mount, as in CI's container when it has it) and filled to the last byte just before the save, so the save fails in
the libraries' own write path (safetensors raises its own ``SafetensorError``, torch.save a ``RuntimeError``, not
``OSError``). Elsewhere the kernel's file-size limit (``RLIMIT_FSIZE``) makes the same writes fail with
``File too large``, through the same path. About 10 s in all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.core.errors import UserError
from rlhf.run import checkpoint
from rlhf.run import folder as run_folder
from tests.conftest import FAST, compose_config


class Disk:
    """A folder whose writes can be made to fail for real: :meth:`full` fills it (tmpfs) or limits file sizes."""

    def __init__(self, folder: Path, mounted: bool) -> None:
        self.folder, self.mounted = folder, mounted

    @contextlib.contextmanager
    def full(self, room: int = 32 * 1024):
        """Writes fail beyond `room` bytes: the small files a save writes first (config.json) fit, the weights
        do not, so the error comes from safetensors' own write."""
        if self.mounted:
            filler = self.folder / "filler"
            stats = os.statvfs(self.folder)
            left = stats.f_bavail * stats.f_frsize - room
            with open(filler, "wb") as handle:
                with contextlib.suppress(OSError):
                    while left > 0:
                        left -= handle.write(b"\0" * min(left, 1 << 20))
                        handle.flush()
                with contextlib.suppress(OSError):
                    handle.close()
            try:
                yield "No space left on device"
            finally:
                filler.unlink()
            return
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, limits[1]))
        try:
            yield "File too large"
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, previous)


@pytest.fixture
def disk(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    try:
        yield Disk(folder, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def _fails_when_full(monkeypatch, disk: Disk, name: str, call: int = 1) -> list[str]:
    """Make the `call`-th call of ``rlhf.run.checkpoint.<name>`` run on a full disk; return the reason it will give."""
    original, calls, reason = getattr(checkpoint, name), [], []

    def on_full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) != call:
            return original(*args, **kwargs)
        with disk.full() as why:
            reason.append(why)
            return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, name, on_full_disk)
    return reason


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one(disk, monkeypatch):
    run = disk.folder / "run"
    reason = _fails_when_full(monkeypatch, disk, "save", call=2)
    with pytest.raises(UserError) as error:
        train(compose_config(*FAST, "train.save_every_steps=1", output_dir=run))
    assert str(error.value).startswith(f"could not write the checkpoint of step 2 in {run / 'checkpoints'} (")
    assert reason[0] in str(error.value) and "the previous checkpoints and the metrics are kept" in str(error.value)
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000001"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]  # no .tmp- left
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2


def test_a_full_disk_at_the_final_save_keeps_the_previous_runs_model_in_place(disk, monkeypatch):
    """A new run into a folder with a finished run's final/: that final/ stays where it is until the new one is
    complete (red before: moved to previous/ at the start), so a save that fails on a full disk leaves the earlier
    model at final/ and the message says so; the earlier summary.json is set aside in previous/; the next run that
    completes replaces final/ and removes previous/."""
    run = disk.folder / "run"
    train(compose_config(*FAST, output_dir=run))
    first = load_file(run / "final" / "model.safetensors")
    first_summary = (run / "summary.json").read_text()

    reason = _fails_when_full(monkeypatch, disk, "save_pretrained_atomically")
    with pytest.raises(UserError) as error:
        train(compose_config(*FAST, "train.max_steps=2", output_dir=run))
    assert str(error.value).startswith(f"could not save the model to {run / 'final'} (Error while serializing: ")
    assert reason[0] in str(error.value)  # safetensors' own error, not an OSError
    assert f"the model saved there before is still at {run / 'final'}" in str(error.value)
    names = sorted(p.name for p in run.iterdir())
    assert "final" in names and "final.tmp" not in names and "summary.json" not in names, names
    kept = load_file(run / "final" / "model.safetensors")
    assert kept.keys() == first.keys() and all(torch.equal(kept[k], first[k]) for k in first)
    assert (run / run_folder.PREVIOUS / "summary.json").read_text() == first_summary

    monkeypatch.undo()
    train(compose_config(*FAST, "train.max_steps=2", output_dir=run))
    assert (run / "final" / "model.safetensors").is_file() and not (run / run_folder.PREVIOUS).exists()


def test_the_write_failures_of_each_library_are_told_apart_from_bugs():
    from safetensors import SafetensorError

    from rlhf.core.file_io import is_write_failure

    assert is_write_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert is_write_failure(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert is_write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1664 vs 1622"))
    assert not is_write_failure(RuntimeError("expected scalar type Float but found Half"))
    assert not is_write_failure(ValueError("No space left on device"))


def test_a_new_run_sets_the_previous_summary_aside_and_keeps_the_model_in_place(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    (tmp_path / "summary.json").write_text('{"final": {}}')
    (tmp_path / "final.tmp").mkdir()  # a save killed half way
    run_folder.clear_previous_results(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["final", run_folder.PREVIOUS]
    assert os.listdir(tmp_path / run_folder.PREVIOUS) == ["summary.json"]
    shutil.rmtree(tmp_path / "final")
    (tmp_path / "final.old").mkdir()  # killed between the two renames of a save: its model is put back
    (tmp_path / "final.old" / "config.json").write_text('{"newer": true}')
    run_folder.clear_previous_results(tmp_path)
    assert (tmp_path / "final" / "config.json").read_text() == '{"newer": true}'
    assert sorted(os.listdir(tmp_path)) == ["final", run_folder.PREVIOUS]
    os.replace(tmp_path / "final", tmp_path / run_folder.PREVIOUS / "final")  # set aside by an earlier version
    run_folder.clear_previous_results(tmp_path)
    assert (tmp_path / "final" / "config.json").read_text() == '{"newer": true}'
    run_folder.drop_previous_results(tmp_path)
    assert os.listdir(tmp_path) == ["final"]
