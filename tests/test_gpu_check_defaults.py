"""benchmarks/gpu_check_defaults.py: the GPU check's page says of each ``auto`` GPU default what this run's levers
measured, and every default has a lever that measures it."""

from __future__ import annotations

import sys

from rlhf.core.auto_choices import CHOICES
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check_defaults as defaults  # noqa: E402
import gpu_check_plan as plans  # noqa: E402


def test_every_gpu_default_has_a_lever_that_turns_it_off():
    assert set(defaults.TURNS_OFF) == set(CHOICES)
    alone = [lever[5] for lever in plans.LEVERS if lever[5] and len(lever[5]) == 1]
    assert all([defaults.TURNS_OFF[key]] in alone for key in CHOICES), alone


def _row(speed, low, high, overrides=("hardware.compile=false",)):
    return {"lever": "eager layers", "size": "100m", "batch": 32, "case": "dpo_bf16", "overrides": list(overrides),
            "speed": speed, "memory": 1.1, "speed_range": (low, high)}


def test_a_default_changes_only_when_turning_it_off_was_faster_in_every_round():
    assert defaults.verdict(_row(1.2, 1.05, 1.3)).startswith("the default is slower")
    assert defaults.verdict(_row(0.8, 0.7, 0.9)).startswith("the default is faster")
    assert defaults.verdict(_row(1.1, 0.95, 1.3)).startswith("within the rounds' spread")
    combined = _row(1.3, 1.2, 1.4, overrides=("algo.padding_free=true", "algo.shared_prompt=false"))
    lines = defaults.defaults_lines([_row(1.2, 1.05, 1.3), combined])  # the second changes two options
    [compile_row] = [line for line in lines if line.startswith("| `hardware.compile`")]
    assert "eager layers (100m, batch 32, dpo_bf16) | 1.20 | 1.10 | the default is slower" in compile_row
    others = [line for line in lines if line.startswith("| `algo.")]
    assert len(others) == 3 and all("not measured in this run" in line for line in others)
