"""KTO (rlhf.algos.kto): the loss against hand-computed values, the KL estimate from mismatched pairs, the value at
initialization, and short runs from paired and from unpaired data."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rlhf import train
from rlhf.algos.kto import KL, KTO, kl_estimate, kto_loss
from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import ROOT


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_matches_hand_computed_values():
    logratios, desirable = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([True, False, False])
    got = kto_loss(logratios, desirable, torch.tensor(0.3), beta=0.5, desirable_weight=1.5, undesirable_weight=0.7)
    want = [1.5 * (1 - sig(0.5 * (1.0 - 0.3))), 0.7 * (1 - sig(0.5 * (0.3 + 2.0))), 0.7 * (1 - sig(0.5 * (0.3 - 0.5)))]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_kl_estimate_is_the_mean_mismatched_log_ratio_floored_at_zero_without_gradient():
    values = torch.tensor([0.5, 1.5, -0.5], requires_grad=True)
    kl = kl_estimate(values)
    assert kl.item() == pytest.approx(0.5) and not kl.requires_grad
    assert kl_estimate(torch.tensor([-1.0, 0.2])).item() == 0.0


def _setup(rows, **kwargs):
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    algo = KTO(reference=FrozenCopy(), **kwargs)
    algo.setup(policy.model, policy.tokenizer)
    return policy, algo, algo.collate([algo.tokenize(r, policy.tokenizer) for r in rows])


ROWS = [{"prompt": "abc=", "completion": "cba", "label": True}, {"prompt": "hello=", "completion": "hlo", "label": False},
        {"prompt": "xy=", "completion": "yx", "label": True}]


def test_collate_pairs_each_prompt_with_the_completion_of_the_row_before():
    policy, algo, batch = _setup(ROWS)
    eos = policy.tokenizer.eos_token_id
    assert batch["label"].tolist() == [True, False, True]
    assert batch["input_ids"][1].tolist()[:10] == list(b"hello=hlo") + [eos]
    mismatched = [row[mask.bool()].tolist() for row, mask in zip(batch[KL + "input_ids"], batch[KL + "attention_mask"])]
    assert mismatched == [list(b"abc=yx") + [eos], list(b"hello=cba") + [eos], list(b"xy=hlo") + [eos]]
    assert batch[KL + "completion_mask"][1].tolist()[:10] == [0] * 6 + [1] * 4


def test_at_initialization_the_kl_is_zero_and_the_loss_is_half_the_mean_weight():
    """Policy = reference: every log-ratio is 0, so each row's loss is its weight x (1 - sigmoid(0))."""
    _, algo, batch = _setup(ROWS, desirable_weight=1.0, undesirable_weight=2.0)
    loss, metrics = algo.loss(algo.ref_model, batch)
    assert metrics["kl"].item() == 0.0 and metrics["rewards/margins"].item() == pytest.approx(0.0, abs=1e-6)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 1.0) / 3 * 0.5, rel=1e-6)


def test_the_loss_is_kto_of_the_log_ratios_with_the_mismatched_pairs_kl():
    policy, algo, batch = _setup(ROWS, beta=0.5)
    with torch.no_grad():  # move the policy away from the reference
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    loss, metrics = algo.loss(policy.model, batch)
    from rlhf.ops.completion_logps import completion_stats

    def logratios(sub):
        return completion_stats(policy.model, sub).logps - completion_stats(algo.ref_model, sub).logps

    mismatched = {k.removeprefix(KL): v for k, v in batch.items() if k.startswith(KL)}
    kl = max(0.0, logratios(mismatched).mean().item())
    r = logratios(batch).tolist()
    want = [(1 - sig(0.5 * (r[0] - kl))), (1 - sig(0.5 * (kl - r[1]))), (1 - sig(0.5 * (r[2] - kl)))]
    assert metrics["kl"].item() == pytest.approx(kl, rel=1e-5, abs=1e-7)
    assert loss.item() == pytest.approx(sum(want) / 3, rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in policy.model.parameters() if p.requires_grad)


def test_a_training_micro_batch_of_one_row_is_refused_with_the_fix():
    _, algo, batch = _setup(ROWS[:1])
    with pytest.raises(UserError, match="per_device_batch_size=2"):
        algo.loss(algo.ref_model, batch)
    algo.evaluate(algo.ref_model, batch)  # a held-out batch of one row is allowed (TRL evaluates those too)


def test_kto_trains_on_the_embedded_pairs_split_into_rows(fast_config):
    metrics = train(fast_config("algo=kto", "train.max_steps=2", "data.task.num_train=8", "data.task.num_eval=4"))
    assert math.isfinite(metrics["train/loss"]) and metrics["eval/loss"] == pytest.approx(0.5, abs=0.05)
    assert "eval/kl" in metrics and "eval/rewards/margins" in metrics


