"""Smoke tests of the one loop: every algorithm x optimizer trains a few steps on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf import train
from rlhf.algos.dpo import DPO
from rlhf.core.errors import UserError
from tests.conftest import CONF, fast_initial_model


def _one_option_per_algorithm() -> list[str]:
    """One conf/algo option per algorithm class (``dpo`` for DPO): the DPO loss variants differ only in their loss,
    and tests/algos/test_dpo_losses.py trains each of them."""
    by_class: dict[str, str] = {}
    for path in sorted((CONF / "algo").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        if target is None:  # a DPO loss variant: algo=dpo with another algo/loss option
            continue
        if target not in by_class or path.stem == target.split(".")[-2]:
            by_class[target] = path.stem
    return sorted(by_class.values())


ALGOS = _one_option_per_algorithm()
OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml"))
# Online algorithms on the random-init model: a graded reward, so that the completions' rewards differ from the start.
POLICY_GRADIENT = ["algo/reward_funcs=similarity", "algo.num_generations=4", "algo.max_completion_length=8"]
ONLINE = {"grpo": POLICY_GRADIENT, "rloo": POLICY_GRADIENT, "reinforce_pp": POLICY_GRADIENT, "ppo": POLICY_GRADIENT,
          "iterative_sft": ["algo/reward_funcs=similarity", "algo.keep_top_k=1", "algo.keep_threshold=null",
                            "algo.max_completion_length=8"]}  # best-of-4: something is kept from the start


# Every algorithm with two optimizers (the default and one without moments), and every optimizer with an offline and
# an online algorithm: the two components meet only through the parameter groups, so the full cross (~170 runs)
# would add CI minutes and no new meeting.
PAIRS = sorted({*((algo, optimizer) for algo in ALGOS for optimizer in ("adamw", "sgd")),
                *((algo, optimizer) for algo in ("dpo", "grpo") for optimizer in OPTIMIZERS)})
# PSGD-Kron's preconditioner starts at a small scale: at its default lr (3e-5) three steps move the post-attention
# norm's weights (1.0) by less than float32's spacing there (6e-8; measured: unchanged); at AdamW's 1e-4 every
# tensor moves. The test asks whether every tensor trains, not how fast a default starts.
SLOW_START = {"psgd_kron": ["optimizer.lr=1e-4"]}


@pytest.mark.parametrize(("algo", "optimizer"), PAIRS)
def test_every_algo_and_optimizer_trains(algo, optimizer, fast_config, tmp_path):
    cfg = fast_config(f"algo={algo}", f"optimizer={optimizer}", *ONLINE.get(algo, []), *SLOW_START.get(optimizer, []))
    initial = fast_initial_model()
    metrics = train(cfg)
    held_out = f"eval/{get_class(cfg.algo._target_).eval_metrics[0]}"  # eval/loss; an online algorithm's eval/reward
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics[held_out])
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    changed = [not torch.equal(a, b) for a, b in zip(initial.parameters(), final.parameters())]
    assert all(changed), "every trainable tensor should have moved"


def test_run_folder_has_metrics_final_model_and_summary(fast_config, tmp_path):
    metrics = train(fast_config("algo=dpo"))
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "eval/rewards/accuracies" in lines[0]
    train_lines = [r for r in lines if "train/loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3]
    for key in ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"]:
        assert f"train/{key}" in train_lines[-1] and f"eval/{key}" in lines[-1]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/peak_mem_mb"} <= set(train_lines[-1])
    peak = json.loads((run / "summary.json").read_text())["final"]["perf/peak_mem_mb"]
    assert math.isfinite(peak) and peak >= max(r["perf/peak_mem_mb"] for r in train_lines)  # the run's peak so far
    assert AutoTokenizer.from_pretrained(run / "final")("ab")["input_ids"] == [97, 98]
    assert json.loads((run / "summary.json").read_text())["final"]["eval/loss"] == pytest.approx(metrics["eval/loss"])
    assert not (run / "final.tmp").exists()


def test_same_seed_repeats_exactly_and_another_seed_differs(fast_config):
    a = train(fast_config("seed=3"))
    b = train(fast_config("seed=3"))
    c = train(fast_config("seed=4"))
    assert a["train/loss"] == b["train/loss"] and a["eval/loss"] == b["eval/loss"]
    assert a["train/loss"] != c["train/loss"]


def test_gradient_accumulation_matches_one_big_batch(fast_config, tmp_path):
    """1 micro-batch of 8 pairs and 2 of 4 per step give the same steps. A constant schedule without warmup and
    several steps, so that the weights move far more than the tolerance (a step at lr 0 would prove nothing)."""
    common = ["algo=dpo", "optimizer=sgd", "scheduler=constant", "scheduler.num_warmup_steps=0", "train.max_steps=4",
              "train.max_grad_norm=null", "data.task.num_train=8"]
    train(fast_config(*common, "train.per_device_batch_size=8", "train.grad_accumulation_steps=1"))
    big = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    train(fast_config(*common, "train.per_device_batch_size=4", "train.grad_accumulation_steps=2"))
    accumulated = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    initial = fast_initial_model()
    moved = max(float((a - b).abs().max()) for a, b in zip(big.parameters(), initial.parameters()))
    assert moved > 1e-3, f"the weights moved by at most {moved}: the comparison below could not fail"
    for a, b in zip(big.parameters(), accumulated.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_sft_then_dpo_from_the_saved_model(fast_config, tmp_path, monkeypatch):
    train(fast_config("algo=sft"))
    folder = tmp_path / "run" / "final"
    saved = load_file(folder / "model.safetensors")
    started_from = {}
    setup = DPO.setup

    def spy(self, policy, tokenizer):  # the policy DPO is handed, before its first step
        started_from.update({k: v.detach().clone() for k, v in policy.state_dict().items()})
        return setup(self, policy, tokenizer)

    monkeypatch.setattr(DPO, "setup", spy)
    metrics = train(fast_config("algo=dpo", f"model.name_or_path={folder}", "train.eval_at_start=true"))
    assert saved.keys() <= started_from.keys()
    assert all(torch.equal(started_from[k], v) for k, v in saved.items()), "DPO did not start from the SFT weights"
    assert math.isfinite(metrics["eval/rewards/margins"])


def test_impossible_training_settings_are_clear_errors(fast_config):
    with pytest.raises(UserError, match="per_device_batch_size"):
        train(fast_config("data.task.num_train=4", "train.per_device_batch_size=8"))
    with pytest.raises(UserError, match=r"train.max_steps=-1 must be a whole number >= 0"):
        train(fast_config("train.max_steps=-1"))
    with pytest.raises(UserError, match=r"set exactly one of them. Fix: e.g. train.max_steps=null train.num_epochs=2"):
        train(fast_config("train.num_epochs=2"))
    with pytest.raises(UserError, match=r"train.on_nonfinite='ignore' is not one of \['skip', 'stop'\]"):
        train(fast_config("train.on_nonfinite=ignore"))


def test_sequences_longer_than_the_models_context_are_refused_naming_both(fast_config, tmp_path):
    """Checked on the loaded model's config (any model: tiny, a folder, a Hub id), before the data is read."""
    with pytest.raises(UserError) as error:
        train(fast_config("model.tiny.max_positions=48", "algo.max_length=64", "algo.max_prompt_length=32"))
    assert str(error.value) == ("algo.max_length=64 is longer than the model's context: it has "
                                "max_position_embeddings=48 positions. Fix: algo.max_length=48 (and "
                                "algo.max_prompt_length below it, e.g. 24), or a model with a longer context.")
    assert not (tmp_path / "run" / ".cache").exists()  # refused before tokenizing


