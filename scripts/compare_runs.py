"""Print a side-by-side table of the runs of a multirun (or of any run folders).

    python scripts/compare_runs.py outputs/multirun/2026-11-22/12-32-13
    python scripts/compare_runs.py outputs/multirun/<date>/<time> --metrics eval/rewards/accuracies eval/exact_match

Each row is one run: the overrides that distinguish it (from .hydra/overrides.yaml) and its final metrics
(from summary.json). Columns default to the held-out metrics; --csv writes the table as CSV instead.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import yaml


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for path in paths:
        runs += sorted(p.parent for p in path.rglob("summary.json")) if not (path / "summary.json").exists() else [path]
    return runs


def load(run: Path) -> tuple[dict[str, str], dict[str, float]]:
    overrides_file = run / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
    return dict(o.split("=", 1) for o in overrides if "=" in o), json.loads((run / "summary.json").read_text())["final"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="multirun folders or run folders")
    parser.add_argument("--metrics", nargs="*", help="metric names to show (default: every eval/* metric)")
    parser.add_argument("--csv", action="store_true", help="write CSV to stdout")
    args = parser.parse_args()
    runs = find_runs(args.paths)
    if not runs:
        print(f"no finished runs (folders with summary.json) under {[str(p) for p in args.paths]}", file=sys.stderr)
        return 1
    loaded = [(run, *load(run)) for run in runs]
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
