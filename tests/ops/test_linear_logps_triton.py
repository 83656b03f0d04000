"""The Triton output layer's checks (``tests/ops/triton_interpreted_checks.py``) in a process of their own under
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported, which another test of
this process may already have done without it). ``triton`` is a required test dependency: missing, this fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = Path(__file__).with_name("triton_interpreted_checks.py")
# Where scripts/setup.sh installs triton: outside the environment (a CPU build of torch imports a triton it finds)
TRITON_SITE = Path(__file__).resolve().parents[2] / ".venv" / "triton"


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": f"{TRITON_SITE}{os.pathsep + path if path else ''}"}


def test_triton_is_installed():
    """Missing, this fails rather than skips: the kernel's tests need it."""
    found = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=_env(),
                           capture_output=True, text=True)
    assert found.returncode == 0, f"triton does not import from {TRITON_SITE}: run bash scripts/setup.sh ({found.stderr[-500:]})"


def test_the_triton_kernel_and_its_torch_twin_under_the_interpreter():
    """Values, greedy tokens, entropy and gradients against float64 (fp32, bf16 autocast, T = 1 and 0.7, odd sizes),
    the kernel against its torch twin, scored rows against every row, and no host sync (both paths)."""
    env = _env()
    run = subprocess.run([sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider", "-n0",
                          "-W", "ignore::RuntimeWarning"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
