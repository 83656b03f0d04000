"""Whether the learning rate still matters under bf16 autocast on the packaged real model (``model=smollm2-135m``):
the held-out DPO margin after 2 optimizer steps at a constant learning rate, per learning rate, in bf16 autocast and
in float32.

    python benchmarks/bf16_lr_table.py                    # lr 1e-12 (nothing should move), 1e-7 ... 1e-4; seed 0
    python benchmarks/bf16_lr_table.py --before           # also the weights dequantized as they are (8% on bf16 ties)
    python benchmarks/bf16_lr_table.py --seeds 0 1 2 --lrs 1e-7 1e-5

Each cell is one run of ``train()`` (DPO on the embedded task, ``data=reverse``: 80 training pairs, 2 steps of 8,
``scheduler=constant`` without warmup, ``hardware=cpu`` at a fixed thread count: 1 unless ``--threads`` says) that
reports ``eval/rewards/margins`` on 32 held-out pairs; with several seeds (which batches the steps draw) a cell shows
the lowest and highest. Printed on stdout: each run as it ends, then the table (the runs' logs go to stderr). The
weights are the packaged folder as ``model=smollm2-135m`` makes it (snapped to bf16 values); ``--before`` adds the
same model converted without that snap (:class:`rlhf.models.packaged.PackagedGguf` with ``snap_to_bf16=False``, a
folder of its own in the cache). A bf16 run takes minutes on a CPU without bf16 matrix units (2 vCPUs of an AMD EPYC
with AVX2: about 2 minutes at 1 thread), a float32 one about 20 seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"
PRECISIONS = {"bf16": "bf16 autocast", "no": "float32"}  # hardware.mixed_precision: how the table names it
WEIGHTS = {True: "snapped to bf16 (now)", False: "dequantized as they are (before)"}


def overrides(folder: Path, precision: str, lr: float, seed: int, threads: int, out: Path) -> list[str]:
    """One cell's run: 2 AdamW steps of 8 pairs at a constant ``lr``, then one evaluation of 32 held-out pairs."""
    return ["algo=dpo", "model=smollm2-135m", f"model.name_or_path={folder}", "data=reverse",
            "data.task.num_train=80", "data.task.num_eval=32", "train.max_steps=2", "train.per_device_batch_size=8",
            "train.eval_batch_size=32", "train.eval_every_steps=0", "train.eval_at_start=false",
            "train.log_every_steps=1", "train.save_final=false", "train.save_every_minutes=0", "scheduler=constant",
            "scheduler.num_warmup_steps=0", "optimizer=adamw", f"optimizer.lr={lr}", "hardware=cpu",
            f"hardware.mixed_precision={precision}", f"hardware.threads_per_process={threads}", f"seed={seed}",
            f"output_dir={out}"]


def margin(folder: Path, precision: str, lr: float, seed: int, threads: int) -> float:
    """``eval/rewards/margins`` at the end of one cell's run."""
    from hydra import compose, initialize_config_dir

    from rlhf import train

    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides(folder, precision, lr, seed, threads, Path(out) / "run"))
        return train(cfg)["eval/rewards/margins"]


def cell(values: list[float]) -> str:
    """The value to 4 decimals, or the lowest and highest of several (one per seed) where they differ there."""
    low, high = (f"{v:.4f}".replace("-0.0000", "0.0000") for v in (min(values), max(values)))
    return low if low == high else f"{low} to {high}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-12, 1e-7, 1e-6, 1e-5, 1e-4],
                        help="constant learning rates, one column each")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds; a cell shows their range")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS),
                        help="hardware.mixed_precision values, one row each")
    parser.add_argument("--before", action="store_true",
                        help="also the weights as dequantized, without the bf16 snap (a second folder, ~1 minute once)")
    parser.add_argument("--threads", type=int, default=1,
                        help="hardware.threads_per_process: bf16 numbers on a CPU depend on it, so it is fixed; 1 "
                        "repeats them on any machine and is the fastest where other work shares the CPUs")
    parser.add_argument("--cache-dir", default=os.environ.get("RLHF_CACHE", "~/.cache/rlhf"),
                        help="where the model folders are made (default: $RLHF_CACHE, else ~/.cache/rlhf)")
    args = parser.parse_args()

    import torch
    import transformers

    from rlhf.core.errors import UserError
    from rlhf.models.packaged import PackagedGguf
    from rlhf.telemetry.mfu import machine_name

    try:
        folders = {snap: PackagedGguf(cache_dir=args.cache_dir, snap_to_bf16=snap).folder()
                   for snap in ([True, False] if args.before else [True])}
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"# {machine_name(torch.device('cpu'))}, hardware.threads_per_process={args.threads}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; seeds {args.seeds}", flush=True)
    start = time.perf_counter()
    results: dict[tuple[bool, str, float], list[float]] = {}
    for snap, folder in folders.items():
        for precision in args.precisions:
            for lr in args.lrs:
                for seed in args.seeds:
                    began = time.perf_counter()
                    value = margin(folder, precision, lr, seed, args.threads)
                    results.setdefault((snap, precision, lr), []).append(value)
                    print(f"# {WEIGHTS[snap]}, {PRECISIONS[precision]}, lr {lr:g}, seed {seed}: margin {value:.6f} "
                          f"({time.perf_counter() - began:.0f} s)", flush=True)
    print(f"\nheld-out eval/rewards/margins after 2 steps at a constant lr ({time.perf_counter() - start:.0f} s "
          "in all)\n")
    print("| weights | precision | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |")
    print("|---|---|" + "---:|" * len(args.lrs))
    for snap in folders:
        for precision in args.precisions:
            cells = " | ".join(cell(results[snap, precision, lr]) for lr in args.lrs)
            print(f"| {WEIGHTS[snap]} | {PRECISIONS[precision]} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
