"""A Slurm job's final state as the accounting database (``sacct``) records it, read only once it is recorded.

Slurm writes its accounting asynchronously: slurmctld sends a job's end to slurmdbd, which stores it a moment later
(seconds on a loaded machine). ``squeue`` no longer listing a job, or a launcher having collected the job's result,
does not mean that ``sacct`` knows it ended: read at once, a requeued job that completed can still show
``REQUEUED, RUNNING``. :func:`final_states` asks ``sacct`` until the last record of every job is a terminal state
(:data:`TERMINAL`), or gives up after ``timeout_s`` with :class:`AccountingLag`, which says what ``sacct`` last
showed and for how long it was asked. Every reader of a job's final state uses it: the tests on a real cluster and
``scripts/ci_slurm.sh``.

The package's own sweeps never need a final state from ``sacct``: submitit's job watcher counts a job whose end is
not recorded yet as running (``PENDING``, ``RUNNING``, ``REQUEUED``, ``COMPLETING``, ``UNKNOWN`` for a job ``sacct``
does not list yet: it waits on), and a job's result file ends the wait before any state is read. A dead point's
reason (:func:`rlhf.launch.sweep_launchers.death_reason`) says "not recorded yet" of a state that is not terminal
(:func:`recorded_end`).

    python -m rlhf.launch.slurm_accounting 1234 1235      # prints JobID|State|Elapsed per record, once all ended
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

# The states of a job that has ended (sacct(1), JOB STATE CODES). PREEMPTED ends a job that is not requeued; a
# requeued one is recorded REQUEUED for the attempt, then the next attempt's PENDING/RUNNING.
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE")
DEFAULT_TIMEOUT_S = 60.0  # how long slurmdbd may lag before a reader fails (seconds)


class AccountingLag(RuntimeError):
    """``sacct`` did not record the end of a job within the wait."""


def state_name(state: str) -> str:
    """The state's code, without what sacct adds after it (``CANCELLED by 0`` -> ``CANCELLED``)."""
    return state.strip().split(" ")[0].upper()


def is_terminal(state: str) -> bool:
    """Whether ``state`` (as sacct or submitit prints it) says the job has ended."""
    return state_name(state) in TERMINAL


def recorded_end(state: str) -> str:
    """A job state for a message: itself when it is terminal, else that the end is not recorded yet."""
    return state if is_terminal(state) else f"its end not recorded by Slurm's accounting yet: {state or 'no record'}"


def sacct_records(jobs: Sequence[str], fields: Sequence[str] = ("JobID", "State", "Elapsed"),
                  every_attempt: bool = True) -> dict[str, list[dict[str, str]]]:
    """Each job's allocation records from one ``sacct`` call, oldest first (``every_attempt``: one per attempt of
    a requeued job, ``-D``), under the id asked for (an array's tasks under the array's id, each record with its
    own ``JobID``, e.g. ``12_0``). Raises :class:`RuntimeError` with sacct's error when it fails."""
    fields = ["JobID", *[f for f in fields if f != "JobID"]]
    command = ["sacct", "-X", "-n", "-P", *(["-D"] if every_attempt else []), "-o", ",".join(fields),
               "-j", ",".join(jobs)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(command)} did not answer within 30 s (slurmdbd busy or down?)") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (is the accounting up? scripts/slurm/start.sh starts it): "
                           f"{done.stderr.strip()}")
    records: dict[str, list[dict[str, str]]] = {job: [] for job in jobs}
    for line in done.stdout.splitlines():
        if line.strip():
            record = dict(zip(fields, line.split("|")))
            records.setdefault(record["JobID"].split("_")[0].split(".")[0], []).append(record)
    return records


def final_states(jobs: Iterable[str], fields: Sequence[str] = ("JobID", "State", "Elapsed"),
                 every_attempt: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = 1.0,
                 read: Callable[..., dict[str, list[dict[str, str]]]] = sacct_records,
                 ) -> dict[str, list[dict[str, str]]]:
    """Each job's records (:func:`sacct_records`) once the last record of every job is in a terminal state. A
    failing ``sacct`` (a busy slurmdbd) is asked again. Raises :class:`AccountingLag` after ``timeout_s`` seconds,
    naming what ``sacct`` last showed (or its last error)."""
    jobs = sorted(set(jobs))
    start = time.monotonic()
    records: dict[str, list[dict[str, str]]] = {}
    error = ""
    while True:
        try:
            records, error = read(jobs, fields=fields, every_attempt=every_attempt), ""
        except RuntimeError as failed:
            error = str(failed)
        waiting = [job for job in jobs if error or not _ended(records.get(job, []))]
        if not waiting:
            return records
        waited = time.monotonic() - start
        if waited >= timeout_s:
            shown = "; ".join(f"{job}: {[r.get('State') for r in records.get(job, [])] or 'no record'}"
                              for job in waiting)
            raise AccountingLag(f"sacct did not record the end of job(s) {', '.join(waiting)} within {waited:.0f} s "
                                f"(asked every {poll_s:g} s); it last showed {shown}"
                                + (f"; its last call failed: {error}" if error else ""))
        time.sleep(min(poll_s, max(0.0, timeout_s - waited)))


def _ended(records: list[dict[str, str]]) -> bool:
    """Whether the last record of each task (of an array) or of the job is terminal; no record: not ended."""
    last = {record["JobID"]: record.get("State", "") for record in records}  # a later attempt replaces an earlier
    return bool(last) and all(is_terminal(state) for state in last.values())


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        records = final_states(argv)
    except (AccountingLag, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for job in sorted(records):
        for record in records[job]:
            print("|".join(record.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
