"""It really learns: the embedded default improves on the held-out split. Slow (tens of seconds)."""

from __future__ import annotations

import pytest

from rlhf import train
from tests.conftest import compose_config

pytestmark = pytest.mark.slow


def _eval_trajectory(run_dir, key):
    import json

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in lines if key in r]


def test_dpo_on_the_embedded_default_learns_preferences_without_collapse(tmp_path):
    metrics = train(compose_config("hardware=cpu", "train.max_steps=200", "train.eval_every_steps=100",
                                   output_dir=tmp_path))
    accuracy = _eval_trajectory(tmp_path, "eval/rewards/accuracies")
    exact = _eval_trajectory(tmp_path, "eval/exact_match")
    assert accuracy[0] < 0.1  # at step 0 the policy is the reference: every implicit reward ties at 0
    assert metrics["eval/rewards/accuracies"] >= 0.85
    assert exact[0] > 0.3  # the SFT warm start already solves part of the task
    assert metrics["eval/exact_match"] >= exact[0] - 0.05  # and DPO does not destroy it


def test_sft_on_the_embedded_default_raises_exact_match(tmp_path):
    metrics = train(compose_config("hardware=cpu", "algo=sft", "train.max_steps=100", "train.eval_every_steps=0",
                                   output_dir=tmp_path))
    exact = _eval_trajectory(tmp_path, "eval/exact_match")
    assert metrics["eval/exact_match"] >= exact[0] + 0.2
