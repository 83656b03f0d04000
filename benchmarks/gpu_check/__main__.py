"""``python benchmarks/gpu_check`` (what ``benchmarks/gpu_check.sh`` runs), or ``python -m gpu_check`` with
``benchmarks/`` on the path: the check (:func:`gpu_check.main.main`; ``--help`` lists its arguments)."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: put its parent, which holds the package and bench.py, on the path instead
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from gpu_check.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
