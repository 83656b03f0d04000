"""The GPU check's long-lived workers and their turns: one process per side (ours, TRL, TRL with its best options; a
lever's second run of ours), started once at the beginning of a call (:mod:`gpu_check.workers.worker`), and the
order in which a pair's sides are timed.

A pair builds each side in its worker (warm-up steps untimed), then gives the turns ours, TRL, TRL's best, ours, ...
(:func:`turns`): each turn one timed window whose ends wait for the device; each side keeps its run between its
turns, and drops it after the pair. Where the sides do not fit on the device together (``blocks``) each side runs
all its windows (and its profile) and drops its run before the next side is built. Every answer is awaited for its
op's own time (:func:`gpu_check.sections.speed.op_timeouts`) and never past the call's deadline, after which nothing
is sent; a side that fails or passes its time is stopped (its worker killed, started again for the next pair) and
its column says why; ours or TRL's failing ends the pair at once. A side whose answer says torch's compiler hit its
recompile limit (:mod:`gpu_check.recompiles`) fails likewise: past it, its compiled paths ran eagerly. The workers'
output goes to one ``workers.log``.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check.recompiles import message
from gpu_check.workers.isolated import ROOT, child_env, reply_at

SIDES = ("ours", "trl", "trl_best")  # the order of a round
KINDS = {"ours": "ours", "lever": "ours", "trl": "trl", "trl_best": "trl"}  # the worker each side runs in
# Both sides' allocator: segments that grow rather than fragment (a 1B pair near the device's memory), unless set.
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
OPTIONAL = {"trl_best"}  # a side whose failure leaves the pair's row (its column says why); the others end the pair


class SideFailed(RuntimeError):
    """A side's worker answered with an error, exited, or passed the deadline."""


class Worker:
    """One worker process (``kind``: ``ours`` or ``trl``), its output appended to ``log`` (one file for every
    worker of a call, each line after ``[name]``) and the last lines kept in memory for an error's message;
    ``env``: variables over the check's (e.g. ``CUDA_LAUNCH_BLOCKING=1``)."""

    def __init__(self, kind: str, threads: int, log: Path, env: dict[str, str] | None = None,
                 name: str | None = None) -> None:
        self.kind, self.answers, self.tail = kind, queue.Queue(), collections.deque(maxlen=30)
        self.prefix = f"[{name or kind}] "
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("a", buffering=1)  # a line at a time: the workers share the file
        self.process = subprocess.Popen([sys.executable, "-m", "gpu_check.workers.worker", kind], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1,
                                        env=child_env(bench._env(threads), {**ALLOCATOR, **(env or {})}))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                at, answer = reply_at(line)
                if answer is not None:
                    if at:
                        self.log.write(self.prefix + line[:at] + "\n")
                    self.answers.put(answer)
                else:
                    self.log.write(self.prefix + line)
                    self.tail.append(line.rstrip())
        except Exception as error:  # noqa: BLE001  (a reader that stops must still say so: the ask waits on it)
            self.tail.append(f"the reader of the worker's output stopped: {error!r}")
        self.answers.put(None)  # the process ended

    def ask(self, command: dict, deadline: float) -> dict:
        """Send ``command``; its answer, awaited until ``deadline`` (``time.perf_counter()``): past it the worker is
        killed (nothing is sent once it has passed)."""
        if deadline <= time.perf_counter():
            self.kill()
            raise SideFailed(f"{command['op']}: the time it had was spent before it started: not run")
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise SideFailed(f"the {self.kind} worker is gone ({error}): {' | '.join(list(self.tail)[-3:])}") from error
        try:
            answer = self.answers.get(timeout=max(0.1, deadline - time.perf_counter()))
        except queue.Empty:
            self.kill()
            raise SideFailed(f"{command['op']} passed its time (its timeout or the call's deadline): stopped") from None
        if answer is None:
            raise SideFailed(f"the {self.kind} worker exited: {' | '.join(list(self.tail)[-3:])}")
        if "error" in answer:
            raise SideFailed(answer["error"].strip().splitlines()[-1][:300] if answer["error"].strip() else "error")
        if answer.get("recompile_limit"):
            raise SideFailed(message(f"{self.prefix.strip()} {command['op']}", answer["recompile_limit"]))
        return answer

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU's driver): left behind, not waited for
            pass
        if not self.log.closed:
            self.log.close()

    def close(self, deadline: float | None = None) -> None:
        """Ask it to quit (5 s), and kill it where it does not; past ``deadline``, kill it at once."""
        if deadline is None or time.perf_counter() < deadline:
            try:
                self.ask({"op": "quit"}, time.perf_counter() + 5.0)
                self.process.wait(timeout=5)
            except (SideFailed, subprocess.TimeoutExpired):
                pass
        self.kill()


