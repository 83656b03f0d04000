"""Seconds from `python train.py` to the end of its first optimizer step, on the embedded default.

    python scripts/startup_time.py                 # 3 runs of the default (DPO, tiny model), one after the other
    python scripts/startup_time.py --runs 5 algo=sft   # more runs; extra arguments are overrides of every run

Each run is `train.py train.max_steps=1 <overrides>` in a fresh process and a fresh run folder; the clock starts
when the process is started and stops when the log line of step 1 appears (the step's end, after the evaluation at
the start, as a default run does it). The tiny model's warm start is built first if it is not cached yet (not
timed). The machine's load average is printed with the times: on shared cores it decides them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_to_first_step(overrides: list[str], folder: Path) -> tuple[float, float]:
    """(seconds to the step-1 log line, seconds to the process's end) of one run."""
    command = [sys.executable, str(ROOT / "train.py"), "train.max_steps=1", f"hydra.run.dir={folder}", *overrides]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first, lines = None, []
    for line in process.stderr:
        lines.append(line)
        if first is None and "step 1: train/" in line:
            first = time.perf_counter() - start
    if process.wait() != 0 or first is None:
        sys.exit("the run failed:\n" + "".join(lines[-30:]))
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        time_to_first_step(args.overrides, Path(tmp) / "warm")  # builds what the first run of a machine builds
        times = []
        for i in range(args.runs):
            load = os.getloadavg()[0]
            first, total = time_to_first_step(args.overrides, Path(tmp) / f"run{i}")
            times.append(first)
            print(f"run {i + 1}: first step after {first:.2f} s (process {total:.2f} s), load average {load:.2f}")
    print(f"median {statistics.median(times):.2f} s, min {min(times):.2f} s over {args.runs} runs; "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
