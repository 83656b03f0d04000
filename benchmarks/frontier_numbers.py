"""The figures of ``experiment=objective_frontier`` as the README and its dated page state them: per objective and
strength, the sampled reward and the KL at the run's end (mean and the range over the seeds), whether the point is
on the non-dominated front, and the warm start's own point (step 0, the same for every run).

    python benchmarks/frontier_numbers.py outputs/readme/frontier      # after bash benchmarks/readme_numbers.sh frontier
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf.sweeps import plots  # noqa: E402
from rlhf.sweeps.report import aggregate_seeds, build  # noqa: E402
from rlhf.sweeps.results import find  # noqa: E402


def spread(values: list[float], digits: int) -> str:
    """``mean [min–max]`` over the seeds."""
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="the sweep folder (its confirm/ holds the runs)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    runs = find([args.sweep / "confirm"])
    if not runs:
        print(f"no runs under {args.sweep / 'confirm'}", file=sys.stderr)
        return 2
    report = aggregate_seeds(build(runs, [plots.REWARD, plots.KL]))
    points = plots.frontier_points(report)
    start = [(dict(run.history(plots.KL)).get(0), dict(run.history(plots.REWARD)).get(0)) for run in runs]
    start_rewards = [r for _, r in start if r is not None]
    start_greedy = [v for v in (dict(run.history("eval/gen/greedy_reward")).get(0) for run in runs) if v is not None]
    seeds = sorted({run.config.get("seed") for run in runs})
    print(f"{len(runs)} runs, seeds {','.join(map(str, seeds))}; the warm start (step 0): sampled reward "
          f"{spread(start_rewards, 3)}, greedy reward {spread(start_greedy, 3) if start_greedy else '-'}, KL 0\n")
    print("| objective | strength | sampled reward: mean [range over seeds] | KL (nats): mean [range] | greedy reward "
          "| front |")
    print("|---|---|---:|---:|---:|:---:|")
    rows = []
    for point in sorted(points, key=lambda p: (p["objective"], p["label"])):
        ends = [trajectory[-1] for trajectory in point["trajectories"]]
        kls, rewards = [k for k, _ in ends], [r for _, r in ends]
        greedy = [run.final["eval/gen/greedy_reward"] for run in point["runs"]
                  if "eval/gen/greedy_reward" in (run.final or {})]
        rows.append({"objective": point["objective"], "strength": point["label"], "reward": rewards, "kl": kls,
                     "greedy_reward": greedy, "front": point["front"]})
        print(f"| {point['objective']} | {point['label']} | {spread(rewards, 3)} | {spread(kls, 2)} | "
              f"{spread(greedy, 3) if greedy else ''} | {'yes' if point['front'] else ''} |")
    best = max(rows, key=lambda r: statistics.fmean(r["reward"]))
    print(f"\nhighest mean reward: {best['objective']} {best['strength']} ({spread(best['reward'], 3)} at KL "
          f"{spread(best['kl'], 2)}); on the front: "
          + ", ".join(f"{r['objective']} {r['strength']}" for r in rows if r["front"]))
    if args.json:
        args.json.write_text(json.dumps({"start_reward": start_rewards, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
