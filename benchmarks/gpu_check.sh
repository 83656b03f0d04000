#!/usr/bin/env bash
# The GPU check in one command (the package benchmarks/gpu_check/, run as `python benchmarks/gpu_check`): installs the wheels carried in .whl/ (benchmarks/device_wheels.sh) into /tmp/site where there are any,
# runs the check (which first imports every package it needs, printing their versions, and stops with exit 2 naming
# the missing one) and leaves its page, its JSON, its log and the profiles in $OUT (the device tool's output folder;
# outputs/gpu_check elsewhere). Arguments go to the check (--help lists them).
#
#   bash benchmarks/device_wheels.sh                         # here, once: the wheels (.whl/, ignored by git)
#   device run, carry [".whl"], timeout_s 550:  bash benchmarks/gpu_check.sh --part headline --budget-s 460
#   then, only if status's budget_left_s >= 240 (the rest takes what the session's device time leaves):
#   device run, carry [".whl"], timeout_s budget_left_s - 30:  bash benchmarks/gpu_check.sh --part rest --budget-s <budget_left_s - 120>
#   WHEELS=none PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --device cpu   # the rehearsal on a CPU
#                                                         (tests/test_gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}   # WHEELS=none: use the packages installed (the rehearsal)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-outputs/gpu_check}
mkdir -p "$out"
$PYTHON benchmarks/gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
