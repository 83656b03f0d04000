"""The repository's tools as the pages call them (`python scripts/<tool>.py ...`, `benchmarks/<tool>.py ...`) run up to
their argument parsing, which must pass (their work takes minutes; each tool's own test runs it). The other shell
lines (`bash scripts/setup.sh`, `make`, `pip`, `tensorboard`) are not run here: the README's two commands run in CI as
they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tests.conftest import ROOT
from tests.examples.pages import PY_TIMEOUT_S, SCRIPT, Command, commands, found, subprocess_env, tail

# Run by `python -c ARGS_ONLY <script> <args>...`: the script as __main__ up to its argument parsing, which must pass;
# then it stops (a script's work takes minutes: its own test runs it).
ARGS_ONLY = """\
import argparse
import runpy
import sys

_parse = argparse.ArgumentParser.parse_args


def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)  # exits 2 with argparse's message on an argument it does not know
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = parse_args
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def parse_script(command: Command) -> str:
    """Run the tool the command names up to its argument parsing; its failure's message (page, line, stderr) or ""."""
    where = f"{command.page}:{command.line}: {command.program} {' '.join(command.args)}"
    script = ROOT / command.program.split("/", 1)[-1] if command.program.startswith(".") else ROOT / command.program
    env = subprocess_env()
    done = subprocess.run([sys.executable, "-c", ARGS_ONLY, str(script), *command.args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    if done.returncode != 0:
        return f"{where}\n  its arguments do not parse (exit code {done.returncode}):\n{tail(done.stderr)}"
    return ""


SCRIPTS = found(partial(commands, program=SCRIPT))


def test_every_script_command_of_the_pages_parses_its_arguments_or_says_why_not(capsys):
    """The tools' commands (`scripts/*.py`, `benchmarks/*.py`) as the pages give them: the script exists and takes
    those arguments (a renamed flag fails here, naming the page and line)."""
    parsed = [c for c in SCRIPTS if not c.skip]
    with ThreadPoolExecutor(max_workers=max(1, min(len(parsed), os.cpu_count() or 1))) as pool:
        failures = [message for message in pool.map(parse_script, parsed) if message]
    skipped = [c for c in SCRIPTS if c.skip]
    with capsys.disabled():
        print(f"\n{len(parsed)} tool commands (scripts/, benchmarks/) parsed; {len(skipped)} not run: "
              + "; ".join(sorted({f"{c.page}:{c.line} ({c.skip})" for c in skipped})))
    assert not failures, "\n\n".join(failures)
    assert len(parsed) >= 5


def test_a_tool_command_with_an_unknown_flag_fails_with_its_page_and_line():
    page = "```bash\npython benchmarks/bench.py --sizes 3m\n.venv/bin/python benchmarks/bench.py --sizez 3m\n```\n"
    good, misspelt = commands(page, "page.md", SCRIPT)
    assert parse_script(good) == ""
    assert re.search(r"(?s)page.md:3: .*bench.py --sizez 3m.*do not parse.*unrecognized arguments: --sizez",
                     parse_script(misspelt))
