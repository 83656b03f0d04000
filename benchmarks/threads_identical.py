"""Whether the same run gives the same numbers at 1 thread and at every CPU's worth, in float32 and in bf16.

    python benchmarks/threads_identical.py                   # 50 steps of the default (DPO)
    python benchmarks/threads_identical.py --steps 30 algo=sft

For each precision (`hardware.mixed_precision=no`, and `bf16` where the CPU has bf16 matrix units), the same
command at each thread count (`hardware.threads_per_process=1` and `=<CPUs>`): printed, the final eval loss and a
hash of the saved weights, then whether the thread counts agree bit for bit. What docs/threads/ says about
bit-identical steps comes from this script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf.core.bf16 import cpu_has_bf16_matmul  # noqa: E402
from rlhf.hardware.cpus import cpus_available  # noqa: E402


def one_run(steps: int, precision: str, threads: int, overrides: list[str], folder: Path) -> tuple[float, str]:
    """(final eval loss, sha256 of the saved weights) of one run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={folder}", f"train.max_steps={steps}",
                          f"train.eval_every_steps={steps}", "hardware=cpu", f"hardware.mixed_precision={precision}",
                          f"hardware.threads_per_process={threads}", *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit("the run failed:\n" + out.stderr[-3000:])
    summary = json.loads((folder / "summary.json").read_text())
    weights = hashlib.sha256((folder / "final" / "model.safetensors").read_bytes()).hexdigest()[:12]
    return summary["final"]["eval/loss"], weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    args, overrides = parser.parse_known_args()
    counts = sorted({1, cpus_available()})
    if len(counts) == 1:
        sys.exit("one CPU here: nothing to compare (run it where there are two or more)")
    precisions = ["no", "bf16"] if cpu_has_bf16_matmul() else ["no"]
    import torch

    print(f"# {platform.processor() or platform.machine()}, {cpus_available()} CPU(s), torch {torch.__version__}, "
          f"{args.steps} steps, overrides: {' '.join(overrides) or '(none)'}")
    print("| mixed_precision | threads | eval/loss | weights (sha256) |\n|---|---:|---:|---|")
    verdicts = []
    with tempfile.TemporaryDirectory() as scratch:
        for precision in precisions:
            results = {}
            for threads in counts:
                results[threads] = one_run(args.steps, precision, threads, overrides,
                                           Path(scratch) / f"{precision}-{threads}")
                loss, weights = results[threads]
                print(f"| {precision} | {threads} | {loss:.6f} | {weights} |", flush=True)
            same = len({w for _, w in results.values()}) == 1
            verdicts.append(f"{precision}: {'bit-identical' if same else 'DIFFERENT'} at {counts} thread(s)")
    print("\n" + "\n".join(verdicts))


if __name__ == "__main__":
    main()
