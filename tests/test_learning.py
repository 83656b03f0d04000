"""It really learns: the embedded default improves on the held-out split. Slow (tens of seconds per run).

The gates are what the README claims for the main job (preference accuracy high, exact match rising, not just
holding), on a shorter run, each set well below the worst of seeds 0-4 measured with `scripts/seeds.py --jobs 2`
(two runs at a time, one thread each, as the parallel test workers run) on a 2-CPU AMD EPYC, torch 2.13.0+cpu,
transformers 5.23.0. The tiny model's warm start differs from one CPU to another (on this one it starts at exact
match 0.555; on the machine of the README's figures at 0.592, where DPO reached 0.951-0.965 accuracy):

- DPO, 200 steps (AdamW): held-out preference accuracy 0.912-0.934 (0.951-0.965 on the README's machine); gate
  0.85 (margin 0.06). Exact match 0.555 -> 0.717-0.742, a gain of 0.162-0.187 (0.160-0.176 there); gate +0.10
  (margin 0.06).
- SFT, 100 steps: exact match 0.555 -> 0.826-0.855, a gain of 0.271-0.300 (0.246-0.271 over seeds 0-3 on the
  README's machine); gate +0.15 (margin 0.10).

The tests run seeds 0 and 1. Regenerate:
    python scripts/seeds.py --jobs 2 --seeds 0-4 --metrics eval/rewards/accuracies eval/exact_match -- \
        hardware=cpu train.max_steps=200 train.eval_every_steps=100
    python scripts/seeds.py --jobs 2 --seeds 0-4 --metrics eval/exact_match --gate eval/exact_match=0 -- \
        hardware=cpu algo=sft train.max_steps=100 train.eval_every_steps=0
(with RLHF_CACHE pointing to an empty folder, so that the warm start is built on this machine, as a test session
builds its own).
"""

from __future__ import annotations

import json

import pytest

from rlhf import train
from tests.conftest import compose_config

pytestmark = pytest.mark.slow

SEEDS = [0, 1]


def _eval_trajectory(run_dir, key):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in lines if key in r]


@pytest.mark.parametrize("seed", SEEDS)
def test_dpo_on_the_embedded_default_learns_preferences_and_raises_exact_match(seed, tmp_path):
    metrics = train(compose_config("hardware=cpu", f"seed={seed}", "train.max_steps=200", "train.eval_every_steps=100",
                                   output_dir=tmp_path))
    exact = _eval_trajectory(tmp_path, "eval/exact_match")
    assert exact[0] > 0.3  # the SFT warm start already solves part of the task
    assert metrics["eval/rewards/accuracies"] >= 0.85
    assert metrics["eval/exact_match"] >= exact[0] + 0.10  # DPO improves the task, it does not only hold it


@pytest.mark.parametrize("seed", SEEDS)
def test_sft_on_the_embedded_default_raises_exact_match(seed, tmp_path):
    metrics = train(compose_config("hardware=cpu", f"seed={seed}", "algo=sft", "train.max_steps=100",
                                   "train.eval_every_steps=0", output_dir=tmp_path))
    exact = _eval_trajectory(tmp_path, "eval/exact_match")
    assert metrics["eval/exact_match"] >= exact[0] + 0.15
