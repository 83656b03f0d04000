"""The layers hold (import-linter's contract, seen to break on an upward import) and docs/architecture.md is what
scripts/architecture.py draws from the code now."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--config", str(folder / "pyproject.toml"), "--no-cache"], cwd=folder,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(folder), "PATH": ""})


def test_the_layers_hold_and_an_upward_import_breaks_them(tmp_path):
    kept = lint(ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    shutil.copytree(ROOT / "rlhf", tmp_path / "rlhf", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    loading = tmp_path / "rlhf" / "models" / "loading.py"
    loading.write_text(loading.read_text() + "\nfrom rlhf.run import loop  # noqa: E402  (an upward import)\n")
    broken = lint(tmp_path)
    assert broken.returncode != 0
    assert "rlhf.models is not allowed to import rlhf.run" in broken.stdout, broken.stdout


def test_the_architecture_page_is_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "architecture.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "architecture.md").read_text()
    for package in ("core", "data", "ops", "models", "algos", "hardware", "optim", "embedded", "telemetry", "evaluation", "run",
                    "sweeps", "config", "launch"):
        assert f"**`{package}`**" in page, f"docs/architecture.md has no paragraph on rlhf.{package}"
