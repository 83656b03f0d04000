"""The Triton output layer's checks (``tests/ops/triton_interpreted_checks.py``) in a process of their own under
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, which another test of
this process may already have done without it). ``triton`` is a required test dependency: missing, this fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = Path(__file__).with_name("triton_interpreted_checks.py")


def test_triton_is_installed():
    import triton  # noqa: F401  (the dev extra pins it: missing, this fails rather than skips)


def test_the_triton_kernel_and_its_torch_twin_under_the_interpreter():
    """Values, greedy tokens, entropy and gradients against float64 (fp32, bf16 autocast, T = 1 and 0.7, odd sizes),
    the kernel against its torch twin, scored rows against every row, and no host sync (both paths)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider", "-n0",
                          "-W", "ignore::RuntimeWarning"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
