"""Seconds from `python train.py` to the end of its first optimizer step, on the embedded default.

    python benchmarks/startup_time.py                 # 3 runs of the default (DPO, tiny model), one after the other
    python benchmarks/startup_time.py --runs 5 algo=sft   # more runs; extra arguments are overrides of every run

Each run is `train.py train.max_steps=1 <overrides>` in a fresh process and a fresh run folder; the clock starts
when the process is started and stops when the log line of step 1 appears (the step's end, after the evaluation at
the start, as a default run does it); the process is then killed (its final evaluation and save are not start-up).
The phases come from when stderr shows each first line: `python` to "Loading weights" (imports, the config's
checks; the tiny model's cached warm start begins to load), to the line "run dir" (model, data, tokenization, reference, optimizer built), to the line "step 0"
(the evaluation at the start), to the line "step 1" (the first optimizer step). One untimed run first builds what
the first run on a machine builds (the tiny model's warm start, the tokenized data's cache). The machine's load
average is printed with the times: on shared cores it decides them.
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


PHASES = {"imports, config": "Loading weights", "build": "] - run dir: ", "eval at start": "] - step 0: ", "first step": "] - step 1: "}


def time_to_first_step(overrides: list[str], folder: Path) -> dict[str, float]:
    """Seconds from the start of one run to the first stderr line of each of :data:`PHASES`."""
    command = [sys.executable, str(ROOT / "train.py"), "train.max_steps=1", f"hydra.run.dir={folder}", *overrides]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    lines = []
    for line in process.stderr:
        lines.append(line)
        for phase, marker in PHASES.items():
            if phase not in seen and marker in line:
                seen[phase] = time.perf_counter() - start
        if "first step" in seen:
            process.kill()
            break
    process.wait()
    if "first step" not in seen:
        sys.exit("the run failed:\n" + "".join(lines[-30:]))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed first run (the caches are warm)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_warmup:
            time_to_first_step(args.overrides, Path(tmp) / "warm")  # builds what the first run of a machine builds
        times = []
        for i in range(args.runs):
            load = os.getloadavg()[0]
            seen = time_to_first_step(args.overrides, Path(tmp) / f"run{i}")
            times.append(seen["first step"])
            previous, phases = 0.0, []
            for phase in PHASES:
                if phase in seen:
                    phases.append(f"{phase} {seen[phase] - previous:.2f}")
                    previous = seen[phase]
            print(f"run {i + 1}: first step after {seen['first step']:.2f} s ({', '.join(phases)}), "
                  f"load average {load:.2f}")
    print(f"median {statistics.median(times):.2f} s, min {min(times):.2f} s over {args.runs} runs; "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
