"""A reward model saved by algo=reward as a reward function (rlhf.algos.reward_funcs.RewardModel): its scores are the saved
model's own outputs on prompt + completion tokenized as algo=reward tokenizes, in a GRPO run; a missing or wrong
folder is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf import train
from rlhf.algos.reward_funcs import RewardModel
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from tests.conftest import FAST, compose_config


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory) -> Path:
    """A tiny reward model trained for 2 steps (~2 s)."""
    run = tmp_path_factory.mktemp("reward") / "run"
    train(compose_config("algo=reward", *FAST, "train.max_steps=2", "train.eval_at_start=false", output_dir=run))
    return run


def _own_scores(folder: Path, prompts: list[str], completions: list[str]) -> list[float]:
    """The saved model's outputs, one sequence at a time (no padding): tokenizer specials on the prompt, the
    completion without them, EOS after it (as algo=reward tokenized chosen and rejected)."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids = tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"] \
                + [tokenizer.eos_token_id]
            scores.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return scores


def test_a_grpo_run_is_rewarded_by_the_saved_reward_models_own_scores(reward_run, tmp_path):
    """~4 s: 3 GRPO steps whose reward is the reward model (batches of 3, padded); every sampled completion written
    to samples.jsonl carries the score the model gives it alone."""
    final = reward_run / "final"
    metrics = train(compose_config(
        *FAST, "algo=grpo", "algo/reward_funcs=reward_model", f"algo.reward_funcs.reward_model.path={final}",
        "algo.reward_funcs.reward_model.batch_size=3", "algo.num_generations=4", "algo.max_completion_length=8",
        "algo.num_completions_to_print=16", "train.eval_at_start=false", output_dir=tmp_path))
    assert "train/rewards/reward_model/mean" in metrics and "eval/reward" in metrics
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and len({line["completion"] for line in lines}) > 1
    own = _own_scores(final, [line["prompt"] for line in lines], [line["completion"] for line in lines])
    assert [line["reward"] for line in lines] == pytest.approx(own, abs=1e-5)
    assert len(set(own)) > 1  # different texts, different scores: not a constant


def test_called_directly_it_loads_once_in_eval_mode_on_the_callers_device(reward_run):
    scorer = RewardModel(str(reward_run / "final"), batch_size=2)
    assert scorer.model is None  # nothing is read until the first call
    prompts, completions = ["abc=", "hello=", "xy="], ["cba", "olleh", "yx and more"]
    assert scorer(prompts, completions) == pytest.approx(_own_scores(reward_run / "final", prompts, completions),
                                                         abs=1e-5)
    model = scorer.model
    scorer(prompts[:1], completions[:1])
    assert scorer.model is model and not model.training and scorer.device == "cpu"
    assert not any(p.requires_grad for p in model.parameters())


def test_a_missing_path_or_a_run_folder_is_refused_with_the_fix(reward_run, tmp_path):
    with pytest.raises(UserError, match=r"algo.reward_funcs.reward_model.path=<value>"):
        check_config(compose_config(*FAST, "algo=grpo", "algo/reward_funcs=reward_model"))
    with pytest.raises(UserError, match=rf"Fix: algo.reward_funcs.reward_model.path={reward_run}/final"):
        check_config(compose_config(*FAST, "algo=grpo", "algo/reward_funcs=reward_model",
                                    f"algo.reward_funcs.reward_model.path={reward_run}"))
    with pytest.raises(UserError, match="no such folder.*Fix: algo.reward_funcs.reward_model.path=<run dir>/final"):
        check_config(compose_config(*FAST, "algo=iterative_sft", "algo/reward_funcs=reward_model",
                                    f"algo.reward_funcs.reward_model.path={tmp_path}/nowhere"))
