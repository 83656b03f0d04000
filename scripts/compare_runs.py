"""The comparison report of a sweep (or of any run folders): a table, the curves as a PNG, Markdown and CSV.

    python scripts/compare_runs.py outputs/multirun/<date>/<time>
    python scripts/compare_runs.py outputs/multirun/<date>/<time> --seeds --metrics eval/loss eval/exact_match

One row per run: the config values that differ between the runs (from each run's .hydra/config.yaml), each
held-out metric at step 0, at the end and at its best (with the step), the final train loss, tokens/s, peak memory,
wall time and the status (finished, running, crashed: crashed runs show what they logged and the last error of
their train.log). Written to --out (default: the sweep folder) as report.md, report.csv and report.png; the table is
printed too. Where the runs searched a number (a learning rate...), objective.png plots their `objective.metric`
against it, one line per value of the rest (the optimizer...). --seeds folds runs that differ only in `seed` into mean ± std. The logic is rlhf/sweeps/report.py.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

from rlhf.core.errors import UserError
from rlhf.sweeps import report
from rlhf.sweeps.results import find, is_run_folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="multirun (sweep) folders or run folders")
    parser.add_argument("--metrics", nargs="+", help="held-out metrics to show (default: eval/loss and the "
                        "accuracy-like eval/* metrics the runs logged: exact match, accuracies, win rate)")
    parser.add_argument("--plot", nargs="+", metavar="METRIC", help="metrics to plot, train and held-out curves "
                        "of each name (default: train/loss and the --metrics)")
    parser.add_argument("--seeds", action="store_true", help="one row per group of runs that differ only in seed: "
                        "mean ± std")
    parser.add_argument("--out", type=Path, help="folder for report.md, report.csv, report.png (default: the sweep "
                        "folder, or the folder that holds the run folders given)")
    parser.add_argument("--csv", action="store_true", help="print the table as CSV instead of aligned text")
    args = parser.parse_args()
    try:
        runs = find(args.paths)
        if not runs:
            raise UserError(f"no run folders under {', '.join(map(str, args.paths))}. Fix: give a multirun's folder "
                            "(outputs/multirun/<date>/<time>) or run folders.")
        objective = report.objective_of(runs)  # what the runs' search optimized: plotted against what it searched
        metrics = args.metrics and [*args.metrics, *([objective] if objective not in args.metrics else [])]
        made = report.build(runs, metrics if objective else args.metrics)
        if args.seeds:
            made = report.aggregate_seeds(made)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.csv:
        csv.writer(sys.stdout).writerows(report.csv_rows(made))
    else:
        print(report.text(made), end="")
    sweeps = [path for path in args.paths if not is_run_folder(path)]
    out = args.out or (sweeps[0] if len(sweeps) == 1 else Path(os.path.commonpath([run.path.parent for run in runs])))
    written = report.write(made, out, args.plot, objective=objective)
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
