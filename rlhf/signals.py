"""Stopping a run cleanly on a signal: checkpoint at the next step boundary, then stop with one line.

- ``SIGTERM`` (``kill``, a scheduler stopping the job) and the first ``SIGINT`` (Ctrl-C): the loop finishes the
  step it is in, writes a checkpoint, and the run exits non-zero with one line naming the checkpoint and the
  command that resumes it (:class:`Stopped`). A second Ctrl-C aborts at once.
- ``SIGUSR2``: Slurm's warning before a job's time limit (``signal_delay_s`` of ``launcher=slurm``). The same
  checkpoint, then the handler that was there before (submitit's, which requeues the job and ends the process);
  the requeued job resumes from the checkpoint (``resume: auto`` in ``conf/launcher/slurm.yaml``).

With several processes every rank installs the handler; the loop all-reduces the request each step, so the ranks
stop together at the same step. When this process started the ranks itself (:mod:`rlhf.launch`), it forwards
``SIGUSR2`` to them (torch's elastic agent already turns ``SIGTERM``/``SIGINT`` into ``SIGTERM`` for them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

# The handler each signal had before this package first replaced it (submitit's USR2 handler in a Slurm job).
_previous: dict[int, Callable | int | None] = {}


class Stopped(Exception):
    """The run stopped on a signal after writing ``checkpoint``; ``train.py`` prints one line and exits with
    ``128 + signum``."""

    def __init__(self, signum: int, checkpoint: Path | None, run_dir: Path, step: int) -> None:
        self.signum, self.checkpoint, self.run_dir, self.step = signum, checkpoint, Path(run_dir), step
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint: {checkpoint}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self, command: str) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return f"stopped by {name} before the first step; nothing to resume. To start again: {command}"
        return f"stopped by {name} after step {self.step}; checkpoint {self.checkpoint}. To resume: {command}"


class StopRequest:
    """Records the first stop signal; the loop reads :attr:`signum` at each step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        if self.signum is None:
            self.signum = signum
            how = "a second Ctrl-C aborts at once" if signum == signal.SIGINT else "then stopping"
            log.warning("received %s: finishing this step and writing a checkpoint (%s)",
                        signal.Signals(signum).name, how)


@contextlib.contextmanager
def _handling(signals: tuple[int, ...], handler: Callable) -> Iterator[None]:
    """``handler`` for ``signals`` during the block (main thread only; elsewhere Python allows no handler), the
    earlier handlers restored after it; the first handler each signal had in this process is kept for
    :func:`hand_over`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        _previous.setdefault(sig, before[sig])
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in before.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopRequest]:
    """Record stop signals for the loop during the block."""
    request = StopRequest()
    with _handling(STOP_SIGNALS, request._handle):
        yield request


def hand_over(signum: int) -> bool:
    """Call the handler ``signum`` had before this package's (submitit's requeue for USR2); True if there was one."""
    handler = _previous.get(signum)
    if callable(handler):
        handler(signum, None)
        return True
    return False


@contextlib.contextmanager
def forward_to_children(signals: tuple[int, ...] = (signal.SIGUSR2,)) -> Iterator[StopRequest]:
    """While this process waits for the ranks it started, pass ``signals`` on to them (and remember the first)."""
    request = StopRequest()

    def forward(signum: int, frame) -> None:
        if request.signum is None:
            request.signum = signum
            log.warning("received %s: passing it to the training processes", signal.Signals(signum).name)
        for pid in _spawned_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    with _handling(signals, forward):
        yield request


def _spawned_children() -> list[int]:
    """PIDs of this process's children started by multiprocessing's spawn (the ranks), read from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    ranks = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
    return ranks
