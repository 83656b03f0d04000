#!/usr/bin/env bash
# The tests that use transformers' API, run at the oldest transformers pyproject.toml allows (its floor), or at the
# version given: `bash scripts/test_at_floor.sh` (the floor), `bash scripts/test_at_floor.sh 5.3.0` (another one).
# A throwaway venv in a temporary folder sees .venv's packages behind its own (a .pth file adds .venv's
# site-packages after it), so pip installs only transformers and what that version needs in other versions
# (huggingface-hub, tokenizers); .venv is not touched. Needs the package index; prints the time it took.
# model=smollm2-135m needs a later one, the [real_model] extra's floor (transformers reads its GGUF file's end of
# turn as the tokenizer's EOS from 5.18 on): FLOOR_TESTS=tests/models/test_real_model.py bash scripts/test_at_floor.sh 5.18.0
#   FLOOR_TESTS  the test paths to run (default: below, the tests that use transformers' API on the embedded model)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
version="${1:-$(.venv/bin/python - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.fullmatch(r"transformers>=([\w.]+)", d.replace(" ", "")).group(1) for d in deps
           if d.replace(" ", "").startswith("transformers>=")))
EOF
)}"
tests="${FLOOR_TESTS:-tests/models/test_transformers_floor.py tests/models/test_decoding.py tests/models/test_generation.py
  tests/models/test_loading.py tests/models/test_attention.py tests/models/test_heads.py tests/models/test_tokenizer.py
  tests/data/test_shared_prompt.py tests/data/test_packed_pairs.py}"
folder="$(mktemp -d)"
trap 'rm -rf "$folder"' EXIT
.venv/bin/python -m venv "$folder/venv"
inside="$("$folder/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
outside="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$outside')" > "$inside/zz_rlhf_venv.pth"  # after the venv's own packages
"$folder/venv/bin/python" -m pip install -q --disable-pip-version-check "transformers==$version" 2>&1 \
  | grep -v "^WARNING: Location\|outside environment" || true
"$folder/venv/bin/python" -c "import transformers; from packaging.version import Version as V
assert V(transformers.__version__) == V('$version'), (transformers.__version__, transformers.__file__)"
echo "== transformers $version: $tests"
# shellcheck disable=SC2086  # the paths, one word each
"$folder/venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 --dist loadfile $tests
echo "== transformers $version: passed in $((SECONDS - start)) s"
