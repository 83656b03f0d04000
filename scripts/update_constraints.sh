#!/usr/bin/env bash
# Rewrite constraints.txt from the packages installed in .venv, after a deliberate upgrade:
#   .venv/bin/python -m pip install -U transformers && bash scripts/update_constraints.sh && make test
# torch is left out (scripts/setup.sh installs it first, from TORCH_SPEC, the build for your hardware), and so are
# the packages that come with a CUDA build of torch (nvidia-*, triton) and rlhf itself.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Versions that scripts/setup.sh installs (pip install -c constraints.txt): the set the tests and the README's"
  echo "# figures were run with. Regenerate with scripts/update_constraints.sh; see docs/reproducibility.md."
  echo "# Written from $(.venv/bin/python -c 'import platform; print("Python", platform.python_version())'), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')."
  # A package installed from a file or URL ("name @ file:///...") names a path other machines lack: pin it by version.
  .venv/bin/python -m pip freeze --exclude-editable \
    | grep -v -E '^(#|-e )' \
    | sed -E 's/^([A-Za-z0-9_.-]+) @ .*/\1/' \
    | while read -r line; do
        case "$line" in
          *==*) echo "$line" ;;
          *) echo "$line==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$line'))")" ;;
        esac
      done \
    | grep -v -i -E '^(torch|triton|nvidia-[a-z0-9-]+|rlhf)=='
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "wrote constraints.txt: $(grep -c '==' constraints.txt) pinned packages"
