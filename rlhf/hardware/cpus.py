"""The CPUs a job may use, and those other work keeps busy: what the hardware strategies size their threads by."""

from __future__ import annotations

import os
import time

# Set by the launching process for the ranks it starts: why their thread count (OMP_NUM_THREADS) is what it is.
THREADS_WHY = "RLHF_THREADS_WHY"


def cpus_available() -> int:
    """CPUs this job may use: Slurm's allocation inside a Slurm job (not the node's), else this process's
    CPU affinity."""
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy_cpus(window_s: float = 0.15) -> float | None:
    """How many of this process's CPUs are busy now, with any process's work: each one's non-idle share of the
    time over ``window_s`` seconds (``/proc/stat``; this process sleeps meanwhile), summed. None where that file is
    not there (not Linux)."""
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:
        return None

    def read() -> dict[int, tuple[int, int]]:
        times = {}
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in mine:
                    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    times[int(name[3:])] = (values[3] + values[4], sum(values))
        return times

    try:
        before = read()
        time.sleep(window_s)
        after = read()
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
