"""Every fenced ```python block of the same pages is run, as a reader would paste it, each in a fresh interpreter
(`sys.executable`, a 120 s limit, in parallel up to the CPU count), unless the line before it is the same
`<!-- examples: not run (reason) -->` comment (counted as not run with its reason); the counts are printed and
asserted. Where it runs:

- its folder is a fresh temporary one that stands for the repository root: it holds a link `conf` to the repository's
  conf/, so `Path("conf")` works as from a checkout, and the relative folders a block writes (`outputs/...`) land in
  the temporary folder, never in the repository;
- PYTHONPATH starts with the repository root (`import rlhf` works from a clone that is not installed), with
  HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, WANDB_MODE=offline, OMP_NUM_THREADS=1 and conftest's RLHF_CACHE (the
  session's temporary cache of warm-started models);
- tiny sizes: a prelude (PRELUDE), run before the block in the same interpreter, wraps `hydra.compose` so every
  composition appends conftest's FAST overrides (the embedded model at its smallest, no warm start, 3 steps on 64
  rows), then the block's own from a comment on the line before it,
  `<!-- examples: python overrides train.max_steps=2 algo.beta=0.2 -->` (split as a shell would; the last value of a
  key wins). `rlhf.StepTrainer([...])` composes through `hydra.compose` too. A block on another model than the
  embedded one (FAST's `model.tiny.*` keys) needs the Hub and is marked not run.

The block is compiled under its page's path, padded so that a traceback's line numbers are the page's own; a failing
block fails the test with its page, its first line and the end of its stderr."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT
from tests.examples.pages import PAGES, PY_TIMEOUT_S, PythonBlock, found, python_blocks, subprocess_env, tail

# Run by `python -c PRELUDE <script> <name to show> <override>...`: every hydra.compose call appends the overrides,
# then the script runs as __main__, compiled under the page's name.
PRELUDE = """\
import sys
import hydra

_compose, _extra = hydra.compose, sys.argv[3:]


def compose(config_name=None, overrides=None, **kwargs):
    return _compose(config_name, [*(overrides or ()), *_extra], **kwargs)


hydra.compose = sys.modules["hydra.compose"].compose = compose
script, shown = sys.argv[1:3]
sys.argv = [script]
with open(script) as file:
    code = compile(file.read(), shown, "exec")
exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})
"""


def run_python(block: PythonBlock, folder: Path, page_path: Path | None = None) -> None:
    """Run the block as PRELUDE says, in ``folder`` (made, with its `conf` link); raises with the page, the line
    and the end of stderr when it fails. ``page_path``: the file the traceback shows (default: the page)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        (folder / "conf").symlink_to(ROOT / "conf", target_is_directory=True)
    except OSError:  # no symbolic links here (Windows without the privilege): a copy
        shutil.copytree(ROOT / "conf", folder / "conf")
    script = folder / "example.py"
    script.write_text("\n" * (block.line - 1) + block.code + "\n")  # the page's line numbers in a traceback
    shown = str(page_path or ROOT / block.page)
    env = subprocess_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    where = f"{block.page}:{block.line}: the python block"
    try:
        done = subprocess.run([sys.executable, "-c", PRELUDE, str(script), shown, *FAST, *block.overrides],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{where} ran past {PY_TIMEOUT_S} s\n{tail(error.stderr)}") from error
    if done.returncode != 0:
        raise AssertionError(f"{where} failed (exit code {done.returncode}); the end of its stderr:\n"
                             f"{tail(done.stderr)}")


def run_all(blocks: list[PythonBlock], folder: Path) -> list[str]:
    """Run the blocks side by side (up to the CPU count): one entry per block run, in the pages' order, its failure's
    message or ``""``."""
    def one(index: int) -> str:
        try:
            run_python(blocks[index], folder / str(index))
        except AssertionError as error:
            return str(error)
        return ""

    with ThreadPoolExecutor(max_workers=max(1, min(len(blocks), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, range(len(blocks))))


PYTHON = found(python_blocks)


def test_every_python_block_of_the_readme_and_the_guides_runs_or_says_why_not(tmp_path, capsys):
    skipped = [b for b in PYTHON if b.skip]
    results = run_all([b for b in PYTHON if not b.skip], tmp_path)
    failures = [message for message in results if message]
    with capsys.disabled():
        print(f"\n{len(results)} python blocks run in {len(PAGES)} pages ({len(failures)} failed); {len(skipped)} not "
              "run" + "".join(f"; {b.page}:{b.line} ({b.skip})" for b in skipped))
    assert not failures, "\n\n".join(failures)
    assert 0 < len(results) == len(PYTHON) - len(skipped)


def test_a_broken_python_block_fails_with_its_page_and_line(tmp_path):
    """Red on a misspelt keyword, naming the page and the block's line; the block's overrides, the prelude's and
    the `conf` link of its folder reach it; a marked block is not run."""
    page = ("Compose:\n\n<!-- examples: python overrides train.max_steps=2 -->\n```python\n"
            "from pathlib import Path\n"
            "from hydra import compose, initialize_config_dir\n"
            "\n"
            "with initialize_config_dir(config_dir=str(Path('conf').resolve()), version_base='1.3'):\n"
            "    cfg = compose('config', overrides=['algo=sft', 'train.max_steps=100', 'output_dir=outputs/x'])\n"
            "assert (cfg.train.max_steps, cfg.model.tiny.num_layers) == (2, 1), cfg.train.max_steps\n"
            "```\n\n```python\n"
            "from hydra import compose\n"
            "\n"
            "# a misspelt keyword:\n"
            "cfg = compose('config', overides=['algo=sft'])\n"
            "```\n\n<!-- examples: not run (needs a GPU) -->\n```python\nimport nothing_here\n```\n")
    good, misspelt, gpu = python_blocks(page, "page.md")
    assert (good.line, good.overrides, misspelt.line, misspelt.overrides) == (5, ["train.max_steps=2"], 14, [])
    assert (good.skip, misspelt.skip, gpu.skip) == ("", "", "needs a GPU")
    source = tmp_path / "page.md"
    source.write_text(page)
    run_python(good, tmp_path / "good", source)
    with pytest.raises(AssertionError) as failed:
        run_python(misspelt, tmp_path / "misspelt", source)
    assert re.search(r"(?s)^page\.md:14: the python block failed \(exit code 1\).*"
                     rf'File "{re.escape(str(source))}", line 17.*compose\(.config., overides=.*'
                     r"TypeError: .*unexpected keyword argument 'overides'", str(failed.value)), str(failed.value)
