"""The CPUs a job may use, and those other work keeps busy: what the hardware strategies size their threads by."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

# Set by the launching process for the ranks it starts: why their thread count (OMP_NUM_THREADS) is what it is.
THREADS_WHY = "RLHF_THREADS_WHY"
SWEEP_LOAD = "busy_cpus.json"  # in a sweep's folder: the load its first point measured, which every point shares out


def cpus_available() -> int:
    """CPUs this job may use: Slurm's allocation inside a Slurm job (not the node's), else this process's
    CPU affinity."""
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_ticks(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(idle, all) clock ticks of each of ``cpus`` since the machine started (``/proc/stat``: idle counts I/O wait
    too). Raises OSError without the file."""
    times = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[int(name[3:])] = (values[3] + values[4], sum(values))
    return times


def busy_cpus(window_s: float = 0.15) -> float | None:
    """How many of this process's CPUs are busy now, with any process's work: each one's non-idle share of the
    time over ``window_s`` seconds (``/proc/stat``; this process sleeps meanwhile), summed. None where that file is
    not there (not Linux)."""
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:
        return None

    try:
        before = cpu_ticks(mine)
        time.sleep(window_s)
        after = cpu_ticks(mine)
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for cpu, (idle, total) in after.items():
        idle_before, total_before = before.get(cpu, (idle, total))
        if total > total_before:
            busy += 1.0 - (idle - idle_before) / (total - total_before)
    return busy