def test_kto_trains_on_unpaired_rows_of_a_file(fast_config, tmp_path):
    """A few steps on unpaired rows of a file: the held-out loss the run logs at the end is KTO's (Ethayarajh et al.
    2024, eq. 7) on log-probabilities computed here, each held-out row and each mismatched pair (a row's prompt with
    the completion of the row before it) through the final policy and through the reference (algo/reference=copy:
    the initial policy). No evaluation at the start, so that the one at the end runs the reference rather than
    reading values kept from the start. The policy trains far enough from its reference that a flipped sign, swapped
    labels or a reference equal to the policy would give another loss."""
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM

    from tests.conftest import fast_initial_model
    from tests.independent_logps import answer_logps, kto_losses, mean

    path = tmp_path / "unpaired.jsonl"
    rows = [{"prompt": f"{w}=", "completion": w[::-1] if i % 3 else w, "label": bool(i % 3)}
            for i, w in enumerate(["abc", "de", "fgh", "ij", "klm", "no", "pqr", "st", "uvw", "xy"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = fast_config("algo=kto", f"data.path={path}", "data.eval_size=4", "train.max_steps=3", "optimizer.lr=1e-2",
                      "scheduler=constant", "scheduler.num_warmup_steps=0", "train.eval_at_start=false")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"])
    held_out = instantiate(cfg.data).load_raw(["prompt", "completion", "label"])["eval"]  # one batch, in this order
    assert len(held_out) == 4 <= cfg.train.eval_batch_size
    prompts, completions, labels = held_out["prompt"], held_out["completion"], held_out["label"]
    assert 0 < sum(labels) < len(labels)  # both kinds of rows
    mismatched = completions[-1:] + completions[:-1]  # prompt i with completion i - 1
    reference, trained = fast_initial_model(), AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    tokenizer, beta = byte_tokenizer(), cfg.algo.beta
    r, kl = ([p - q for p, q in zip(answer_logps(trained, tokenizer, prompts, c),
                                    answer_logps(reference, tokenizer, prompts, c))] for c in (completions, mismatched))
    expected = mean(kto_losses(r, labels, kl, beta))
    assert metrics["eval/loss"] == pytest.approx(expected, abs=1e-5)
    flipped = mean(kto_losses(r, [not label for label in labels], kl, beta))  # a flipped sign, or swapped labels
    apart = {"flipped": abs(flipped - expected), "at_reference": abs(0.5 - expected)}  # 0.5: every log-ratio 0
    assert min(apart.values()) > 1e-3, f"a broken loss would be within {apart} of the right one: the test cannot fail"


def test_a_reference_of_precomputed_rows_only_is_refused_before_anything_loads():
    """The mismatched pairs exist per micro-batch: a cache of the rows' own sequences cannot score them."""
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    with pytest.raises(UserError, match="Fix: algo/reference=copy"):
        check_config(compose_config("algo=kto", "algo/reference=precomputed"))
    check_config(compose_config("algo=kto", "algo/reference=shared_layers"))


@pytest.mark.serial
def test_a_one_row_held_out_batch_under_fsdp_ends(tmp_path):
    """Three held-out rows in batches of 2 on 2 processes: rank 0 evaluates rows 0-1, rank 1 row 2 alone, whose
    mismatched pair (prompt i, completion i - 1) is the row itself, so its reference values are already kept when
    they are asked for again. Under FSDP2 the reference's forward pass is a collective: rank 1 must run it too, or
    rank 0 waits in it until the collective timeout (it did before every process agreed on hit or miss)."""
    path = tmp_path / "unpaired.jsonl"
    rows = [{"prompt": f"{w}=", "completion": w[::-1] if i % 3 else w, "label": bool(i % 3)}
            for i, w in enumerate(["abc", "de", "fgh", "ij", "klm", "no", "pqr", "st", "uvw", "xy", "zab", "cd"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = tmp_path / "run"
    overrides = ["algo=kto", "hardware=fsdp", "hardware.timeout_s=30", f"data.path={path}", "data.eval_size=3",
                 "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
                 "model.tiny.intermediate_size=64", "model.tiny.warm_start_steps=0", "train.max_steps=1",
                 "train.per_device_batch_size=2", "train.eval_batch_size=2", "train.eval_every_steps=0",
                 # the evaluation after a training step: at the start, the untrained policy's values need no reference
                 "train.eval_at_start=false", "train.save_every_steps=0", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    final = json.loads((run / "summary.json").read_text())["final"]
    assert math.isfinite(final["eval/loss"]) and math.isfinite(final["eval/kl"])
