"""The pages whose examples the tests in this folder run, and how an example is found in them: fenced blocks,
the `train.py` and tool commands of shell blocks (continuations joined, a sweep at its first point), the Python
blocks, and the HTML comments beside a block (`<!-- examples: not run (reason) -->`,
`<!-- examples: python overrides k=v ... -->`)."""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from dataclasses import dataclass, field

from tests.conftest import ROOT

# The README and every page of the documentation but the configuration reference (generated from conf/: its
# comments show no command to paste)
PAGES = [ROOT / "README.md",
         *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != ROOT / "docs" / "reference" / "config.md")]


NOT_RUN = re.compile(r"<!--\s*examples:\s*not run\s*\((?P<reason>[^)]*)\)\s*-->")


PY_OVERRIDES = re.compile(r"<!--\s*examples:\s*python overrides\s+(?P<overrides>.*?)\s*-->")


PY_TIMEOUT_S = 120  # seconds a Python block or a tool's argument parsing may take
PROGRESS = re.compile(r"^\s*[\w ]*:\s+\d+%\|")  # a tqdm line: "training:  33%|███ | 1/3 [...]"


TRAIN = re.compile(r"(?:^|/|\s)train\.py$")


SCRIPT = re.compile(r"(?:^|/)(?:scripts|benchmarks)/\w+\.py$")  # the repository's tools, run by path


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


def tail(stderr: str | bytes | None, lines: int = 30) -> str:
    """The last lines of a stderr, without its progress bars."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    kept = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    return "\n".join("    " + line for line in kept[-lines:])


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH (`import rlhf` from a clone not installed)."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, **extra, "PYTHONPATH": path}


def found(kind) -> list:
    """``kind(text, page)`` over every page: the examples of that kind, in the pages' order."""
    return [e for page in PAGES if page.is_file() for e in kind(page.read_text(), str(page.relative_to(ROOT)))]

