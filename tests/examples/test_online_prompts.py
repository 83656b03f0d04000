"""docs/how-to/your-data.md's prompts for an online algorithm, run as the page writes them: its JSON lines (repeated,
so that some are held out), its reward function and the option naming it written where their first lines say, in a
folder of one's own, and its command run there at tiny sizes (conftest's FAST, 2 steps). About 40 s."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import FAST, ROOT
from tests.examples.pages import fenced_blocks

PAGE = ROOT / "docs" / "how-to" / "your-data.md"
START, END = "**Prompts for an online algorithm.**", "Data whose columns have other names"


def recipe(folder: Path) -> list[str]:
    """The page's files written under ``folder`` (a block's first line names its path, from ``my_project/``); returns
    the arguments of its ``train.py`` command."""
    text = PAGE.read_text()
    section = text[text.index(START):text.index(END)]
    [(_, rows, _)] = fenced_blocks(section, ("json",))
    (folder / "my_project").mkdir()
    for _, code, _ in fenced_blocks(section, ("python", "yaml")):
        path = next(line.split()[1].rstrip(",") for line in code.splitlines() if line.startswith("# my_project/"))
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(code + "\n")
    [(_, command, _)] = fenced_blocks(section, ("bash",))
    words = shlex.split(command.replace("\\\n", " "))
    data = folder / "my_project" / next(w.split("=", 1)[1] for w in words if w.startswith("data.path="))
    data.write_text("".join(f"{line}\n" for line in rows.splitlines() * 20))
    assert all("answer" in json.loads(line) for line in rows.splitlines())
    return words[words.index(next(w for w in words if w.endswith("train.py"))) + 1:]


def run(folder: Path, args: list[str]) -> subprocess.CompletedProcess:
    tiny = [o for o in FAST if not o.startswith("data.task.")]
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *tiny, "train.max_steps=2",
                           "algo.num_generations=2", "train.per_device_batch_size=2", "train.save_final=false",
                           f"hydra.run.dir={folder / 'run'}"], cwd=folder / "my_project", capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def test_the_pages_prompt_file_and_reward_column_train_grpo(tmp_path):
    """The command trains, the reward function getting the rows' `answer` (it takes it without a default: a run
    without it stops, red below) in training and held-out evaluation; without `algo.reward_columns=[answer]` the
    function is called without it, and the error says what it was called with (as the page says)."""
    args = recipe(tmp_path)
    assert "algo=grpo" in args and "algo.reward_columns=[answer]" in args
    done = run(tmp_path, args)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/rewards/answer/mean" in line for line in logged) == 2
    assert any("eval/rewards/answer/mean" in line for line in logged)
    (tmp_path / "run").rename(tmp_path / "first")
    without = run(tmp_path, [a for a in args if not a.startswith("algo.reward_columns=")])
    assert without.returncode == 1
    assert "missing 1 required positional argument: 'answer'" in without.stderr
    assert "It is called as fn(prompts=[...], completions=[...])" in without.stderr
