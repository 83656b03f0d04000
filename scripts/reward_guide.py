"""Measure the reward guide's example (docs/how-to/your-reward.md) as a user would run it, and write the page of its
numbers (docs/evaluation/<date>-reward-guide.md).

    python scripts/reward_guide.py                      # seeds 0 and 1, the three scale_rewards: ~8 minutes on 2 CPUs
    python scripts/reward_guide.py --seeds 0,1,2 --out /tmp/page.md

The guide's own files are taken from the page (the Python block and the YAML block whose first lines name
`my_project/my_rewards.py` and `my_project/conf/algo/reward_funcs/mine.yaml`), as they are, and written to a fresh folder outside the repository, and the
guide's `train.py` command runs there as written, then with each other `algo/scale_rewards` in place of its own
(`group` is GRPO's default). Each run's held-out exact match (`eval/rewards/correct/mean`: greedy decoding of the
512 held-out prompts) and answer length are read from its metrics.jsonl, with GRPO's warning about a lightly
weighted reward from its train.log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "how-to" / "your-reward.md"
FILES = {"my_rewards.py": "# my_project/my_rewards.py", "conf/algo/reward_funcs/mine.yaml":
         "# my_project/conf/algo/reward_funcs/mine.yaml"}  # the comment that names each file, on one of its first lines
SCALES = ("group", "none", "batch")
PINNED = ["hardware.threads_per_process=1"]  # bf16 on a CPU rounds by thread count: one count, the same numbers
WARNING = "alone made the rewards differ"  # the start of GRPO's warning (rlhf/algos/grpo.py)


def guide_files_and_command(text: str) -> tuple[dict[str, str], list[str]]:
    """The guide's files (relative path -> text, from the fenced blocks whose first line names them) and the
    arguments of its `train.py` command."""
    blocks = re.findall(r"```\w*\n(.*?)```", text, flags=re.S)
    files = {}
    for path, first_line in FILES.items():
        found = [b for b in blocks if any(line.startswith(first_line) for line in b.splitlines()[:2])]
        if len(found) != 1:
            raise SystemExit(f"{GUIDE}: {len(found)} blocks start with {first_line!r}, not one")
        files[path] = found[0]
    commands = [line for b in blocks for line in b.splitlines() if "cd my_project && python" in line]
    if len(commands) != 1:
        raise SystemExit(f"{GUIDE}: {len(commands)} `cd my_project && python ... train.py` commands, not one")
    words = shlex.split(commands[0].split("&&", 1)[1])
    return files, words[words.index(next(w for w in words if w.endswith("train.py"))) + 1:]


def with_scale(args: list[str], scale: str) -> list[str]:
    """``args`` with ``algo/scale_rewards=<scale>`` in place of the command's own choice (added where it has none)."""
    return [a for a in args if not a.startswith("algo/scale_rewards=")] + [f"algo/scale_rewards={scale}"]


def run(project: Path, args: list[str], seed: int, folder: Path) -> dict:
    """One run of ``train.py args`` in ``project``; its held-out numbers at step 0, 50 and the end."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"seed={seed}", *PINNED,
                          f"hydra.run.dir={folder}"], cwd=project, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"train.py {' '.join(args)} seed={seed} failed:\n{out.stderr[-3000:]}")
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    held_out = {line["step"]: line for line in lines if "eval/rewards/correct/mean" in line}
    last = max(held_out)
    minor = [line["train/frac_groups_scaled_by_minor_reward"] for line in lines
             if "train/frac_groups_scaled_by_minor_reward" in line]
    return {"seed": seed, "start": held_out[0]["eval/rewards/correct/mean"],
            "at_50": held_out[50]["eval/rewards/correct/mean"] if 50 in held_out else float("nan"),
            "end": held_out[last]["eval/rewards/correct/mean"], "steps": last,
            "length": held_out[last]["eval/completions/mean_length"], "minor_first": minor[0] if minor else None,
            "warned": WARNING in (folder / "train.log").read_text(), "seconds": time.perf_counter() - started}


def machine() -> str:
    import torch
    import transformers

    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
               platform.processor() or platform.machine())
    return (f"{cpu}, {os.cpu_count()} CPUs; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def spread(values: list[float]) -> str:
    """``a`` for one value or equal ones, else ``a–b`` (the range over seeds)."""
    low, high = min(values), max(values)
    return f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f}–{high:.3f}"


def page(args: list[str], seeds: list[int], results: dict[str, list[dict]], date: str, seconds: float) -> str:
    written = next(a.split("=", 1)[1] for a in args if a.startswith("algo/scale_rewards="))
    rows = []
    for scale, runs in results.items():
        minor = [r["minor_first"] for r in runs if r["minor_first"] is not None]
        rows.append(f"| `{scale}`{' (the guide)' if scale == written else ''}{' (GRPO default)' * (scale == 'group')} "
                    f"| {spread([r['start'] for r in runs])} | {spread([r['at_50'] for r in runs])} "
                    f"| {spread([r['end'] for r in runs])} | {spread([r['length'] for r in runs])} "
                    f"| {spread(minor) if minor else '—'} | {sum(r['warned'] for r in runs)} of {len(runs)} |")
    return f"""# The reward guide's example, measured ({date})

