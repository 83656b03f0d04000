"""benchmarks/gpu_check/page/defaults.py: the GPU check's page says of each ``auto`` GPU default what this run's
levers measured, every option has a lever that changes it alone, and every path built but not chosen (``untried``)
a lever that turns it on: a path becomes auto's GPU choice only with a page where that lever ran."""

from __future__ import annotations

import sys

from rlhf.core.auto_choices import CHOICES
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import plan as plans  # noqa: E402
from gpu_check.page import defaults  # noqa: E402


def test_every_auto_option_has_a_lever_that_changes_it_alone_and_one_that_turns_its_untried_path_on():
    """Red when the levers that turn an option's untried path on are taken out (the Triton kernel's, say), or when the
    only lever of an option also changes another."""
    alone = {lever[5][0] for lever in plans.LEVERS if lever[5] and len(lever[5]) == 1}
    for key, choice in CHOICES.items():
        others = [o for o in alone if o.split("=", 1)[0] == key and o != f"{key}={defaults.shown(choice.gpu)}"]
        assert others, f"{key}: no lever changes it alone"
        untried = getattr(choice, "untried", None)
        if untried is not None:
            assert f"{key}={defaults.shown(untried.value)}" in alone, f"{key}: no lever turns {untried.value} on"


def _row(speed, low, high, overrides=("hardware.compile=layers",)):
    return {"lever": "compiled layers", "size": "100m", "batch": 32, "case": "dpo_bf16", "overrides": list(overrides),
            "speed": speed, "memory": 1.1, "speed_range": (low, high)}


def test_a_choice_changes_only_when_the_lever_was_faster_in_every_round():
    assert defaults.verdict(_row(1.2, 1.05, 1.3)) == ("`hardware.compile=layers` is faster in every round: make it "
                                                      "auto's GPU choice")
    assert defaults.verdict(_row(0.8, 0.7, 0.9)).startswith("auto's GPU choice is faster in every round")
    assert defaults.verdict(_row(1.1, 0.95, 1.3)).startswith("within the rounds' spread")
    combined = _row(1.3, 1.2, 1.4, overrides=("algo.padding_free=true", "algo.shared_prompt=false"))
    lines = defaults.defaults_lines([_row(1.2, 1.05, 1.3), combined])  # the second changes two options
    [compile_row] = [line for line in lines if line.startswith("| `hardware.compile`")]
    assert "compiled layers (`hardware.compile=layers`; 100m, batch 32, dpo_bf16) | 1.20 | 1.10 | " \
           "`hardware.compile=layers` is faster" in compile_row
    others = [line for line in lines if line.startswith("| `algo.")]
    assert len(others) == 3 and all("not measured in this run" in line for line in others)
