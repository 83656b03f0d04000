"""The commands the README and the documentation's pages show, checked as `train.py` would check them: every
`train.py` command in a fenced shell block passes the command-line check (rlhf/config/command_line.py), composes,
and passes the composed config's check (check_config), so a renamed key or option fails here, not in a reader's
terminal. A sweep (`-m`) is checked at its first value of each swept key. A command that names a placeholder
(`<date>`, `<best>`) cannot be composed and is counted as not run, as is a block under an HTML comment
`<!-- examples: not run (reason) -->`. The count of commands checked is printed and asserted.

Then each checked command that can run on this machine **runs**, in this process, at tiny sizes: its overrides,
then conftest's FAST ones (the embedded model at its smallest, no warm start, 64 rows, `hardware=cpu` unless the
command names its hardware) and 2 steps, one evaluation at the end, no final save, through `rlhf.train`, and must end with finite losses. What cannot run here
is said, from the composed config, not from a list of names: a model or dataset from the Hub (no network in tests), a
checkpoint of an earlier run, a GPU, several processes (tests/hardware/ runs those options). The counts of commands run and only checked are printed
and asserted. The main command runs in CI as it is (.ci/run).

The repository's tools as the pages call them (`python scripts/<tool>.py ...`, `benchmarks/<tool>.py ...`) run up to
their argument parsing, which must pass (their work takes minutes; each tool's own test runs it). The other shell
lines (`bash scripts/setup.sh`, `make`, `pip`, `tensorboard`) are not run here: the README's two commands run in CI as
they are.

Every fenced ```python block of the same pages is run, as a reader would paste it, each in a fresh interpreter
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

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, compose_config

# The README and every page of the documentation but the configuration reference (generated from conf/: its
# comments show no command to paste)
PAGES = [ROOT / "README.md",
         *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != ROOT / "docs" / "reference" / "config.md")]
NOT_RUN = re.compile(r"<!--\s*examples:\s*not run\s*\((?P<reason>[^)]*)\)\s*-->")
PY_OVERRIDES = re.compile(r"<!--\s*examples:\s*python overrides\s+(?P<overrides>.*?)\s*-->")
PY_TIMEOUT_S = 120
PROGRESS = re.compile(r"^\s*[\w ]*:\s+\d+%\|")  # a tqdm line: "training:  33%|███ | 1/3 [...]"
TRAIN = re.compile(r"(?:^|/|\s)train\.py$")
SCRIPT = re.compile(r"(?:^|/)(?:scripts|benchmarks)/\w+\.py$")  # the repository's tools, run by path
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


@dataclass
class Command:
    page: str
    line: int
    args: list[str]
    skip: str = ""  # why it is not checked
    program: str = "train.py"  # as the page names it


def fenced_blocks(text: str, languages: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """``(first line number, code, the nearest non-blank line before the fence)`` of each fenced block in one of
    ``languages``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        marker, language, start = fence.group(2), fence.group(3).lower(), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip().startswith(marker)), len(lines))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if language in languages:
            blocks.append((start + 1, "\n".join(lines[start:end]), before))
        i = end + 1
    return blocks


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(first line number, code, reason it is not run or "")`` of each fenced bash/sh/shell block."""
    return [(first, code, skipped["reason"] if (skipped := NOT_RUN.search(before)) else "")
            for first, code, before in fenced_blocks(text, ("bash", "sh", "shell", "console"))]


def commands(text: str, page: str, program: re.Pattern = TRAIN) -> list[Command]:
    """Each invocation of ``program`` (`train.py`) in the page's shell blocks, with its arguments."""
    found = []
    for first, code, reason in shell_blocks(text):
        logical: list[tuple[int, str]] = []  # (the page's line number, a line with its continuations joined)
        for offset, line in enumerate(code.splitlines()):
            if logical and logical[-1][1].endswith("\\"):
                logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line)
            else:
                logical.append((first + offset, line))
        for number, line in logical:
            try:
                words = shlex.split(line, comments=True)
            except ValueError as error:  # a command the check cannot read must not vanish from it
                if "train.py" in line:
                    raise ValueError(f"{page}:{number}: cannot split the command ({error}): {line}") from error
                continue
            for part in " ".join(shlex.quote(w) if w not in ("&&", "||", ";", "|") else w for w in words).split(
                    " && "):
                tokens = shlex.split(part)
                at = next((k for k, token in enumerate(tokens) if program.search(token)), None)
                if at is None:
                    continue
                args = tokens[at + 1:]
                skip = reason or ("a placeholder" if re.search(r"<[^<>]+>", part) else "")
                found.append(Command(page, number, args, skip, tokens[at]))
    return found


