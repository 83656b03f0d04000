"""Check a finished run's final metrics against thresholds; print them and exit 1 if one fails.

    python scripts/check_run.py <run dir> --min eval/rewards/accuracies=0.85 --min-of-start eval/exact_match=0.10

``--min KEY=V`` requires the final KEY >= V; ``--min-of-start KEY=D`` requires final KEY >= (KEY at step 0) + D.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf.core.errors import UserError
from rlhf.sweeps.results import Run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--min", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--min-of-start", action="append", default=[], metavar="KEY=DELTA")
    args = parser.parse_args()
    try:
        run = Run(args.run_dir)
        final, start = run.final_metrics(), run.at(0)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    failed = False
    for spec, relative in [(s, False) for s in args.min] + [(s, True) for s in args.min_of_start]:
        key, value = spec.split("=", 1)
        bound = float(value) + (start[key] if relative else 0.0)
        ok = final[key] >= bound
        failed |= not ok
        origin = f" (step 0: {start[key]:.4f})" if key in start else ""
        print(f"{'ok  ' if ok else 'FAIL'} {key} = {final[key]:.4f}{origin}, required >= {bound:.4f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
