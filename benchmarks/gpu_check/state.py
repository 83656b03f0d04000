"""The GPU check's bookkeeping: its device calls, the sections, the report written after every addition, the time
budget that decides what still starts, and the call's settings that every section reads (:data:`THREADS`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench

THREADS = [1]  # torch threads of each process the check starts (set by gpu_check.main from --threads)


def threads() -> int:
    return THREADS[0]


def last_line(error: BaseException) -> str:
    """An error's last line, for a table cell (its type where it has no message)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1][:200]}" if lines else type(error).__name__


GRACE_S = 30  # seconds past --budget-s after which a run still going is stopped
# (what, command, the device call's timeout_s), printed at the end; carry [".whl"]. timeout_s: the budget, GRACE_S and
# 60 s for the start of the command and the page. The headline first; the rest takes what the session's device time
# leaves after it (``rest_call``: status's budget_left_s), and runs only where that is at least REST_MIN_LEFT_S (no
# machine starts with less than 4 minutes left; an idle machine is given back, and a fresh start costs minutes).
# The rest's budget cannot hold all of it: it runs its sections in order while they fit (correctness, paths, resume
# first) and names on its page what it left out (short rows, levers, memory: a later session's call with
# --skip losses,layouts,paths,resume); the headline's LATER pairs likewise (--part headline --pairs ...).
DEVICE_CALLS = [
    ("the headline: real lengths against TRL and TRL's best, by turns in long-lived workers, the profile",
     "bash benchmarks/gpu_check.sh --part headline --budget-s 460", 550),
    ("the rest: correctness, single-GPU paths, resume, kernels, launch-overhead rows, levers, memory; right after "
     "the headline, only if status's budget_left_s >= 240: --budget-s budget_left_s - 120, timeout_s "
     "budget_left_s - 30", "bash benchmarks/gpu_check.sh --part rest --budget-s <budget_left_s - 120>", None)]
REST_MIN_LEFT_S = 240  # device seconds left, at least, for the rest's call
REST_KEPT_S = 30  # of what is left: the command's start and the return of its files


def rest_call(budget_left_s: float) -> tuple[str, int] | None:
    """The rest's command and its device call's timeout_s where ``budget_left_s`` (status's) allows it, else None:
    its budget leaves the grace, a minute for its start and the page, and :data:`REST_KEPT_S`."""
    if budget_left_s < REST_MIN_LEFT_S:
        return None
    timeout = int(budget_left_s) - REST_KEPT_S
    return f"bash benchmarks/gpu_check.sh --part rest --budget-s {timeout - GRACE_S - 60}", timeout


def device_commands() -> str:
    return "\n".join(f"device call {k + 1} ({what}): carry [\".whl\"], timeout_s {limit or 'as said'}: {command}"
                     for k, (what, command, limit) in enumerate(DEVICE_CALLS))


SECTIONS = ("losses", "layouts", "paths", "resume", "kernels", "speed", "profile", "levers", "memory")


def skipped_sections(text: str) -> frozenset[str]:
    """``--skip``'s value: section names, comma-separated, each one of :data:`SECTIONS`."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; the sections are "
                                         f"{', '.join(SECTIONS)}")
    return names


class Report:
    """What the check found, kept in ``<out>/gpu_check.json`` after every addition."""

    def __init__(self, out: Path, header: dict) -> None:
        self.out, self.data = out, {"header": header, "correctness": [], "checkpoint": None, "speed": [],
                                    "levers": [], "kernels": [], "skipped": [], "profile": None,
                                    "partial": []}
        self.save()

    def add(self, section: str, item) -> None:
        if isinstance(self.data[section], list):
            self.data[section].append(item)
        else:
            self.data[section] = item
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1))


class SectionBudget:
    """Seconds since ``started`` against ``budget_s``: :meth:`fits` says whether work expected to take
    ``estimate_s`` ends within it (always, where not ``enforced``: the rehearsal runs everything); the call's
    :meth:`deadline` is ``grace_s`` past the budget (``bench.DEADLINE`` where ``enforced``): a process of its own
    started later may run until then, and the workers' answers are awaited until then
    (:mod:`gpu_check.workers.turns`)."""

    def __init__(self, started: float, budget_s: float, grace_s: float, enforced: bool = True) -> None:
        self.started, self.budget_s, self.grace_s, self.enforced = started, budget_s, grace_s, enforced
        bench.DEADLINE = self.deadline() if enforced else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def deadline(self) -> float:
        """``time.perf_counter()`` at which work still going is stopped (``grace_s`` past the budget)."""
        return self.started + self.budget_s + self.grace_s

    def fits(self, estimate_s: float) -> bool:
        return not self.enforced or self.elapsed() + estimate_s <= self.budget_s

    def note(self, message: str) -> None:
        print(f"[{self.elapsed():4.0f} s] {message}", flush=True)