The example of [Online RL with your own reward](../how-to/your-reward.md): `my_rewards.py` (an answer's
correctness, and a brevity bonus: 1 for an empty answer, 0 from 16 characters) and `conf/algo/reward_funcs/mine.yaml`
(weights 1.0 and 0.1), copied from the guide into a fresh folder outside the repository, and the guide's command run
there as written:

<!-- examples: not run (a project folder of one's own: scripts/reward_guide.py makes one and runs it) -->
```bash
cd my_project && python ~/rlhf/train.py {' '.join(shlex.quote(a) for a in args)}
```

then with each other `algo/scale_rewards` in its place (`group`: GRPO's and TRL's default, the guide's command
before it named one). Every run: GRPO's defaults, 300 steps of 32 prompts x 8 completions, from the embedded SFT
warm start; seeds {', '.join(map(str, seeds))}; `{' '.join(PINNED)}` added to every run, so that the numbers
repeat whatever else the machine runs (the thread count changes the rounding of bf16 arithmetic on a CPU).

- **Command**: `python scripts/reward_guide.py --seeds {','.join(map(str, seeds))}` (writes this page).
- **Machine**: {machine()}; runs one at a time. Wall time {seconds / 60:.0f} minutes for the {sum(map(len, results.values()))} runs.

Held-out exact match (`eval/rewards/correct/mean`: greedy answers to the 512 held-out prompts), as the range over the
seeds (one number where they agree to 3 decimals):

| `algo/scale_rewards` | step 0 | step 50 | step 300 | answer length at 300 (tokens, EOS included) | groups scaled by the brevity bonus alone, first 10 steps | warned |
|---|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

With `group` scaling, groups in which no answer is right differ by the brevity bonus alone, and dividing by their own
standard deviation gives its differences advantages as large as correctness gets elsewhere: the policy learns to
answer nothing (length 1: the end-of-sequence token alone). `none` and `batch` keep the 0.1 weight a tenth of
correctness in every group, and the exact match rises. The second-to-last column is
`train/frac_groups_scaled_by_minor_reward` in the first log window (steps 1–10), logged where the scaling is `group`
only; "warned": runs whose train.log has GRPO's warning about a lightly weighted reward (`reward function short
(weight 0.1) alone made the rewards differ in ...`), said once per run.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    date = datetime.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "evaluation" / f"{date}-reward-guide.md",
                        help="the page to write (default docs/evaluation/<today>-reward-guide.md)")
    options = parser.parse_args()
    seeds = [int(s) for s in options.seeds.split(",")]
    files, args = guide_files_and_command(GUIDE.read_text())
    written = next((a.split("=", 1)[1] for a in args if a.startswith("algo/scale_rewards=")), "group")
    args = with_scale(args, written)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="reward_guide_") as tmp:
        project = Path(tmp) / "my_project"
        for path, text in files.items():
            (project / path).parent.mkdir(parents=True, exist_ok=True)
            (project / path).write_text(text)
        results = {}
        for scale in (written, *(s for s in SCALES if s != written)):
            results[scale] = []
            for seed in seeds:
                result = run(project, with_scale(args, scale), seed, Path(tmp) / "runs" / f"{scale}_seed{seed}")
                print(f"scale_rewards={scale} seed={seed}: exact match {result['start']:.3f} -> {result['end']:.3f}"
                      f", length {result['length']:.2f}, warned {result['warned']} ({result['seconds']:.0f} s)",
                      file=sys.stderr)
                results[scale].append(result)
    options.out.write_text(page(args, seeds, results, date, time.perf_counter() - started))
    print(options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
