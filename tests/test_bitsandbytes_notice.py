"""rlhf/__init__.py: bitsandbytes' import-time notice that the optional ``kernels`` package (a Hub kernel for 4-bit
matmuls on CPUs with AVX-512 BF16) is missing is dropped once rlhf is imported; its other warnings still show."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

# bitsandbytes 0.50.2's own words (backends/cpu/ops.py), logged when it is imported on a CPU with AVX-512 BF16.
NOTICE = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
          "kernels` and the kernels >= 0.11.1")

SCRIPT = f"""
import logging, sys
if sys.argv[1] == "rlhf":
    import rlhf
import bitsandbytes  # on a CPU with AVX-512 BF16 this logs the notice itself
log = logging.getLogger("bitsandbytes.backends.cpu.ops")
log.warning({NOTICE!r}, ModuleNotFoundError("No module named 'kernels'"))  # as on such a CPU, whatever this one is
log.warning({NOTICE!r}, "Version 1 is not available in the local cache and Hugging Face Hub is in offline mode")
"""


def _stderr(first: str) -> str:
    result = subprocess.run([sys.executable, "-c", SCRIPT, first], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_the_missing_kernels_notice_is_dropped_and_a_failure_of_an_installed_kernels_still_shows():
    quiet = _stderr("rlhf")
    assert "No module named 'kernels'" not in quiet, quiet
    assert quiet.count("gemm_4bit_forward") == 1 and "offline mode" in quiet, quiet  # `kernels` installed: it shows
    loud = _stderr("plain")  # without rlhf's filter the notice reaches the terminal (what CI saw on such a CPU)
    assert "No module named 'kernels'" in loud, loud
