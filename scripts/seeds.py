"""Run one training command over several seeds and print the spread of its results: is a gate safe here?

    python scripts/seeds.py                                   # the main job (algo=dpo optimizer=lion), seeds 0-4
    python scripts/seeds.py --seeds 0-9 --jobs 2              # 10 seeds, two at a time (1 thread each)
    python scripts/seeds.py --markdown -- algo=sft            # any overrides after --; a Markdown table

Each seed is one `train.py` run in `outputs/seeds/<name>/seed_<k>`. The table has, per seed, the held-out
metrics at step 0 and at the end; below it, each metric's range over the seeds and its distance from the
gate. `--gate KEY=VALUE` (default: the CI gate, eval/rewards/accuracies=0.85) exits 1 when a seed is below
it, and says how close the worst seed came. Results depend on the seed and on the CPU's floating point, so
set gates with margin below the worst seed measured here.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlhf.sweeps.results import Run

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ["algo=dpo", "optimizer=lion"]
METRICS = ["eval/rewards/accuracies", "eval/exact_match"]


def parse_seeds(text: str) -> list[int]:
    """'0-4' -> [0, 1, 2, 3, 4]; '0,3,7' -> [0, 3, 7]."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> str:
    import accelerate
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}"


def run_seed(seed: int, overrides: list[str], folder: Path, threads: int | None) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"seed={seed}",
                          f"hydra.run.dir={folder}"], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    run = Run(folder)
    return {"seed": seed, "start": run.at(0), "final": run.final_metrics(), "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train.py overrides (default: the main job's)")
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7 (default 0-4)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="seeds run at once; each gets CPUs/jobs threads (default 1: the main job's table)")
    parser.add_argument("--name", default=None, help="folder under outputs/seeds (default: from the overrides)")
    parser.add_argument("--metrics", nargs="*", default=METRICS, help="held-out metrics to show")
    parser.add_argument("--gate", action="append", default=None, metavar="KEY=VALUE",
                        help="minimum final value (default eval/rewards/accuracies=0.85); repeatable")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (for the README and docs/results/main-job.md)")
    args = parser.parse_args()
    overrides = args.overrides or MAIN_JOB
    seeds = parse_seeds(args.seeds)
    gates = dict(g.split("=", 1) for g in (args.gate or ["eval/rewards/accuracies=0.85"]))
    # "=" in hydra.run.dir's value would not parse as an override: algo=sft -> algo-sft
    name = args.name or ("_".join(overrides).replace("/", "-").replace("=", "-") or "default")
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    base = ROOT / "outputs" / "seeds" / name

    print(f"# {' '.join(['python train.py', *overrides])}  seeds {args.seeds}", file=sys.stderr)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda s: run_seed(s, overrides, base / f"seed_{s}", threads), seeds))

    metrics = args.metrics
    header = ["seed", *(f"{m} (step 0 -> end)" for m in metrics), "seconds"]
    rows = [[str(r["seed"]), *(f"{r['start'].get(m, float('nan')):.3f} -> {r['final'][m]:.3f}" for m in metrics),
             f"{r['seconds']:.0f}"] for r in results]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---:" for _ in header) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for row in [header, *rows]:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    print()
    failed = False
    for m in metrics:
        values = [r["final"][m] for r in results]
        line = f"{m}: {min(values):.3f}-{max(values):.3f} over seeds {args.seeds} (mean {sum(values) / len(values):.3f})"
        if m in gates:
            gate = float(gates[m])
            worst = min(values)
            failed |= worst < gate
            line += f"; gate {gate}: worst seed {'+' if worst >= gate else ''}{worst - gate:.3f} from it"
        print(line)
    print(f"measured on {cpu_name()} ({os.cpu_count()} CPUs), {versions()}, "
          f"{args.jobs} job(s) at a time, {threads or 'default'} thread(s) each")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