class Pool:
    """The workers of a call by side, each started on first use (or again after a failure)."""

    def __init__(self, threads: int, logs: Path) -> None:
        self.threads, self.logs, self.workers = threads, logs, {}

    def start(self, sides) -> None:
        """Start these sides' workers now (their imports run side by side)."""
        for side in sides:
            self.get(side)

    def get(self, side: str) -> Worker:
        worker = self.workers.get(side)
        if worker is None or worker.process.poll() is not None:
            worker = self.workers[side] = Worker(KINDS[side], self.threads, self.logs / "workers.log", name=side)
        return worker

    def drop(self, side: str) -> None:
        worker = self.workers.pop(side, None)
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Every worker asked to quit, in 10 s at most together (past the call's deadline: killed at once)."""
        deadline = time.perf_counter() + 10.0
        if bench.DEADLINE is not None:
            deadline = min(deadline, bench.DEADLINE)
        for side in list(self.workers):
            self.workers.pop(side).close(deadline)


def turns(sides: list[str], rounds: int, blocks: bool = False) -> list[tuple[int, str]]:
    """``(round, side)`` in the order they are timed: by turns (``ours, trl, trl_best, ours, ...``), or with
    ``blocks`` every round of one side before the next side's."""
    if blocks:
        return [(k, side) for side in sides for k in range(rounds)]
    return [(k, side) for k in range(rounds) for side in sides]


def pair_runs(specs: dict[str, dict], rounds: int, steps: int, warmup: int, pool, deadline: float,
              blocks: bool = False, profile: dict[str, Path] | None = None, on_turn=None,
              timeouts: dict[str, float] | None = None) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Each side of ``specs`` (side -> its worker's build spec) built, then timed by :func:`turns`: ``rounds``
    windows of ``steps`` steps each after ``warmup`` untimed ones; ``profile`` (side -> folder): those sides' steps
    under the profiler after the rounds; ``on_turn(runs, failed)`` after every turn (the report saves what exists);
    ``timeouts``: seconds each op may take (by ``op``; never past ``deadline``).
    Return each side's windows and, for each side that failed, why (its later turns are left out). A required
    side failing (any but ``trl_best``: the pair has no row without it) ends the pair at once: no more turns, no
    profile, the other sides freed."""
    runs: dict[str, list[dict]] = {side: [] for side in specs}
    failed: dict[str, str] = {}
    built: dict[str, bool] = {}  # the sides built now, in the order built

    def attempt(side: str, command: dict) -> dict | None:
        limit = deadline if timeouts is None else min(deadline, time.perf_counter() + timeouts.get(command["op"], 1e9))
        try:
            return pool.get(side).ask(command, limit)
        except SideFailed as error:
            failed[side] = str(error)
            built.pop(side, None)
            pool.drop(side)
            return None

    def build(side: str) -> None:
        if attempt(side, {"op": "build", "side": KINDS[side], "spec": specs[side], "warmup": warmup}) is not None:
            built[side] = True

    def profiled(side: str, folder: Path) -> None:
        if attempt(side, {"op": "profile", "steps": bench.PROFILED_STEPS, "to": str(folder)}) is None:
            failed[f"{side} profile"] = failed.pop(side)

    def aborted() -> bool:
        return any(side in failed for side in specs if side not in OPTIONAL)

    if not blocks:
        for side in specs:
            if not aborted():
                build(side)
    order = turns(list(specs), rounds, blocks)
    for k, side in order:
        if aborted():
            break
        if side in failed:
            continue
        if side not in built:
            build(side)
            if side in failed:
                continue
        window = attempt(side, {"op": "run", "steps": steps})
        if window is not None:
            runs[side].append(window)
        if on_turn is not None:
            on_turn(runs, failed)
        if blocks and k == rounds - 1 and side in built:  # its profile now, then its run dropped before the next
            if profile and side in profile and not aborted():
                profiled(side, profile[side])
            if side in built:
                attempt(side, {"op": "free"})
                built.pop(side, None)
    for side, folder in (profile or {}).items():
        if side in built and not aborted():
            profiled(side, folder)
    for side in list(built):
        attempt(side, {"op": "free"})
    return runs, failed
