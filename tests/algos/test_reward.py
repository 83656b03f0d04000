import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf import train
from rlhf.algos.reward import Reward, bradley_terry_loss, centering_penalty
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import FAST, compose_config


def test_bradley_terry_loss_matches_hand_computed_values():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    # -log sigmoid(x) = log(1 + exp(-x))
    expected = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(2.0))]
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-6)
    # Llama 2's margin: the chosen reward must beat the rejected one by the margin.
    with_margin = bradley_terry_loss(chosen, rejected, torch.tensor([0.5, -1.0]))
    assert with_margin.tolist() == pytest.approx([math.log1p(math.exp(-0.5)), math.log1p(math.exp(1.0))], rel=1e-6)


def test_equal_rewards_give_log_2():
    rewards = torch.tensor([0.3, -2.0, 5.0])
    assert bradley_terry_loss(rewards, rewards).tolist() == pytest.approx([math.log(2)] * 3, rel=1e-6)


def test_centering_penalty_is_the_mean_squared_pair_sum():
    assert centering_penalty(torch.tensor([1.0, -1.0]), torch.tensor([2.0, 1.0])).item() == pytest.approx(4.5)


class _FirstTokenReward(torch.nn.Module):
    """A stand-in reward model: each sequence's reward is its first token id."""

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=input_ids[:, :1].float())


def test_reward_loss_adds_margin_and_centering_from_the_rows():
    tok = byte_tokenizer()
    algo = Reward(center_rewards_coefficient=0.1)
    algo.setup(None, tok)
    rows = [algo.tokenize({"prompt": "", "chosen": c, "rejected": r, "margin": m}, tok)
            for c, r, m in (("\x03", "\x01", 1.0), ("\x01", "\x02", 0.0))]
    batch = algo.collate(rows)
    # With add_special_tokens the tiny tokenizer adds nothing: the first token is the completion's first byte.
    loss, metrics = algo.loss(_FirstTokenReward(), batch)
    bt = (math.log1p(math.exp(-(3 - 1 - 1.0))) + math.log1p(math.exp(-(1 - 2)))) / 2
    assert loss.item() == pytest.approx(bt + 0.1 * ((3 + 1) ** 2 + (1 + 2) ** 2) / 2, rel=1e-6)
    assert metrics["accuracy"].item() == 0.5 and metrics["margin"].item() == pytest.approx(0.5)
    assert metrics["min_reward"].item() == 1 and metrics["max_reward"].item() == 3


def test_at_init_with_equal_rewards_the_loss_is_log_2():
    cfg = compose_config("algo=reward", *FAST)
    policy = build(cfg.model)
    torch.nn.init.zeros_(policy.model.score.weight)  # every reward 0
    algo = build(cfg.algo)
    algo.setup(policy.model, policy.tokenizer)
    rows = [algo.tokenize({"prompt": "ab=", "chosen": "ba", "rejected": "ab"}, policy.tokenizer)] * 2
    loss, metrics = algo.loss(policy.model, algo.collate(rows))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6) and metrics["accuracy"].item() == 0


def test_a_model_with_another_head_is_refused_with_the_fix():
    cfg = compose_config("algo=reward", "model.head=causal_lm", *FAST)
    policy = build(cfg.model)
    algo = build(cfg.algo)
    algo.setup(policy.model, policy.tokenizer)
    rows = [algo.tokenize({"prompt": "ab=", "chosen": "ba", "rejected": "ab"}, policy.tokenizer)]
    with pytest.raises(UserError, match="model.head=sequence_classification"):
        algo.loss(policy.model, algo.collate(rows))
    with pytest.raises(UserError, match="algo.head=sequence_classification"):
        check_config(compose_config("algo=reward", "algo.head=causal_lm", *FAST))


def test_a_short_run_saves_a_reward_model_that_loads_and_scores(tmp_path):
    metrics = train(compose_config("algo=reward", *FAST, output_dir=tmp_path))
    assert {"eval/accuracy", "eval/loss", "eval/margin", "train/accuracy"} <= metrics.keys()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    batch = tokenizer(["ab=ba<eos>", "abc=cb<eos>"], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = model(**batch).logits
    assert scores.shape == (2, 1) and torch.isfinite(scores).all()


def test_the_margin_column_of_a_data_file_reaches_the_loss(tmp_path):
    """A margin of 50 on every pair: the held-out loss -log sigmoid(r_chosen - r_rejected - 50) is about 50 (a fresh
    head's reward differences are small); without the column reaching the loss it would be about log 2."""
    path = tmp_path / "margins.csv"
    path.write_text("prompt,chosen,rejected,margin\n" + "".join(f"{w}=,{w[::-1]},{w},50\n" for w in
                                                                   ["abc", "de", "fgh", "ij", "klm", "no", "pqr", "st"]))
    metrics = train(compose_config("algo=reward", *FAST, f"data.path={path}", "data.eval_size=4", "train.max_steps=0",
                                   output_dir=tmp_path / "run"))
    assert metrics["eval/loss"] == pytest.approx(50, abs=5)