def first_point(args: list[str]) -> list[str]:
    """``-m`` dropped and each swept key (``a=1,2``, not ``hydra.*``) at its first value, as the first job sees it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    out = []
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        if arg.startswith("hydra.") or arg.startswith("-"):
            out.append(arg)
            continue
        (override,) = OverridesParser.create().parse_overrides([arg])
        key = override.get_key_element()  # with its + and its @package
        if isinstance(override.value(), IntervalSweep):  # a search's interval: its lower end
            out.append(f"{key}={override.value().start}")
        elif override.is_sweep_override():
            out.append(f"{key}={next(iter(override.sweep_string_iterator()))}")
        else:
            out.append(arg)
    return out


def check(command: Command, tmp_path: Path) -> None:
    """What `python train.py <args>` checks before it trains; raises with the page and line on a problem."""
    from rlhf.config.checks import check_config
    from rlhf.config.command_line import missing_extra, problem

    where = f"{command.page}:{command.line}: train.py {' '.join(command.args)}"
    args = [a for a in first_point(command.args) if not a.startswith("--")]
    raw = [a for a in command.args if not a.startswith("--")]  # every value of a sweep, as train.py checks them
    message = problem(raw) or missing_extra(raw)
    assert message is None, f"{where}\n  the command-line check: {message}"
    overrides = [a for a in args if not a.startswith("hydra.")]
    try:
        check_config(compose_config(*overrides, output_dir=tmp_path))
    except Exception as error:  # noqa: BLE001  (the message names the page and line)
        raise AssertionError(f"{where}\n  {type(error).__name__}: {error}") from error


def cannot_run_here(cfg) -> str:
    """Why the composed command cannot run on a test machine ("" when it can): read from the config itself."""
    if cfg.model.get("name_or_path"):
        return f"a model from the Hub or a folder (model.name_or_path={cfg.model.name_or_path})"
    path = cfg.data.get("path")
    if path and not Path(path).exists():
        return f"a dataset from the Hub (data.path={path})"
    resume = cfg.get("resume")
    if resume not in (None, "auto") and not Path(resume).exists():
        return f"a checkpoint of an earlier run (resume={resume})"
    if cfg.hardware.get("device") == "cuda":
        return "a GPU"
    if (cfg.hardware.get("num_processes") or 2) != 1 or cfg.hardware.get("num_nodes", 1) != 1:
        return "several processes (tests/hardware/ runs each such option)"
    return ""


def run_tiny(command: Command, tmp_path: Path) -> str:
    """Run the command at tiny sizes (its first point), in this process; "" or why it cannot run here."""
    import rlhf

    overrides = [a for a in first_point(command.args) if not a.startswith(("hydra.", "--"))]
    reason = cannot_run_here(compose_config(*overrides, output_dir=tmp_path))
    if reason:
        return reason
    named = {a.split("=", 1)[0].lstrip("+") for a in overrides}
    # a group the command names stays its own (Hydra would let FAST's `hardware=cpu` win); FAST's values win
    tiny = [a for a in FAST if "." in a.split("=", 1)[0] or a.split("=", 1)[0] not in named]
    tiny += ["train.max_steps=2", "train.eval_at_start=false", "train.save_final=false"]  # one evaluation, at the end
    where = f"{command.page}:{command.line}: train.py {' '.join(command.args)}"
    try:
        metrics = rlhf.train(compose_config(*overrides, *tiny, output_dir=tmp_path))
    except Exception as error:  # noqa: BLE001  (the message names the page and line)
        raise AssertionError(f"{where}\n  at tiny sizes: {type(error).__name__}: {error}") from error
    losses = {k: v for k, v in metrics.items() if k.endswith("/loss")}
    assert losses and all(math.isfinite(v) for v in losses.values()), f"{where}\n  at tiny sizes: {metrics}"
    return ""


ALL = [c for page in PAGES if page.is_file() for c in commands(page.read_text(), str(page.relative_to(ROOT)))]


@dataclass
class PythonBlock:
    page: str
    line: int  # the page's line of the block's first line of code
    code: str
    skip: str = ""  # why it is not run
    overrides: list[str] = field(default_factory=list)  # the block's own, after FAST


def python_blocks(text: str, page: str) -> list[PythonBlock]:
    """Each fenced python block of the page, with its not-run reason and its overrides from the line before it."""
    found = []
    for first, code, before in fenced_blocks(text, ("python", "py", "python3")):
        skipped, extra = NOT_RUN.search(before), PY_OVERRIDES.search(before)
        found.append(PythonBlock(page, first, textwrap.dedent(code), skipped["reason"] if skipped else "",
                                 shlex.split(extra["overrides"]) if extra else []))
    return found


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
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    where = f"{block.page}:{block.line}: the python block"
    try:
        done = subprocess.run([sys.executable, "-c", PRELUDE, str(script), shown, *FAST, *block.overrides],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{where} ran past {PY_TIMEOUT_S} s\n{tail(error.stderr)}") from error
    if done.returncode != 0:
        raise AssertionError(f"{where} failed (exit code {done.returncode}); the end of its stderr:\n"
                             f"{tail(done.stderr)}")


def tail(stderr: str | bytes | None, lines: int = 30) -> str:
    """The last lines of a stderr, without its progress bars."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    kept = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    return "\n".join("    " + line for line in kept[-lines:])


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


