"""The machine's load over a run's life: at each log window, how many CPUs were busy with work other than the run's
(``perf/busy_cpus_other``), so that a report can say where the runs it compares ran beside different loads and their
speeds compare the machine as much as the settings (:mod:`rlhf.sweeps.caveats`).

Read without sleeping, from counters the kernel keeps: the busy time of each CPU this process may use
(``/proc/stat``) and the CPU time of the run itself (``/proc/self/stat``: every thread of this process, its live
worker processes, such as the data loader's, and those that ended), both since the last window. Other work = busy
CPUs − the run's own CPUs, over the window's wall time (its evaluations and checkpoints included). Under several
processes each measures its own CPU time, the sum over the processes of the main process's machine is taken
(assuming every machine runs as many: ``LOCAL_WORLD_SIZE``), and the machine's busy CPUs are the main process's
view: other machines' loads are not measured. Without ``/proc`` (not Linux) nothing is measured and nothing logged.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import time

from rlhf.hardware.cpus import cpu_ticks

OTHER = "perf/busy_cpus_other"  # CPUs busy with work other than the run's, mean over a log window
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # the unit of /proc's CPU times


def affinity() -> set[int] | None:
    """The CPUs this process may run on; None where the system does not say (not Linux)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return None


def busy_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, all) clock ticks of ``cpus`` since the machine started, summed (``/proc/stat``: busy is everything
    but idle and I/O wait); None without the file."""
    try:
        ticks = cpu_ticks(cpus)
    except (OSError, ValueError, IndexError):
        return None
    return sum(total - idle for idle, total in ticks.values()), sum(total for _, total in ticks.values())


def process_ticks(pid: int | str = "self") -> int | None:
    """The CPU time of process ``pid`` in clock ticks: user and system, of every thread, and of its children that
    ended (``/proc/<pid>/stat``); None where it cannot be read (a process that just ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return sum(int(v) for v in fields[11:15])  # utime stime cutime cstime (fields 14 to 17 of proc(5))
    except (OSError, ValueError, IndexError):
        return None


def own_ticks() -> int | None:
    """The CPU time of this process and of its live worker processes (the data loader's), in clock ticks."""
    mine = process_ticks()
    if mine is None:
        return None
    return mine + sum(process_ticks(child.pid) or 0 for child in multiprocessing.active_children())


class LoadMeter:
    """Reads, at each :meth:`window`, the busy CPUs and the run's own CPU use since the previous call (or since it
    was made), and keeps what :meth:`add` is given for :meth:`summary`. Cheap: two small files read, no sleep."""

    def __init__(self) -> None:
        mine = affinity()
        self.cpus: int | None = len(mine) if mine else None  # the CPUs it measures: those this process may use
        self._mine = mine or set()
        self._last = self._read() if mine else None
        self.values: list[float] = []  # other work's busy CPUs of each window this process measured

    def _read(self) -> tuple[tuple[int, int], int, float] | None:
        machine, own = busy_ticks(self._mine), own_ticks()
        return None if machine is None or own is None else (machine, own, time.monotonic())

    @property
    def measures(self) -> bool:
        """Whether it measures anything here (Linux): the same on every process of a run."""
        return self._last is not None

    def window(self) -> tuple[float, float]:
        """(busy CPUs, CPUs the run's own work here used) since the previous call: each the mean number over the
        window's wall time; NaN both where a file could not be read this time."""
        now = self._read()
        last, self._last = self._last, now or self._last
        if now is None or last is None or now[2] <= last[2] or now[0][1] <= last[0][1]:
            return math.nan, math.nan
        (busy, total), own, at = now
        (busy_0, total_0), own_0, at_0 = last
        busy_cpus = (busy - busy_0) / (total - total_0) * len(self._mine)
        return busy_cpus, (own - own_0) / TICKS_PER_S / (at - at_0)

    def add(self, busy: float, own: float) -> float:
        """Other work's busy CPUs from the machine's ``busy`` CPUs and the run's ``own`` (every process's on this
        machine), kept for :meth:`summary`; never below 0 nor above the CPUs (clock ticks round both)."""
        other = min(max(busy - own, 0.0), float(self.cpus or 0))
        self.values.append(other)
        return other

    def summary(self) -> dict[str, float | int] | None:
        """What ``summary.json`` keeps as ``load``: other work's busy CPUs over the windows (``min``, ``median``,
        ``max``), their count and the CPUs measured; None where nothing was measured."""
        return summarise(self.values, self.cpus)


def summarise(values: list[float], cpus: int | None) -> dict[str, float | int] | None:
    """``{"busy_cpus_other": {"min", "median", "max"}, "windows": n, "cpus": cpus}`` of the windows' ``values``;
    None for none."""
    if not values:
        return None
    return {"busy_cpus_other": {"min": min(values), "median": statistics.median(values), "max": max(values)},
            "windows": len(values), "cpus": cpus}


def local_share(processes: int) -> float:
    """The share of a run's ``processes`` on one machine (``LOCAL_WORLD_SIZE``, set by torch's launchers): the
    run's CPU use summed over every process, times this, is the use on the main process's machine."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return min(int(local), processes) / processes if local.isdigit() and int(local) > 0 else 1.0
