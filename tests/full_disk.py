"""A test-only algorithm: DPO on whose chosen process every file write fails from a chosen training micro-batch on
(``algo._target_=tests.full_disk.FullDiskFrom``), so that a test can make one rank's checkpoint fail for real.

The process's file-size limit (``RLIMIT_FSIZE``) is lowered, so that the kernel refuses its writes past that many
bytes of any file with EFBIG ("File too large"), as a full disk refuses one with ENOSPC: whatever writes
(torch.save, safetensors, ``torch.distributed.checkpoint``, DeepSpeed), through the real save path, on that
process only, and as root too (where ``chmod`` cannot make a folder read-only). SIGXFSZ, which the kernel sends
with the refusal, is ignored. Writes to a terminal or a pipe are not limited; to a file (stderr captured into one)
they fail too, which logging and warnings ignore, so arm it just before the save that should fail.
:func:`restore` puts the limit back (a test that runs on in the same process calls it).
"""

from __future__ import annotations

import os
import resource
import signal

import torch

from rlhf.algos.dpo import DPO

_SAVED: list = []  # (limit, handler) before the first lowering


def fill_disk(limit_bytes: int = 0) -> None:
    """From now on this process cannot write past `limit_bytes` of any file."""
    if not _SAVED:
        _SAVED.append((resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)))
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))


def restore() -> None:
    """Undo :func:`fill_disk` (nothing when it was not called)."""
    if _SAVED:
        limit, handler = _SAVED.pop()
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


class FullDiskFrom(DPO):
    """Args: call: the 0-based training micro-batch (a call of ``loss`` with gradients on; DeepSpeed's engine
    reports ``training`` even in evaluation) from which this process cannot write; rank: only on this process
    (``RANK``), or on every one when null; limit_bytes: the size past which no file can grow (0: not a byte; the
    main process, which appends to ``metrics.jsonl`` and ``train.log``, needs room for those few kB)."""

    def __init__(self, call: int = 1, rank: int | None = None, limit_bytes: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.call, self.rank, self.limit_bytes, self.count = call, rank, limit_bytes, 0

    def loss(self, model, batch, **kwargs):  # kwargs: e.g. DPO's training=False on held-out batches
        if torch.is_grad_enabled():
            if self.count == self.call and (self.rank is None or int(os.environ.get("RANK", "0")) == self.rank):
                fill_disk(self.limit_bytes)
            self.count += 1
        return super().loss(model, batch, **kwargs)
