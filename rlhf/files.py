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
