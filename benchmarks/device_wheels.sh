#!/usr/bin/env bash
# The wheels the GPU check needs on a machine that has torch, transformers, accelerate and peft but cannot reach a
# package index (the lent GPU machine: Python 3.12, x86-64): the packages it lacks (hydra-core, omegaconf and its
# parser runtime, the submitit launcher plugin that Hydra's plugin scan imports from hydra_plugins/, datasets and
# what it needs beyond that machine's packages, TRL, Liger-Kernel, DeepSpeed and the small packages it imports,
# pydantic among them), and
# the versions of transformers, tokenizers, peft and fsspec that this repository is tested with (constraints.txt), so that the GPU runs the code CI runs.
# huggingface_hub stays that machine's (1.33 when last read; ours needs httpx2, which it lacks: transformers and
# datasets take >= 1.31). Into .whl/ (ignored by git), about 23 MB; benchmarks/gpu_check.sh installs them there.
#
#   bash benchmarks/device_wheels.sh            # then carry .whl with the call that runs benchmarks/gpu_check.sh
#   WITH_PYARROW=1 bash benchmarks/device_wheels.sh   # also pyarrow (+40 MB), should that machine's be too old
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
LIGER_VERSION=0.8.5
PACKAGES="hydra-core omegaconf hydra-submitit-launcher submitit datasets dill multiprocess trl transformers tokenizers peft fsspec"
[ -n "${WITH_PYARROW:-}" ] && PACKAGES="$PACKAGES pyarrow"
pin() {  # the version constraints.txt pins
  local name=$1 line
  line=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt) || { echo "no pin for $name in constraints.txt" >&2; exit 2; }
  echo "$line"
}
pins() {  # the pins of the packages named, one a line; a missing pin stops the script (not hidden inside $(...))
  local p
  for p in "$@"; do pin "$p" >/dev/null || exit 2; done
  for p in "$@"; do pin "$p"; done
}
DEEPSPEED_NEEDS="hjson py-cpuinfo ninja msgpack einops pydantic pydantic_core annotated-types typing-inspection"
pins $PACKAGES $DEEPSPEED_NEEDS deepspeed antlr4-python3-runtime >/dev/null  # every pin first: stop before downloading
specs=$(pins $PACKAGES)
DEEPSPEED_SPECS=$(pins $DEEPSPEED_NEEDS)
rm -rf .whl && mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude; }
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $specs
# Liger-Kernel (not a dependency: the GPU check compares our output layer's tiles with its fused linear cross
# entropy, and runs TRL with use_liger_kernel=True; Triton is on that machine)
$PIP download -q --no-deps --only-binary=:all: -d .whl "liger-kernel==$LIGER_VERSION"
# DeepSpeed (an optional extra: the check runs hardware=zero3 on one GPU) is a source distribution only: its wheel is
# built here (pure Python; its CUDA ops are compiled on first use, and the check uses none), with the small packages
# it imports that the GPU machine may lack (pydantic: DeepSpeed's config classes)
$PIP wheel -q --no-deps -w .whl "$(pin deepspeed)"
# shellcheck disable=SC2046
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d .whl $DEEPSPEED_SPECS
# omegaconf's parser runtime has no wheel on the index: build one (pure Python)
$PIP wheel -q --no-deps -w .whl "$(pin antlr4-python3-runtime)"
ls .whl
du -sh .whl
