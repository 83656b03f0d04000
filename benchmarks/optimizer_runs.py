"""Every option of conf/optimizer in a short real run: does it start, train, save, and hold the state the preflight
predicted? One `train.py` process per option, as a user runs it.

    python benchmarks/optimizer_runs.py                               # algo=dpo on the embedded default, 4 steps
    python benchmarks/optimizer_runs.py --model smollm2-135m          # the packaged real model (offline), 3 steps
    python benchmarks/optimizer_runs.py --algo grpo --steps 3         # online RL on the embedded default
    python benchmarks/optimizer_runs.py --only soap,prodigy --out runs.md

Prints one markdown row per option: whether it finished, its last training loss (and reward, online) and gradient
norm (the last log window's), the optimizer state it held against the preflight's prediction (summary.json:
memory_held_mb), and the run's wall time (start-up included; a few steps, so not a speed comparison:
benchmarks/optimizer_costs.py is).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.seeds import cpu_name, versions  # noqa: E402

SMALL = ["train.per_device_batch_size=2", "train.eval_batch_size=4", "data.task.num_train=16", "data.task.num_eval=4",
         "train.eval_at_start=false", "train.save_every_minutes=0"]


def options() -> list[str]:
    return sorted(path.stem for path in (ROOT / "conf" / "optimizer").glob("*.yaml"))


def run_one(option: str, algo: str, model: str | None, steps: int, folder: Path) -> dict:
    command = [sys.executable, str(ROOT / "train.py"), f"algo={algo}", f"optimizer={option}",
               f"train.max_steps={steps}", *SMALL, f"output_dir={folder}", *([f"model={model}"] if model else [])]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    row = {"option": option, "ok": done.returncode == 0, "seconds": seconds}
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:160]
        return row
    summary = json.loads((folder / "summary.json").read_text())
    final = summary["final"]
    row.update(loss=final.get("train/loss"), reward=final.get("train/reward"), grad_norm=final.get("train/grad_norm"),
               held_mb=summary["memory_held_mb"]["optimizer_state"],
               predicted_mb=summary["memory_held_mb"]["optimizer_state_predicted"])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| option | finished | train/loss | train/reward | train/grad_norm | optimizer state held, MB | predicted, MB "
             "| run, s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| `{r['option']}` | no: {r['error']} | | | | | | {r['seconds']:.0f} |")
            continue
        loss, reward, norm = (f"{r[key]:.4g}" if r.get(key) is not None else "-" for key in ("loss", "reward",
                                                                                             "grad_norm"))
        lines.append(f"| `{r['option']}` | yes | {loss} | {reward} | {norm} | {r['held_mb']:.1f} | "
                     f"{r['predicted_mb']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="dpo")
    parser.add_argument("--model", default=None, help="a conf/model option (default: the embedded default)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 4; 3 with --model)")
    parser.add_argument("--only", default=None, help="comma-separated options (default: every conf/optimizer option)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    steps = args.steps or (3 if args.model else 4)
    chosen = args.only.split(",") if args.only else options()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for option in chosen:
            rows.append(run_one(option, args.algo, args.model, steps, Path(tmp) / option))
            print(f"{option}: {'ok' if rows[-1]['ok'] else 'FAILED'} ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    text = (f"`python benchmarks/optimizer_runs.py --algo {args.algo}" + (f" --model {args.model}" if args.model else "")
            + f" --steps {steps}`: {cpu_name()}, {versions()}\n\n" + table(rows) + "\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