PYTHON = [b for page in PAGES if page.is_file() for b in python_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def test_every_train_command_of_the_readme_and_the_guides_is_checked_or_says_why_not(tmp_path, capsys):
    checked = [c for c in ALL if not c.skip]
    only_checked, seconds = [], {}
    for index, command in enumerate(checked):
        check(command, tmp_path / str(index))
        began = time.perf_counter()
        reason = run_tiny(command, tmp_path / f"run-{index}")
        seconds[f"{command.page}:{command.line}"] = time.perf_counter() - began
        if reason:
            only_checked.append(f"{command.page}:{command.line} ({reason})")
    skipped = [c for c in ALL if c.skip]
    with capsys.disabled():
        print(f"\n{len(checked)} train.py commands checked in {len(PAGES)} pages, {len(checked) - len(only_checked)} "
              f"of them run at tiny sizes; checked only: {'; '.join(only_checked)}; {len(skipped)} not run: "
              + "; ".join(sorted({f'{c.page}:{c.line} ({c.skip})' for c in skipped})))
        slowest = sorted(seconds.items(), key=lambda item: -item[1])[:5]
        print("slowest: " + ", ".join(f"{where} {s:.1f} s" for where, s in slowest))
    assert len(checked) >= 50 and len(checked) - len(only_checked) >= 40  # 60 and 50 when written


def test_a_broken_example_fails_with_its_page_and_line(tmp_path):
    """Red on a renamed option and on a misspelt key, naming where the command is."""
    page = "```bash\npython train.py algo=dpo\npython train.py algo=nonexistent optimizer=lion\n```\n" \
           "```bash\npython train.py -m algo=dpo algo.betta=0.1,0.3\n```\n"
    good, renamed, misspelt = commands(page, "page.md")
    check(good, tmp_path / "good")
    with pytest.raises(AssertionError, match=r"(?s)page.md:3: train.py algo=nonexistent .*conf/algo/ has no option"):
        check(renamed, tmp_path / "renamed")
    with pytest.raises(AssertionError, match=r"page.md:6: train.py -m algo=dpo algo.betta=0.1,0.3"):
        check(misspelt, tmp_path / "misspelt")
    skipped = commands("<!-- examples: not run (needs a GPU) -->\n```bash\npython train.py hardware=gpu\n```\n"
                       "```bash\npython train.py model.name_or_path=<run>/final\n```\n", "p.md")
    assert [c.skip for c in skipped] == ["needs a GPU", "a placeholder"]
    continued = commands("```bash\npython train.py algo=dpo \\\n    optimizer=lion\npython train.py algo=ipo\n```\n", "c.md")
    assert [(c.line, c.args) for c in continued] == [(2, ["algo=dpo", "optimizer=lion"]), (4, ["algo=ipo"])]
    assert first_point(["-m", "algo/reward_funcs@eval=exact_match,similarity", "+x=1,2", "hydra.sweeper.n_trials=2"]) \
        == ["algo/reward_funcs@eval=exact_match", "+x=1", "hydra.sweeper.n_trials=2"]
    with pytest.raises(ValueError, match="q.md:2: cannot split the command"):
        commands("```bash\npython train.py 'algo=dpo\n```\n", "q.md")


def test_a_command_that_fails_at_tiny_sizes_fails_with_its_page_and_line(tmp_path, monkeypatch):
    """The run after the check: red when training raises or ends with a non-finite loss, naming the page and line;
    what cannot run here is said from the composed config (red if a GPU, several processes or the Hub would be
    attempted)."""
    import rlhf

    [command] = commands("```bash\npython train.py algo=dpo optimizer=lion\n```\n", "page.md")
    monkeypatch.setattr(rlhf, "train", lambda cfg: {"train/loss": float("nan")})
    with pytest.raises(AssertionError, match=r"(?s)page.md:2: train.py algo=dpo optimizer=lion.*at tiny sizes"):
        run_tiny(command, tmp_path / "nan")

    def broken(cfg):
        raise RuntimeError("shapes do not match")

    monkeypatch.setattr(rlhf, "train", broken)
    with pytest.raises(AssertionError, match=r"(?s)page.md:2: .*RuntimeError: shapes do not match"):
        run_tiny(command, tmp_path / "raises")
    reasons = [cannot_run_here(compose_config(*args, output_dir=tmp_path))
               for args in (["hardware=gpu"], ["hardware=cpu_ddp"], ["hardware=fsdp"], ["model=gpt2"],
                            ["data=ultrafeedback"], ["algo=dpo"])]
    assert reasons == ["a GPU", "several processes (tests/hardware/ runs each such option)",
                       "several processes (tests/hardware/ runs each such option)",
                       "a model from the Hub or a folder (model.name_or_path=openai-community/gpt2)",
                       "a dataset from the Hub (data.path=trl-lib/ultrafeedback_binarized)", ""]


def parse_script(command: Command) -> str:
    """Run the tool the command names up to its argument parsing; its failure's message (page, line, stderr) or ""."""
    where = f"{command.page}:{command.line}: {command.program} {' '.join(command.args)}"
    script = ROOT / command.program.split("/", 1)[-1] if command.program.startswith(".") else ROOT / command.program
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", ARGS_ONLY, str(script), *command.args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    if done.returncode != 0:
        return f"{where}\n  its arguments do not parse (exit code {done.returncode}):\n{tail(done.stderr)}"
    return ""


SCRIPTS = [c for page in PAGES if page.is_file()
           for c in commands(page.read_text(), str(page.relative_to(ROOT)), SCRIPT)]


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
