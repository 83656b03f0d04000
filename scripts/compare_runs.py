"""Print a side-by-side table of the runs of a multirun (or of any run folders).

    python scripts/compare_runs.py outputs/multirun/2026-11-22/12-32-13
    python scripts/compare_runs.py outputs/multirun/<date>/<time> --metrics eval/rewards/accuracies eval/exact_match

Each row is one run: the overrides that distinguish it (from .hydra/overrides.yaml) and its final metrics
(from summary.json). Columns default to the held-out metrics; --csv writes the table as CSV instead.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from rlhf.errors import UserError
from rlhf.results import find


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="multirun folders or run folders")
    parser.add_argument("--metrics", nargs="*", help="metric names to show (default: every eval/* metric)")
    parser.add_argument("--csv", action="store_true", help="write CSV to stdout")
    args = parser.parse_args()
    try:
        loaded = [(run.path, run.override_values, run.final) for run in find(args.paths) if run.final is not None]
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not loaded:
        print(f"no finished runs (folders with summary.json) under {[str(p) for p in args.paths]}", file=sys.stderr)
        return 1
    # Only overrides that differ between runs tell them apart.
    keys = sorted({k for _, o, _ in loaded for k in o})
    varying = [k for k in keys if len({o.get(k) for _, o, _ in loaded}) > 1] or keys
    metrics = args.metrics or sorted({k for _, _, m in loaded for k in m if k.startswith("eval/")})
    header = ["run", *varying, *metrics]
    rows = [[run.name, *(o.get(k, "") for k in varying), *(f"{m[k]:.4g}" if k in m else "" for k in metrics)]
            for run, o, m in loaded]
    if args.csv:
        csv.writer(sys.stdout).writerows([header, *rows])
        return 0
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for line in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
