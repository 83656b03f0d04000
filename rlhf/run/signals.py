"""Stopping a run cleanly on a signal, whenever it comes: checkpoint at the next step boundary, then one line.

- ``SIGTERM`` (``kill``, a scheduler stopping the job) and the first ``SIGINT`` (Ctrl-C): the loop finishes the
  step it is in, writes a checkpoint, and the run exits non-zero with one line naming the checkpoint and the
  command that resumes it (:class:`Stopped`). A second Ctrl-C aborts at once.
- ``SIGUSR2``: Slurm's warning before a job's time limit (``signal_delay_s`` of ``launcher=slurm``). The same
  checkpoint, then the handler that was there before (submitit's, which requeues the job and ends the process);
  the requeued job resumes from the checkpoint (``resume: auto`` in ``conf/launcher/slurm.yaml``).

When the signal comes:

- before the first step (start-up: imports, model build, tokenizing): recorded; the run stops before its first step
  (a resumed run names the checkpoint it resumed from, a new one has nothing to resume);
- during a step, its logging, evaluation or checkpoint: the step ends, a checkpoint is written, the run stops;
- during the final evaluation (after the last step): a checkpoint of the last step, then the stop; the resumed run
  goes straight to the final save;
- during the final save: the save completes and the run ends as finished (nothing is left to resume).

``train.py`` installs the handlers (:func:`install`) for the life of its process, after blocking the stop signals at
its first statement (a signal during its imports waits, then counts). With several processes (:mod:`rlhf.launch.processes`)
the process that starts the ranks blocks the stop signals in the thread that spawns them, so that each rank starts
with them blocked (the mask survives fork and exec) and unblocks them once its own handler is installed: a rank
never dies of a signal that came before its handler, and keeps the handler until it exits. The parent passes every
stop request on to its ranks (a Ctrl-C as SIGTERM: the ranks leave Ctrl-C to the parent); a signal that reaches a
rank twice (from Slurm, which signals every process of a job, and from the parent) is one request. The loop
all-reduces the request each step, so the ranks stop together at the same step.
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
# Tests only: "<phase>:<SIGNAL>:<parent|all>" makes the run signal itself when the phase begins (see reached()).
TEST_SIGNAL = "RLHF_TEST_SIGNAL"

# The handler each signal had before this package first replaced it (submitit's USR2 handler in a Slurm job).
_previous: dict[int, Callable | int | None] = {}
_installed: StopRequest | None = None  # the request of this process's whole life (install())


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
    """Records the first stop signal; the loop reads :attr:`signum` at each step boundary. Later signals are the
    same request (Slurm signals every process of a job, and the parent passes its own on), except a second Ctrl-C,
    which aborts (where Ctrl-C is this process's to handle)."""

    def __init__(self, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce  # log the request (the process a user watches; not each rank again)

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        if self.signum is None:
            self.signum = signum
            if self.announce:
                how = "a second Ctrl-C aborts at once" if signum == signal.SIGINT else "then stopping"
                log.warning("received %s: finishing this step and writing a checkpoint (%s)",
                            signal.Signals(signum).name, how)


def block() -> None:
    """Hold the stop signals back in this thread (and in every process it starts) until :func:`unblock`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def unblock() -> None:
    """Deliver the stop signals again; one that came while they were blocked is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def install(*, announce: bool = True, ctrl_c: bool = True) -> StopRequest:
    """Record stop signals for the rest of this process's life (``train.py``, each rank), then unblock them.
    ``ctrl_c=False`` (a rank its parent started): Ctrl-C is ignored here; the parent passes it on as SIGTERM."""
    global _installed
    if _installed is None:
        _installed = StopRequest(announce)
        for sig in STOP_SIGNALS:
            _previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, _installed._handle)
    if not ctrl_c:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _installed.announce = announce
    unblock()
    return _installed


def ignore() -> None:
    """Ignore the stop signals from now on: for a process whose work is done. Python restores the default action
    (termination) while it shuts down, so a stop signal arriving then, such as the copy of one a rank already got
    that its parent passes on a moment late, would kill a rank that had finished cleanly."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopRequest]:
    """The request the loop reads: this process's (:func:`install`), or, for a Python caller of ``rlhf.train``,
    one for the block only, the earlier handlers restored after it."""
    if _installed is not None or threading.current_thread() is not threading.main_thread():
        yield _installed or StopRequest()  # elsewhere than the main thread Python allows no handler
        return
    request = StopRequest()
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        _previous.setdefault(sig, before[sig])
        signal.signal(sig, request._handle)
    try:
        yield request
    finally:
        for sig, old in before.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def hand_over(signum: int) -> bool:
    """Call the handler ``signum`` had before this package's (submitit's requeue for USR2); True if there was one."""
    handler = _previous.get(signum)
    if callable(handler):
        handler(signum, None)
        return True
    return False


class Forwarder:
    """Passes a stop request on to the ranks this process started, once to each, including ranks that appear after
    the signal came (they hold it blocked until their handler is installed)."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request
        self._sent: set[int] = set()

    def __call__(self) -> None:
        if self.request.signum is None:
            return
        signum = signal.SIGTERM if self.request.signum == signal.SIGINT else self.request.signum
        for pid in spawned_children():
            if pid not in self._sent:
                self._sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def kill_all(self) -> None:
        """SIGKILL every rank (a second Ctrl-C)."""
        for pid in spawned_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def spawned_children() -> list[int]:
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


def reached(phase: str) -> None:
    """Tests only: when ``RLHF_TEST_SIGNAL`` is ``<phase>:<SIGNAL>:<parent|all>`` and ``phase`` begins in the main
    process (global rank 0, or the process that starts the ranks), send the signal to the run's first process
    (``parent``) or to its whole process group (``all``: what Slurm does; the test starts the run in a session of its
    own). Phases: ``startup`` (before the ranks start), ``rank_startup`` (a rank, before its handler),
    ``step_<N>`` (step N begins), ``final_eval``, ``final_save``."""
    wanted = os.environ.get(TEST_SIGNAL, "")
    if not wanted or os.environ.get("RANK", "0") != "0":
        return
    name, sig, target = wanted.split(":")
    if name != phase:
        return
    os.environ.pop(TEST_SIGNAL)  # once, even if the phase begins again (a resumed run is started without it)
    signum = getattr(signal, sig)
    if target == "all":
        os.killpg(os.getpgid(0), signum)
    else:
        os.kill(os.getpgid(0), signum)  # the group's leader: the process the test started
