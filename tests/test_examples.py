"""The commands the README and the documentation's guides show, checked as `train.py` would check them: every
`train.py` command in a fenced shell block passes the command-line check (rlhf/config/command_line.py), composes,
and passes the composed config's check (check_config), so a renamed key or option fails here, not in a reader's
terminal. A sweep (`-m`) is checked at its first value of each swept key. A command that names a placeholder
(`<date>`, `<best>`) cannot be composed and is counted as not run, as is a block under an HTML comment
`<!-- examples: not run (reason) -->`. The count of commands checked is printed and asserted.

Running every command for real would take minutes each; the main command runs in CI as it is (.ci/run), and the
guides' runs are the tests of their own parts."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose_config

PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", *sorted((ROOT / "docs" / "how-to").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*examples:\s*not run\s*\((?P<reason>[^)]*)\)\s*-->")
TRAIN = re.compile(r"(?:^|/|\s)train\.py$")


@dataclass
class Command:
    page: str
    line: int
    args: list[str]
    skip: str = ""  # why it is not checked


def shell_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(first line number, code, reason it is not run or "")`` of each fenced bash/sh/shell block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        marker, language, start = fence.group(2), fence.group(3).lower(), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip().startswith(marker)), len(lines))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skipped = NOT_RUN.search(before)
        if language in ("bash", "sh", "shell", "console"):
            blocks.append((start + 1, "\n".join(lines[start:end]), skipped["reason"] if skipped else ""))
        i = end + 1
    return blocks


def commands(text: str, page: str) -> list[Command]:
    """Each `train.py` invocation of the page's shell blocks, with its arguments."""
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
                at = next((k for k, token in enumerate(tokens) if TRAIN.search(token)), None)
                if at is None:
                    continue
                args = tokens[at + 1:]
                skip = reason or ("a placeholder" if re.search(r"<[^<>]+>", part) else "")
                found.append(Command(page, number, args, skip))
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


ALL = [c for page in PAGES if page.is_file() for c in commands(page.read_text(), str(page.relative_to(ROOT)))]


def test_every_train_command_of_the_readme_and_the_guides_is_checked_or_says_why_not(tmp_path, capsys):
    checked = [c for c in ALL if not c.skip]
    for index, command in enumerate(checked):
        check(command, tmp_path / str(index))
    skipped = [c for c in ALL if c.skip]
    with capsys.disabled():
        print(f"\n{len(checked)} train.py commands checked in {len(PAGES)} pages; {len(skipped)} not run: "
              + "; ".join(sorted({f'{c.page}:{c.line} ({c.skip})' for c in skipped})))
    assert len(checked) >= 20


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
