"""Iterative SFT (expert iteration) through the one loop: the filter on hand values, the loss as algo=sft's on the
kept rows (and a zero loss with a graph when nothing is kept), and a short run that trains."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf import train
from rlhf.algos.iterative_sft import IterativeSFT, keep_best
from rlhf.algos.online import training_batch
from rlhf.algos.sft import SFT
from rlhf.embedded.tiny_model import TinySpec
from tests.conftest import FAST, compose_config, fast_initial_model

NAN = math.nan
# Two prompts' groups of 4: a tie (0.9, 0.9) and a NaN (no reward function applied) in the first.
REWARDS = torch.tensor([0.2, 0.9, 0.9, NAN, 1.0, 0.0, 0.5, 0.5])


@pytest.mark.parametrize(("top_k", "threshold", "kept"), [
    (None, None, [1, 1, 1, 0, 1, 1, 1, 1]),      # no filter: all but the NaN
    (1, None, [0, 1, 0, 0, 1, 0, 0, 0]),         # best-of-4; of a tie the first sampled
    (2, None, [0, 1, 1, 0, 1, 0, 1, 0]),
    (None, 0.5, [0, 1, 1, 0, 1, 0, 1, 1]),       # >= threshold, as many per prompt as pass
    (1, 0.95, [0, 0, 0, 0, 1, 0, 0, 0]),         # both: the best, if it passes; none for the first prompt
    (2, 0.5, [0, 1, 1, 0, 1, 0, 1, 0]),          # both: at most 2 per prompt of those that pass (the order of the two does not matter)
    (4, None, [1, 1, 1, 0, 1, 1, 1, 1]),         # top_k = the group: a NaN is still never kept
])
def test_keep_best_on_hand_values(top_k, threshold, kept):
    assert keep_best(REWARDS, 4, top_k, threshold).tolist() == [bool(k) for k in kept]


def _batch(algo, tokenizer, prompts, completions, keep):
    """A training micro-batch as the rollout serves it: prompts left-padded, completions (EOS included) right-padded."""
    prompt_ids = [algo.tokenize({"prompt": p}, tokenizer)["prompt_ids"] for p in prompts]
    completion_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                      for c in completions]
    left, right, pad = max(map(len, prompt_ids)), max(map(len, completion_ids)), tokenizer.pad_token_id
    samples = {
        "prompt_ids": torch.tensor([[pad] * (left - len(p)) + p for p in prompt_ids]),
        "prompt_mask": torch.tensor([[0] * (left - len(p)) + [1] * len(p) for p in prompt_ids]),
        "completion_ids": torch.tensor([c + [pad] * (right - len(c)) for c in completion_ids]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (right - len(c)) for c in completion_ids]),
        "keep": torch.tensor(keep),
    }
    return training_batch(samples)


def test_the_loss_is_sfts_on_the_kept_rows_and_zero_with_a_graph_when_none_is_kept():
    policy = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0).build()
    algo, sft = IterativeSFT(), SFT()
    algo.setup(policy.model, policy.tokenizer)
    sft.setup(policy.model, policy.tokenizer)
    prompts, completions = ["abcd=", "xy=", "hello="], ["dcba", "zz", "olleh"]
    batch = _batch(algo, policy.tokenizer, prompts, completions, [True, False, True])
    loss, metrics = algo.loss(policy.model, batch)
    rows = [sft.tokenize({"prompt": p, "completion": c}, policy.tokenizer) for p, c in zip(prompts, completions)]
    expected, _ = sft.loss(policy.model, sft.collate([rows[0], rows[2]]))
    torch.testing.assert_close(loss, expected)  # the kept rows, laid out as algo=sft lays them out
    assert float(metrics["loss"]) == pytest.approx(float(expected))
    nothing = _batch(algo, policy.tokenizer, prompts, completions, [False, False, False])
    loss, _ = algo.loss(policy.model, nothing)
    assert float(loss) == 0.0 and loss.requires_grad  # every process still steps together
    loss.backward()


def test_a_short_run_keeps_the_best_and_trains(tmp_path):
    """FAST's random-init model with the graded reward and best-of-4 (~3 s)."""
    metrics = train(compose_config(*FAST, "algo=iterative_sft", "algo/reward_funcs=similarity",
                                   "algo.keep_top_k=1", "algo.keep_threshold=null", "algo.max_completion_length=8",
                                   "algo.steps_per_generation=2", "train.eval_at_start=false", output_dir=tmp_path))
    assert metrics["train/kept_fraction"] == pytest.approx(0.25)  # one of 4 per prompt
    assert {"train/reward", "train/reward_std", "train/rewards/similarity/mean", "train/loss", "eval/reward"} \
        <= metrics.keys() and metrics["train/loss"] > 0
    from safetensors.torch import load_file

    trained, start = load_file(tmp_path / "final" / "model.safetensors"), fast_initial_model().state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in trained), "nothing trained"


@pytest.mark.slow
def test_iterative_sft_learns_on_the_embedded_task(tmp_path):
    """From the embedded SFT warm start, the held-out greedy exact match rises. Measured for this run (30 steps of
    16 prompts x 4 completions, keep the right answers, constant lr; the command in
    tests/algos/test_policy_gradient.py with algo=iterative_sft), seeds 0-4, 2-core AMD EPYC (no AVX-512), torch
    2.13.0+cpu, 2026-11-27: 0.551 -> 0.605-0.645, a rise of 0.054 at the least; the gate asks for 0.03 (margin
    0.024)."""
    from tests.algos.test_grpo import LEARNS, held_out_reward_before_and_after

    overrides = ["algo=iterative_sft", *(o for o in LEARNS if not o.startswith(("algo=", "train.max_steps="))),
                 "train.max_steps=30"]
    before, after = held_out_reward_before_and_after(tmp_path, *overrides)
    assert after >= before + 0.03, (before, after)
