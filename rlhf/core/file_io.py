"""Files with the permissions the user's umask gives, where a library writes them private; write failures that
libraries report as something other than :class:`OSError`.

safetensors (0.8 and later) writes every ``*.safetensors`` file through a temporary file created with mode 0600
and renames it into place, so ``save_pretrained`` leaves the weights readable by their owner only, beside a
``config.json`` that the umask made 0644; ``tempfile.mkdtemp`` makes its folder 0700. In a shared cache or a
shared run folder, other users (a serving job, a colleague, a container with another uid) then cannot read the
model. :func:`use_umask` gives a freshly written folder the modes a plain ``open()`` / ``mkdir()`` would have.

A write that the system refuses (a full disk, a file-size limit) surfaces from ``torch.save(obj, path)`` as a
``RuntimeError`` ("[enforce fail at inline_container.cc] ... unexpected pos 576 vs 534") and from safetensors as
a ``SafetensorError``; :func:`save_torch` and :func:`save_safetensors` raise it as :class:`OSError`, the one type
the checkpoint code treats as "could not write".

A file that ``torch.save`` wrote records each tensor's device, and ``torch.load`` without ``map_location`` puts it
back there: a checkpoint written on a GPU then cannot be read on a CPU (or on a machine with fewer GPUs).
:func:`load_torch` reads onto the reading process's device instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import torch


def current_umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux ``/proc``)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once (the only portable way to read it)
    os.umask(mask)
    return mask


def use_umask(folder: str | os.PathLike) -> None:
    """Give ``folder``, the folders in it and their files the umask's modes: ``0o777 & ~umask`` for folders,
    ``0o666 & ~umask`` for files (0755 and 0644 under the usual umask 022). Call it on a folder this process has
    just written, before renaming it into place. Symbolic links are left alone."""
    mask = current_umask()
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)
    os.chmod(folder, 0o777 & ~mask)


def load_torch(file: str | os.PathLike | IO[bytes], device: torch.device | str) -> Any:
    """``torch.load(file, weights_only=True)`` (no code runs), each tensor onto the process that reads it: one
    saved on the CPU stays there (random generator states, which ``torch.set_rng_state`` takes on the CPU only, and
    what its owner kept there), any other goes to ``device``, the reading process's own (the machine that wrote it
    may have had a GPU this one lacks, or another index). On the device it was saved from, the same placement as a
    plain ``torch.load``. The ``map_location`` callable is torch's (``torch.load``'s docs)."""
    target = str(torch.device(device))

    def restore(storage, location: str):
        return storage if location == "cpu" else torch.serialization.default_restore_location(storage, target)

    return torch.load(file, map_location=restore, weights_only=True)


def save_torch(obj: Any, path: str | os.PathLike, zipfile: bool = True) -> None:
    """``torch.save(obj, path)`` through a Python file, so that a refused write raises the system's own
    :class:`OSError` (``[Errno 28] No space left on device: '<path>'``); torch's zip writer, given a path, reports
    it as a ``RuntimeError`` that does not say why. Any other ``RuntimeError`` of the write is raised as OSError."""
    try:
        with open(path, "wb") as file:
            torch.save(obj, file, _use_new_zipfile_serialization=zipfile)
    except RuntimeError as error:  # the file's own OSError, when there was one, is in its context
        reason = error.__context__
        while reason is not None and not isinstance(reason, OSError):
            reason = reason.__context__
        if reason is not None and reason.errno is not None:
            raise OSError(reason.errno, reason.strerror, str(path)) from error
        raise OSError(f"writing {path} failed ({error})") from error
    except OSError as error:
        if error.filename is None and error.errno is not None:  # raised by the buffer's flush: name the file
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise


def save_safetensors(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """``safetensors.torch.save_model(model, path)``; a failed write raised as :class:`OSError`."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    try:
        save_model(model, str(path))
    except SafetensorError as error:
        raise OSError(f"writing {path} failed ({error})") from error


def is_write_failure(error: BaseException) -> bool:
    """Whether `error` is a file that could not be written (a full disk, no permission), as the libraries that
    write checkpoints and models report it: ``OSError``; safetensors' own ``SafetensorError`` (not an OSError:
    ``Error while serializing: I/O error: No space left on device``); and the ``RuntimeError`` of torch.save's zip
    writer (``PytorchStreamWriter failed writing file``, ``[enforce fail at inline_container.cc] ... unexpected
    pos``). Any other error is a bug and keeps its traceback."""
    if isinstance(error, OSError):
        return True
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        SafetensorError = ()  # noqa: N806
    if isinstance(error, SafetensorError):
        return True
    return isinstance(error, RuntimeError) and any(
        mark in str(error) for mark in ("PytorchStreamWriter", "inline_container", "file write failed"))
