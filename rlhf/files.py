"""Files with the permissions the user's umask gives, where a library writes them private.

safetensors (0.8 and later) writes every ``*.safetensors`` file through a temporary file created with mode 0600
and renames it into place, so ``save_pretrained`` leaves the weights readable by their owner only, beside a
``config.json`` that the umask made 0644; ``tempfile.mkdtemp`` makes its folder 0700. In a shared cache or a
shared run folder, other users (a serving job, a colleague, a container with another uid) then cannot read the
model. :func:`use_umask` gives a freshly written folder the modes a plain ``open()`` / ``mkdir()`` would have.
"""

from __future__ import annotations

import os
from pathlib import Path


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
