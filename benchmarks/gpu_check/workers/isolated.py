"""A function of the GPU check run in a process of its own, so that what it does to the device cannot take the rest
of the call down: a sticky CUDA error (an illegal address, a broken graph capture) ends with its process, a crash in
a compiler (Triton, LLVM) kills its process, not the coordinator, and a hang is stopped at its timeout.

    python -m gpu_check.workers.isolated     # reads {"call": "module:function", "args": [...]} on stdin

The child (started by :class:`Call`, with ``benchmarks/`` and the repository root on its path: :func:`child_env`)
imports ``module`` (``bench``, ``gpu_check.sections.probes``, ...), calls ``function(*args)`` and prints its JSON
result on one line ``@gpu_check {"result": ...}`` (``{"error": ...}`` where it raised, or where torch's compiler hit
its recompile limit during the call: :mod:`gpu_check.recompiles`); whatever else is printed goes to the same
stream, around it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from gpu_check.recompiles import RecompileWatch

BENCHMARKS = Path(__file__).resolve().parents[2]  # benchmarks/: the package gpu_check and bench.py
ROOT = BENCHMARKS.parent
REPLY = "@gpu_check "  # the marker of a reply (as gpu_check.workers.worker's)


def child_env(base: dict[str, str] | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) and ``env`` over it, with ``benchmarks/`` and the repository
    root first on ``PYTHONPATH``: a child started with ``python -m gpu_check...`` imports the package, ``bench`` and
    ``rlhf`` from this checkout."""
    merged = {**(os.environ if base is None else base), **(env or {})}
    path = merged.get("PYTHONPATH")
    merged["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS), str(ROOT), *([path] if path else [])])
    return merged


class IsolatedFailed(RuntimeError):
    """The isolated call raised, crashed or passed its timeout; the message says which, with its last lines."""


def reply_at(line: str) -> tuple[int, dict | None]:
    """Where a reply starts on ``line`` (anywhere: a DataLoader's or a compiler's child may share the stream and
    leave a partial line before it) and the reply, or ``(-1, None)`` where the line holds none that parses."""
    at = line.find(REPLY)
    if at < 0:
        return -1, None
    try:
        answer = json.loads(line[at + len(REPLY):])
    except json.JSONDecodeError:
        return -1, None
    return (at, answer) if isinstance(answer, dict) else (-1, None)


def reply_in(output: str) -> dict | None:
    """The last reply in ``output``, or ``None``."""
    for line in reversed(output.splitlines()):
        at, answer = reply_at(line)
        if answer is not None:
            return answer
    return None


def _tail(output: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-lines:])[-600:]


class Call:
    """``target`` (``"module:function"``) with ``args`` started now in its own process; :meth:`result` waits."""

    def __init__(self, target: str, args: list, env: dict[str, str] | None = None) -> None:
        self.target, self.started = target, time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "gpu_check.workers.isolated"], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=child_env(env=env), start_new_session=True)
        self.command = json.dumps({"call": target, "args": args})

    def result(self, timeout_s: float):
        """The function's result (JSON: tuples come back as lists); :class:`IsolatedFailed` where it raised, its
        process ended without a reply, or ``timeout_s`` passed (its process group killed)."""
        try:
            output, _ = self.process.communicate(self.command, timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.kill()
            output, _ = self.process.communicate()
            answer = reply_in(output)
            if answer is not None and "result" in answer:  # answered, then stuck in its exit
                return answer["result"]
            print(output[-4000:], flush=True)
            raise IsolatedFailed(f"{self.target} passed its {timeout_s:.0f} s: stopped ({_tail(output)})") from None
        answer = reply_in(output)
        if answer is None or "error" in answer:
            print(output[-4000:], flush=True)  # into the call's log
            if answer is None:
                raise IsolatedFailed(f"{self.target} ended without a result (exit {self.process.returncode}): "
                                     f"{_tail(output)}")
            raise IsolatedFailed(answer["error"])
        return answer["result"]

    def kill(self) -> None:
        """Its process group (a compiler's workers too), at once."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.process.kill()


def call(target: str, args: list, timeout_s: float, env: dict[str, str] | None = None):
    """``target(*args)`` in a process of its own: its result, or :class:`IsolatedFailed`."""
    return Call(target, args, env).result(timeout_s)


def main() -> int:
    command = json.loads(sys.stdin.read())
    module, name = command["call"].split(":")
    try:
        with RecompileWatch(command["call"]):  # a call that ran eagerly past the limit has not checked its path
            result = getattr(importlib.import_module(module), name)(*command["args"])
        message = {"result": result}
    except Exception as error:  # noqa: BLE001  (the parent records it)
        traceback.print_exc()
        lines = f"{type(error).__name__}: {error}".strip().splitlines()
        message = {"error": (lines[-1] if lines else type(error).__name__)[:300]}
    sys.stdout.flush()
    sys.stdout.write("\n" + REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()
    os._exit(0)  # not the interpreter's exit: a compiler's workers or a broken CUDA context can hang it


if __name__ == "__main__":
    sys.exit(main())
