"""Seconds of the same short run with the threads `hardware` picks by itself and with every CPU's worth of threads,
on this machine as it is and with other work keeping its CPUs busy.

    python benchmarks/threads_under_load.py                  # 60 steps of the default (DPO), idle and loaded
    python benchmarks/threads_under_load.py --steps 30 algo=sft

For each load (none; then one busy process per CPU, each spinning a pure-Python loop, started before the run and
stopped after it), two runs one after the other: `hardware.threads_per_process=null` (the default: the CPUs shared
out, those busy with other work left out, as the start-up line says) and `hardware.threads_per_process=<CPUs>`
(what the default was before it looked at the load). Printed: the threads each run used (from its start-up line) and
its wall time from start to exit. On a machine busy with work of its own, the "idle" rows are loaded too: the
machine's load average is printed beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf.hardware.base import cpus_available  # noqa: E402


def spin() -> None:
    while True:
        pass


def one_run(steps: int, threads: str, overrides: list[str], folder: Path) -> tuple[float, str]:
    """(seconds, threads the run's start-up line reports) of one run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, str(ROOT / "train.py"), f"train.max_steps={steps}", f"hydra.run.dir={folder}",
               f"hardware.threads_per_process={threads}", *overrides]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit("the run failed:\n" + out.stderr[-3000:])
    used = re.search(r"(\d+) thread\(s\) each", out.stderr)
    return seconds, used.group(1) if used else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    cpus = cpus_available()
    print(f"{cpus} CPU(s); {args.steps} steps; overrides: {' '.join(args.overrides) or 'none'}")
    print("| load | threads_per_process | threads used | wall s | load average before |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        one_run(1, "null", args.overrides, Path(tmp) / "warmup")  # builds the warm start and the data's cache
        for load in ("idle", f"{cpus} busy process(es)"):
            spinners = [] if load == "idle" else [multiprocessing.Process(target=spin, daemon=True) for _ in range(cpus)]
            for spinner in spinners:
                spinner.start()
            time.sleep(2.0 if spinners else 0.0)
            try:
                for threads in ("null", str(cpus)):
                    before = os.getloadavg()[0]
                    folder = Path(tmp) / f"{'idle' if not spinners else 'loaded'}-{threads}"
                    seconds, used = one_run(args.steps, threads, args.overrides, folder)
                    print(f"| {load} | {threads} | {used} | {seconds:.1f} | {before:.2f} |", flush=True)
            finally:
                for spinner in spinners:
                    spinner.terminate()


if __name__ == "__main__":
    main()
