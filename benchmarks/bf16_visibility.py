"""How many optimizer steps bf16 hides a run's updates from its forward pass (``train/bf16_steps_to_visible``,
rlhf/telemetry/bf16_updates.py), on the embedded default and on the packaged real model, at two learning rates each:
the figures of docs/results/2026-11-29-bf16-and-the-learning-rate.md (for docs/concepts/strategies.md, "When bf16 hides
the updates").

    python benchmarks/bf16_visibility.py                 # every case (minutes: bf16 on a CPU without bf16 units is slow)
    python benchmarks/bf16_visibility.py --only tiny     # the embedded default's cases only

Each case is one ``train()`` of DPO in bf16 autocast (``hardware=cpu hardware.mixed_precision=bf16``), one optimizer
step at a constant learning rate (no warmup: the figure is measured at the peak), no evaluation; the figure is what
the run records. "warned at 300 steps" says whether a run of the default length (``train.max_steps=300``) would get
the warning (shorter than 4 times the figure). Printed on stdout; the runs' logs go to stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["algo=dpo", "hardware=cpu", "hardware.mixed_precision=bf16", "scheduler=constant",
          "scheduler.num_warmup_steps=0", "train.max_steps=1", "train.eval_at_start=false", "train.eval_every_steps=0",
          "train.save_final=false", "train.save_every_minutes=0", "train.log_every_steps=1", "seed=0"]
TINY = ["model=tiny"]  # the embedded default: the warm-started tiny model on the embedded task
REAL = ["model=smollm2-135m", f"data.path={ROOT / 'docs/how-to/chat-data/prefs.jsonl'}", "data.eval_size=8",
        "train.per_device_batch_size=8", "train.eval_batch_size=8"]
CASES = {"tiny": [("embedded default", TINY, 1e-4), ("embedded default", TINY, 5e-7)],
         "real": [("SmolLM2-135M, prefs.jsonl", REAL, 1e-6), ("SmolLM2-135M, prefs.jsonl", REAL, 1e-5)]}


def figure(overrides: list[str]) -> float:
    from hydra import compose, initialize_config_dir

    from rlhf import train
    from rlhf.telemetry.bf16_updates import METRIC

    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return float(train(compose("config", overrides=[*overrides, f"output_dir={out}/run"]))[METRIC])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(CASES), help="one group of cases")
    parser.add_argument("--threads", type=int, default=2, help="hardware.threads_per_process (default 2)")
    args = parser.parse_args()
    import torch
    import transformers

    from rlhf.telemetry.bf16_updates import WARN_FACTOR

    rows = []
    for group in [args.only] if args.only else list(CASES):
        for name, overrides, lr in CASES[group]:
            value = figure([*COMMON, *overrides, f"optimizer.lr={lr}", f"hardware.threads_per_process={args.threads}"])
            rows.append((name, lr, value))
            print(f"{name}, lr {lr:.0e}: {value:.3g} steps", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"\n{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} thread(s)\n")
    print("| model and data | lr | steps until a typical weight's bf16 value changes | warned at 300 steps |")
    print("|---|---|---|---|")
    for name, lr, value in rows:
        print(f"| {name} | {lr:.0e} | {value:.3g} | {'yes' if 300 < WARN_FACTOR * value else 'no'} |")


if __name__ == "__main__":
    main()
