"""What a submitit job (``launcher=slurm``, ``launcher=submitit_local``) runs: a stop signal is honoured from its first statement.

A job is a Python process that submitit starts as ``python -u -m submitit.core._submit <folder>``. It imports submitit,
unpickles what the launcher submitted and only then installs submitit's handlers (USR2: requeue; SIGTERM: logged and
ignored); the run installs its own when it begins (:mod:`rlhf.run.signals`). Before this module, the pickle was
Hydra's launcher with ``train.py``'s task function, whose loading imports the package, torch and transformers:
submitit's handlers came 4.5-9 s after the job's Python started (a loaded 2-core machine). Slurm's warning (USR2,
before a time limit or a preemption) in that window killed the job (``srun: error: ... task 0: User defined signal
2``, state FAILED), where it should have been requeued. Now:

- the job's Python holds the stop signals (USR2, SIGTERM) from its first statement: the executor's ``python`` command
  (:func:`python_command`) blocks them, then runs the module submitit named;
- what the job unpickles is a :class:`DeferredCall`, pickled by value: loading it imports nothing, so submitit's
  handlers are up as soon as submitit itself is imported (0.2-0.5 s after Python starts, the same machine). The launcher
  and its arguments travel inside it as bytes, loaded when the call begins;
- the call begins by letting USR2 through: one held since the start reaches submitit's handler now, which requeues the
  job (there is nothing to save yet), and one during the rest of the start-up reaches it at once. SIGTERM stays held
  until the run's own handler is installed (``train.py`` unblocks the stop signals there), which stops the run before
  its first step, instead of submitit's handler, which would drop it. Whatever the task, both are let through when
  the call ends.

``checkpoint`` (what submitit calls before a requeue) resubmits the same call, as Hydra's launcher does.
"""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

HELD = (signal.SIGUSR2, signal.SIGTERM)  # a Slurm job's stop signals: the warning before its end, then the end

# The first statements of the job's Python. submitit appends "-u -m submitit.core._submit <folder>"; the statements
# block HELD (the mask holds in every thread started later, numpy's and torch's included), then run that module with
# those arguments, as `python -m` would.
_FIRST = ('"rlhf/launch/submitit_job.py: the stop signals are held until handled"; import signal; '
          "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR2, signal.SIGTERM)); import runpy, sys; "
          'sys.argv = sys.argv[sys.argv.index("-m") + 1:]; runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)')


def python_command() -> str:
    """The ``python`` of submitit's executors for a job: this Python, unbuffered (as submitit starts it), with the
    stop signals held from the first statement."""
    return f"{shlex.quote(sys.executable)} -u -c {shlex.quote(_FIRST)}"


class DeferredCall:
    """The function submitit pickles for each job: light to load (this class travels by value, and imports nothing
    when loaded); the launcher and its arguments are cloudpickled bytes, loaded when the call begins."""

    def __call__(self, call: bytes) -> Any:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGUSR2,))  # submitit's handler is up: a warning goes to it
        try:
            import cloudpickle  # submitit's own pickler, imported already

            function, args = cloudpickle.loads(call)
            return function(*args)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)

    def checkpoint(self, call: bytes) -> Any:
        """Before a requeue: the same call again (Hydra's launcher resubmits its call with the same arguments)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, call)


def deferred(function: Callable, arguments: Sequence[Sequence[Any]]) -> tuple[DeferredCall, list[bytes]]:
    """For ``executor.map_array(function, *arguments)``: the call and the list of arguments to submit instead (one
    job each, as before)."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # a job cannot import rlhf before its handlers
    return DeferredCall(), [cloudpickle.dumps((function, args)) for args in zip(*arguments)]
