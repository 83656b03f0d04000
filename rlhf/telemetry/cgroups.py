"""The memory a process's cgroups leave it (:func:`cgroup_left`): the smallest headroom over its own memory cgroup
and every ancestor, cgroup v1 or v2, for the memory preflight (:mod:`rlhf.telemetry.memory_preflight`) of a CPU run,
and of a Slurm job whose limit sits on the job's cgroup above the process's leaf."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MB = 2**20


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2's "max": no limit


# Where the cgroups are read (module attributes, so that a test can point them at a fake tree)
PROC_CGROUP = "/proc/self/cgroup"  # the process's cgroup in each hierarchy: "ID:controllers:/path"
CGROUP_ROOT = "/sys/fs/cgroup"  # where the hierarchies are mounted (v2 unified here, v1 controllers below it)
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a huge number (a page-rounded 2**63 - 1)
# The files of a memory cgroup: (limit, usage), cgroup v2 (the unified hierarchy) and v1 (the memory controller's)
V2_FILES = ("memory.max", "memory.current")
V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
# In a cgroup's memory.stat, the page cache not used lately, which the kernel reclaims before it would kill a process
# of the cgroup: left out of its usage (as `docker stats` and the kubelet's working set do). v2's key, then v1's.
RECLAIMABLE_KEYS = ("inactive_file", "total_inactive_file")


def _reclaimable(folder: Path, v1: bool) -> int:
    """The inactive page cache of the cgroup at ``folder`` (its ``memory.stat``), 0 where it cannot be read."""
    key = RECLAIMABLE_KEYS[1 if v1 else 0]
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class CgroupLimit:
    """The tightest memory limit over the cgroups that hold this process: ``left`` bytes (the limit less the
    cgroup's usage, which counts every process below it), in cgroup ``path`` (as ``/proc/self/cgroup`` names it)."""

    left: int
    limit: int
    used: int
    path: str
    file: str

    def describe(self) -> str:
        """Where the figure comes from, for the memory preflight's message (:func:`rlhf.telemetry.memory_preflight.check_fits`): the cgroup, its limit and usage, and where
        it is a Slurm job's (a ``job_N`` or ``slurm`` folder in its path) how to ask for more."""
        slurm = any(part.startswith("job_") or part == "slurm" for part in self.path.split("/"))
        more = "; a Slurm job gets more with hydra.launcher.mem_gb (launcher=slurm) or sbatch --mem" if slurm else ""
        return (f"what the memory limit of cgroup {self.path} leaves: {self.file} {self.limit / MB:,.1f} MB, "
                f"{self.used / MB:,.1f} MB in use{more}")


def cgroup_left(proc: str | None = None, mount: str | None = None) -> CgroupLimit | None:
    """The smallest headroom (limit less usage, the inactive page cache of ``memory.stat`` not counted as used) of
    the memory cgroups that hold this process, cgroup v2 (``memory.max``, ``memory.current``) or v1
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``): its own cgroup
    and each ancestor up to the hierarchy's root, since a limit applies to everything below it. Slurm puts a job's
    limit on the job's and the step's cgroups and runs the process in a leaf without a limit of its own
    (``.../job_N/step_0/user/task_0`` with ``memory.max`` = ``max`` under cgroup v2, an unlimited ``task_0`` under
    v1: https://slurm.schedmd.com/cgroup_v2.html). Where the process's path is not mounted (a container that sees
    its own cgroup as the mount's root) only the root is found. ``proc``, ``mount``: :data:`PROC_CGROUP` and
    :data:`CGROUP_ROOT` unless given. None where no limit can be read."""
    try:
        lines = Path(proc or PROC_CGROUP).read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, files = Path(mount or CGROUP_ROOT), V2_FILES
        elif "memory" in controllers.split(","):  # v1
            root, files = Path(mount or CGROUP_ROOT) / "memory", V1_FILES
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # the process's own cgroup first, the root last
            folder = root.joinpath(*parts[:depth])
            limit, used = (_read_int(folder / name) for name in files)
            if limit is not None and used is not None and limit < NO_LIMIT:
                used = max(0, used - _reclaimable(folder, files is V1_FILES))  # page cache it can drop: not a use
                found.append(CgroupLimit(max(0, limit - used), limit, used, "/" + "/".join(parts[:depth]),
                                         files[0]))
    return min(found, key=lambda limit: limit.left) if found else None