def test_max_steps_zero_evaluates_the_starting_model_and_stops(fast_config, tmp_path):
    metrics = train(fast_config("train.max_steps=0", "train.eval_at_start=false"))
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0] and "eval/loss" in metrics and "train/loss" not in metrics
    assert not (run / "final").exists() and json.loads((run / "summary.json").read_text())["final"] == metrics


def test_num_epochs_sets_the_length_of_the_run_and_its_schedule(fast_config, tmp_path):
    # 64 rows / 4 per batch = 16 micro-batches per epoch, 2 per step: 8 steps an epoch, 24 for 3 epochs
    metrics = train(fast_config("train.max_steps=null", "train.num_epochs=3", "train.grad_accumulation_steps=2",
                                "scheduler=linear", "scheduler.num_warmup_steps=0"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(line["step"] for line in lines) == 24
    assert metrics["train/lr"] == 0.0  # the linear schedule reached its end exactly at the last step
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["train"]["max_steps"] == 24


def test_the_start_up_lines_say_the_epochs_and_warn_of_many_epochs_and_few_held_out_rows(fast_config, tmp_path,
                                                                                          caplog):
    """8 training rows in batches of 4 for 22 steps: 11 passes over them, a warning; 16 held-out rows: an accuracy's
    standard error up to 0.5/sqrt(16) = 0.125, a warning. The default length on the same rows warns of neither the
    epochs nor (with 128 held-out rows) the split (red: without the checks, or with the epochs miscounted)."""
    caplog.set_level("INFO", logger="rlhf")
    train(fast_config("data.task.num_train=8", "train.max_steps=22"))
    text = caplog.text
    assert "22 optimizer steps (11 epoch(s) of the training rows)" in text
    assert "train.max_steps=22 is 11 passes over the 8 training rows" in text and "train.num_epochs=3" in text
    assert "the held-out split has 16 rows: an accuracy measured on them" in text
    assert "standard error of up to 0.12 (0.5/sqrt(16))" in text and "data.eval_size=100" in text
    caplog.clear()
    train(fast_config("data.task.num_eval=128", "hardware.threads_per_process=1"))
    assert "3 optimizer steps (0.188 epoch(s) of the training rows)" in caplog.text
    assert "passes over the" not in caplog.text and "the held-out split has" not in caplog.text
    env = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert env["threads_per_process"] == 1 and env["mixed_precision"] == "no"
    assert env["num_processes"] == 1 and env["torch"] == torch.__version__ and env["machine"]


def test_rerun_in_the_same_folder_starts_a_fresh_metrics_file(fast_config, tmp_path):
    train(fast_config())
    train(fast_config())
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(0) == 1


def test_the_device_cache_is_emptied_every_n_steps(fast_config, monkeypatch):
    from rlhf.hardware.base import DataParallel

    steps = []
    monkeypatch.setattr(DataParallel, "empty_cache", lambda self: steps.append(len(steps)))
    train(fast_config("train.max_steps=5", "train.empty_cache_every_steps=2"))
    assert len(steps) == 2  # after steps 2 and 4
    train(fast_config("train.max_steps=5"))
    assert len(steps) == 2  # 0: never


def test_profile_steps_write_the_operators_table_and_a_trace_of_the_steps_after_the_first_log_window(
        fast_config, tmp_path):
    train(fast_config("train.max_steps=6", "train.log_every_steps=2", "train.profile_steps=2"))
    run = tmp_path / "run"
    table = (run / "profile.txt").read_text()
    assert table.startswith("steps 3-4: ") and " ms per step " in table
    assert "aten::mm" in table or "aten::addmm" in table  # the model's matrix products were recorded
    events = json.loads((run / "profile_trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::addmm" for e in events)
    train(fast_config("train.max_steps=3", "train.log_every_steps=1", "train.profile_steps=5"))  # ends at step 3
    assert (run / "profile.txt").read_text().startswith("steps 2-3: ")
    (run / "profile.txt").unlink()
    train(fast_config("train.max_steps=2"))  # 0: off
    assert not (run / "profile.txt").exists()


def test_every_training_step_runs_in_training_mode_even_without_an_evaluation_first(fast_config, monkeypatch):
    """A model loaded with from_pretrained (the cached warm start, a Hub model) comes in eval mode: dropout off. The
    loop puts it in training mode before its first step, not only after an evaluation (train.eval_at_start=false)."""
    from rlhf.algos.sft import SFT

    modes, loss = [], SFT.loss

    def recording(self, model, batch, **kwargs):
        if torch.is_grad_enabled():  # a training micro-batch (evaluations run without gradients)
            modes.append(model.training)
        return loss(self, model, batch, **kwargs)

    monkeypatch.setattr(SFT, "loss", recording)
    # a 2-step warm start: the model then comes from the cache through from_pretrained, in eval mode
    train(fast_config("algo=sft", "model.tiny.warm_start_steps=2", "train.eval_at_start=false", "train.max_steps=2"))
    assert modes == [True, True], modes


def test_answer_metrics_are_not_logged_on_data_of_ones_own(fast_config, tmp_path, caplog):
    """exact_match counts a completion right only when it is the embedded task's one answer: on a file of one's own
    neither train/ nor eval/exact_match is logged (the start-up lines say so), and a sweep's objective may not name it;
    the embedded task keeps it (red: logged on the file, 0 throughout as a user saw)."""
    from rlhf.sweeps.points import check_objective

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}{b}=", "chosen": f"{b}{a}x", "rejected": f"{a}{b}"}) + "\n"
                             for a in "abcdefgh" for b in "ijkl"))
    caplog.set_level("INFO", logger="rlhf")
    for algo in ("dpo", "sft"):
        columns = [] if algo == "dpo" else ["data.columns={prompt: prompt, completion: chosen}"]
        metrics = train(fast_config(f"algo={algo}", f"data.path={pairs}", "data.eval_size=8", *columns))
        logged = {k for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
        assert "eval/loss" in logged and not {"eval/exact_match", "train/exact_match"} & (logged | set(metrics))
    assert "not logged: train/exact_match, eval/exact_match" in caplog.text
    metrics = train(fast_config("algo=dpo"))
    assert "eval/exact_match" in metrics and "train/exact_match" in metrics
    container = OmegaConf.to_container(fast_config("algo=dpo", f"data.path={pairs}", "objective.metric=eval/exact_match",
                                                   "objective.direction=maximize"), resolve=True)
    with pytest.raises(UserError, match=r"objective.metric=eval/exact_match: on data.path=.* \(data of one's own\) it "
                                        r"is not logged"):
        check_objective(container)