def threads_beside(busy: float, cpus: int, local_processes: int) -> int:
    """Torch threads a process for ``local_processes`` processes on ``cpus`` CPUs of which other work keeps ``busy``
    busy: the idle ones shared out (at least one each). Threads that spin against other work for a core are far
    slower than fewer threads (measured: 8.5x on 2 busy cores, docs/threads/2026-11-27-busy-machine.md)."""
    idle = cpus - round(busy)
    return max(1, min(cpus, idle) // max(1, local_processes))


def choose_threads(threads_per_process: int | None, local_processes: int, resumed: int | None = None,
                   busy: float | Callable[[], float | None] | None = None, follow_load: bool = True) -> tuple[int, str]:
    """(torch threads per process, why: for the start-up line). In order: ``threads_per_process``; else
    ``OMP_NUM_THREADS``; else ``resumed``, the count of the bf16 run a resume continues (in bf16 on a CPU the thread
    count changes the numbers: docs/threads/2026-11-28-same-numbers.md); else the job's CPUs shared out between its
    ``local_processes``, leaving out those other work keeps busy (``follow_load``; not for bf16 on a CPU, where the
    same command must give the same numbers whatever the load: there the load only adds a word to the line):
    ``busy`` when given (a sweep's one measurement, :func:`sweep_load`, or what reads it: called only where needed),
    else measured as the run starts (never inside a Slurm job, whose CPUs are its own)."""
    if threads_per_process is not None:
        return threads_per_process, ""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), os.environ.get(THREADS_WHY, "")
    total = cpus_available()
    even = max(1, total // max(1, local_processes))
    if resumed is not None:
        over = (f"; more than the {total} CPU(s) here give each process: slower, the same numbers. To change it: "
                f"hardware.threads_per_process={even} resume_changes=[hardware.threads_per_process]"
                if resumed > even else "; hardware.threads_per_process sets it")
        return resumed, f" (the count of the bf16 run this resume continues, whose numbers depend on it{over})"
    when = "as the sweep's first point started" if busy is not None else "as the run started"
    if callable(busy):
        busy = busy()
    if busy is None and not os.environ.get("SLURM_JOB_ID"):
        busy = busy_cpus()
    if busy is None or threads_beside(busy, total, local_processes) >= even:
        return even, ""
    chosen = threads_beside(busy, total, local_processes)
    if not follow_load:  # bf16 on a CPU: the count that an idle machine gives, so that the numbers repeat
        return even, (f" ({busy:.1f} of the {total} CPUs were busy with other work {when}, but bf16 results on a "
                      f"CPU depend on the thread count, so the run keeps {even}, as on an idle machine: slower here. "
                      f"Faster, with numbers of its own: hardware.threads_per_process={chosen})")
    return chosen, (f" ({busy:.1f} of the {total} CPUs were busy with other work {when}: {chosen} "
                    f"thread(s) a process, not {even}; hardware.threads_per_process sets it)")


def oversubscribed(threads: int, local_processes: int, threads_per_process: int | None) -> str | None:
    """The start-up warning for more threads on this machine than the job's CPUs (``threads`` a process x
    ``local_processes``), naming what set the count and the fix; None when they fit. A count this module chose never
    exceeds the CPUs but where there are more processes than CPUs; a resumed bf16 run's count says so in its own line
    (:func:`choose_threads`)."""
    cpus, local = cpus_available(), max(1, local_processes)
    if threads * local <= cpus:
        return None
    fits = max(1, cpus // local)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if local > cpus and threads <= fits:  # one thread each is already the fewest: the processes are too many
        cause, fix = f"{local} processes", f"at most {cpus} process(es) on this machine (hardware.num_processes={cpus})"
    elif threads_per_process is not None:
        cause, fix = (f"hardware.threads_per_process={threads_per_process}",
                      f"hardware.threads_per_process={fits}, or null: the CPUs shared out")
    elif omp.isdigit() and int(omp) == threads and threads > 1 and not os.environ.get(THREADS_WHY):
        cause, fix = f"OMP_NUM_THREADS={omp}", f"OMP_NUM_THREADS={fits}, or unset it: the CPUs shared out"
    elif threads == 1:
        cause, fix = f"{local} processes", f"at most {cpus} process(es) on this machine (hardware.num_processes={cpus})"
    else:
        return None
    # Measured: docs/threads/2026-11-27-busy-machine.md (2 threads a process against other work on 2 CPUs: 331.6 s
    # against 39.1 s with 1 thread); the same within one run (the project's scale findings of 2026-11-22): 2 processes
    # x 2 threads on 2 CPUs took 1.5-2.2 s a DPO step against 0.15-0.23 s with 1 thread each.
    return (f"{local} process(es) x {threads} thread(s) = {threads * local} threads on {cpus} CPU(s) ({cause}): "
            f"threads beyond the CPUs wait for each other, and steps get several times slower (measured 8.5x with "
            f"2 threads a process on 2 CPUs that other work kept busy: docs/threads/2026-11-27-busy-machine.md). "
            f"Fix: {fix}")


def sweep_load(folder: Path) -> float | None:
    """The busy CPUs (:func:`busy_cpus`) that the first point of the sweep in ``folder`` measured as it started,
    kept in ``folder/busy_cpus.json``; measured now and kept there by the point that finds no such file. Every point
    shares its CPUs out by this one load, so that points of the same hardware use the same thread count whatever the
    machine was doing as each began (and their speeds compare). None inside a Slurm job, whose CPUs are its
    own, and where the load cannot be read. A file that cannot be read (edited by hand) leaves each point its own
    measurement."""
    if os.environ.get("SLURM_JOB_ID"):
        return None
    file = Path(folder) / SWEEP_LOAD
    for _attempt in range(2):
        for _ in range(50):  # a point that started at the same moment may be writing it
            try:
                return float(json.loads(file.read_text())["busy_cpus"])
            except FileNotFoundError:
                break
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.02)
        else:
            return busy_cpus()  # there, but never readable
        busy = busy_cpus()
        if busy is None:  # not Linux: nothing to share
            return None
        draft = file.with_name(f".{SWEEP_LOAD}.{os.getpid()}")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            draft.write_text(json.dumps({"busy_cpus": busy}))
            os.link(draft, file)  # atomic, and refused where another point got there first: then its value counts
            return busy
        except FileExistsError:
            continue
        except OSError:  # a full disk, a file system without links: the point's own measurement
            return busy
        finally:
            draft.unlink(missing_ok=True)
    return busy_cpus()
