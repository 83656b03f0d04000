"""The GPU check's bookkeeping (``benchmarks/gpu_check.py``): the sections, the report written after every addition,
and the time budget that decides what still starts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench

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
    started later may run until then, and the workers' answers are awaited until then (``gpu_check_turns``)."""

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
