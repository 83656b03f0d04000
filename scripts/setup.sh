#!/usr/bin/env bash
# Create .venv with PyTorch and rlhf (editable, with test tools). Safe to re-run: it skips what is present.
#   TORCH_SPEC  which torch to install when none is present (default: torch==2.13.0; e.g. "torch" for the
#               newest build for your platform, or a CUDA wheel spec)
#   PYTHON      the interpreter that creates the venv (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "ready: $(.venv/bin/python -c 'import torch, transformers, accelerate; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")')"
