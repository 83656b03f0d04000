"""rlhf.StepTrainer: one optimizer step of the loop's own on rows a custom loop gives (texts or token ids).

Cost: about 20 s in all on 2 cores (seven trainers of the FAST tiny model, each built in ~1.5 s, one 2-step run, and
one with its layers compiled by aot_eager, ~6 s).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf import StepTrainer, train
from rlhf.core.errors import UserError
from rlhf.core.train_state import TrainState
from rlhf.data.loaders import Batches
from tests.conftest import FAST


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One trainer for the tests that only look at what a step is given (no run folder: nothing is written)."""
    with StepTrainer(FAST) as trainer:
        yield trainer


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_step_on_token_ids_changes_the_parameters_and_returns_finite_statistics(tmp_path):
    constant = ["scheduler=constant", "scheduler.num_warmup_steps=0"]  # a warmup's first step has lr 0
    with StepTrainer([*FAST, *constant], run_dir=tmp_path / "run") as trainer:
        before = _params(trainer.model)
        ids = torch.tensor([[257, 97, 98, 61, 98, 97, 258], [257, 99, 61, 99, 258, 256, 256]])
        stats = trainer.step(input_ids=ids, attention_mask=(ids != 256).long())
        assert {"train/loss", "train/grad_norm", "train/lr", "train/num_tokens", "perf/tokens_per_s"} <= stats.keys()
        assert all(math.isfinite(v) for v in stats.values())
        assert trainer.global_step == 1
        after = trainer.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        completions = trainer.generate(["abc=", "de="], max_new_tokens=4, num_return_sequences=3)
        assert len(completions) == 6 and all(isinstance(c, str) for c in completions)
        saved = trainer.save()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "train/loss" in line] == [1]
    assert AutoModelForCausalLM.from_pretrained(saved).config.vocab_size == trainer.model.config.vocab_size


def _masked_nll(model, tokenizer, rows: list[tuple[str, str]]) -> float:
    """By hand: the mean over every learned token of the batch of -log p(token | the tokens before it), where the
    learned tokens are each completion's and its EOS (the first token of a row is never predicted)."""
    total, count = 0.0, 0
    for prompt, completion in rows:
        p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for j in range(max(len(p), 1), len(p) + len(c)):
            total -= float(logps[j - 1, ids[0, j]])
            count += 1
    return total / count


def test_texts_labels_are_learned_after_their_prompt_which_is_not(tmp_path):
    rows = [("abc=", "cba"), ("hello=", "olleh")]
    with StepTrainer(FAST) as trainer:
        model = copy.deepcopy(trainer.model).eval()
        stats = trainer.step(texts=[p for p, _ in rows], texts_labels=[c for _, c in rows])
        assert stats["train/loss"] == pytest.approx(_masked_nll(model, trainer.tokenizer, rows), rel=1e-5)
        assert stats["train/num_tokens"] == 5.0  # (3 + EOS and 5 + EOS) / 2 rows: the prompts are not counted
        model = copy.deepcopy(trainer.model).eval()
        whole = trainer.step(texts=["abc=cba"])  # no texts_labels: the whole text is learned
        assert whole["train/loss"] == pytest.approx(_masked_nll(model, trainer.tokenizer, [("", "abc=cba")]), rel=1e-5)


def _seen_by_the_loss(trainer, monkeypatch) -> list[dict[str, torch.Tensor]]:
    seen = []
    loss = trainer.run.algo.loss
    monkeypatch.setattr(trainer.run.algo, "loss", lambda model, batch: seen.append(batch) or loss(model, batch))
    return seen


def test_truncation_keeps_the_end_or_the_start(shared, monkeypatch):
    seen = _seen_by_the_loss(shared, monkeypatch)
    monkeypatch.setattr(shared, "max_length", 4)
    shared.step(input_ids=[list(range(10, 20))])
    monkeypatch.setattr(shared, "truncation_mode", "keep_start")
    shared.step(input_ids=[list(range(10, 20))], labels=[[-100] * 2 + list(range(12, 20))])
    assert seen[0]["input_ids"].tolist() == [[16, 17, 18, 19]] and seen[0]["completion_mask"].tolist() == [[1] * 4]
    assert seen[1]["input_ids"].tolist() == [[10, 11, 12, 13]] and seen[1]["completion_mask"].tolist() == [[0, 0, 1, 1]]
    with pytest.raises(UserError, match="no token left to learn from.*Fix: a larger max_length"):
        shared.step(texts=["abcdef="], texts_labels=["fedcba"])  # keep_start: the prompt fills the 4 tokens


def test_rows_are_split_into_micro_batches_of_at_most_the_batch_size(shared, monkeypatch):
    seen = _seen_by_the_loss(shared, monkeypatch)
    shared.step(texts=["abc="] * 9, texts_labels=["cba"] * 9)  # per_device_batch_size=4: 3 micro-batches of 3
    assert [len(batch["input_ids"]) for batch in seen] == [3, 3, 3]


def test_two_steps_are_the_loops_two_steps_bit_for_bit(fast_config, tmp_path):
    """The same two batches through the loop (rlhf.train) and through step(): the same parameters bit for bit, and
    the same logged losses. Two micro-batches per step, so the split of a step's rows is checked too."""
    cfg = fast_config("algo=sft", "train.max_steps=2", "train.grad_accumulation_steps=2", "train.eval_at_start=false",
                      "train.save_every_steps=0", "scheduler=constant", "scheduler.num_warmup_steps=0")
    train(cfg)
    looped = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    with StepTrainer.from_config(cfg, run_dir=tmp_path / "steps") as trainer:
        start = _params(trainer.model)
        batches = Batches(trainer.run.train_loader, TrainState(), trainer.run.accelerator)
        losses = []
        for _ in range(2):
            micro = [batches.next() for _ in range(2)]
            rows = [(ids[mask.bool()], (ids.masked_fill(completion == 0, -100))[mask.bool()])
                    for batch in micro for ids, mask, completion in
                    zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])]
            stats = trainer.step(input_ids=[ids for ids, _ in rows], labels=[labels for _, labels in rows])
            losses.append(stats["train/loss"])
        stepped = trainer.model.state_dict()
    assert any(not torch.equal(start[k], stepped[k]) for k in start)
    for key, value in looped.state_dict().items():
        assert torch.equal(value, stepped[key]), key
    assert losses == [line["train/loss"] for line in logged if "train/loss" in line]


def test_the_device_cache_is_emptied_after_every_step_when_asked(fast_config, monkeypatch):
    with StepTrainer.from_config(fast_config("algo=sft"), optimize_device_cache=True) as trainer:
        calls = []
        monkeypatch.setattr(trainer.run.strategy, "empty_cache", lambda: calls.append(trainer.global_step))
        trainer.step(texts=["abc="], texts_labels=["cba"])
        trainer.step(texts=["abc="], texts_labels=["cba"])
        assert calls == [1, 2]
        trainer.optimize_device_cache = False  # train.empty_cache_every_steps=0: never
        trainer.step(texts=["abc="], texts_labels=["cba"])
        assert calls == [1, 2]


@pytest.mark.parametrize("arguments, message", [
    ({"texts": ["a=", "b="], "texts_labels": ["a"]}, "2 texts and 1 texts_labels.*Fix: pass lists of the same"),
    ({"texts": ["a="], "input_ids": [[1, 2]]}, "both were given. Fix: pass one"),
    ({}, "neither was given. Fix: pass one"),
    ({"texts": []}, "texts is empty.*Fix: skip the step"),
    ({"input_ids": []}, "input_ids is empty.*Fix: skip the step"),
    ({"texts": "abc="}, "texts must be a list of strings.*Fix"),
    ({"input_ids": [[1, 2, 3]], "labels": [[1, 2]]}, "labels does not have the shape of input_ids.*Fix"),
    ({"input_ids": [[1, 2, 3]], "labels": [[1, 5, 3]]}, r"labels\[0\]\[1\]=5 is neither -100 nor.*Fix"),
    ({"texts": ["a="], "labels": [[1]]}, "builds its own attention mask and labels. Fix"),
])
def test_bad_input_is_one_clear_error_naming_the_fix(shared, arguments, message):
    step = shared.global_step
    with pytest.raises(UserError, match=message):
        shared.step(**arguments)
    assert shared.global_step == step


def test_a_config_the_step_cannot_train_is_refused_before_anything_is_built(fast_config):
    with pytest.raises(UserError, match="algo is DPO. Fix: algo=sft"):
        StepTrainer.from_config(fast_config("algo=dpo"))
    with pytest.raises(UserError, match="runs in this one process; hardware asks for 2. Fix: hardware=cpu"):
        StepTrainer.from_config(fast_config("algo=sft", "hardware=cpu_ddp"))
    with pytest.raises(UserError, match="truncation_mode='middle'.*Fix"):
        StepTrainer(FAST, truncation_mode="middle")


def test_greedy_generation_warns_about_no_sampling_setting(shared, recwarn, caplog):
    """``generate(do_sample=False)`` passes no temperature/top-k/top-p for transformers to warn it ignores (red
    before: its top_k notice at every call); greedy decoding gives the same texts twice."""
    first = shared.generate(["abc=", "de="], max_new_tokens=4, do_sample=False)
    assert shared.generate(["abc=", "de="], max_new_tokens=4, do_sample=False) == first
    notices = [str(w.message) for w in recwarn] + [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not [n for n in notices if "top_k" in n or "temperature" in n or "top_p" in n], notices


def test_compiled_layers_compile_once_through_train_evaluate_generate_train(monkeypatch):
    """hardware.compile=layers: a train -> evaluate -> generate -> train cycle compiles the decoder layers' training
    and evaluation graphs once, generate() compiles none (its layers run eagerly, as a run's sampling runs them), and a
    second cycle compiles nothing (red without generate's eager stance: a graph for each of the 2 layers and each cache
    length). The layers are compiled with aot_eager (the graphs dynamo makes are the same; inductor's code for a
    layer's forward and backward would take over a minute to generate on 2 cores)."""
    from torch._dynamo.utils import counters

    from rlhf.hardware import compiling

    monkeypatch.setattr(compiling, "LAYER_OPTIONS", {"backend": "aot_eager"})
    rows = {"texts": ["abc=", "hello="], "texts_labels": ["cba", "olleh"]}
    with StepTrainer([*FAST, "model.tiny.num_layers=2", "hardware.compile=layers"]) as trainer:
        made, before = [], counters["stats"]["unique_graphs"]
        for _ in range(2):
            trainer.step(**rows)
            trainer.evaluate()
            ahead = counters["stats"]["unique_graphs"]
            trainer.generate(["abc=", "de=", "hello="], max_new_tokens=6, do_sample=False)
            made.append(counters["stats"]["unique_graphs"] - ahead)
            trainer.step(**rows)
            made.append(counters["stats"]["unique_graphs"] - before)
    assert made[0] == made[2] == 0, made  # generate() compiled nothing
    assert 1 <= made[1] == made[3], made  # the second cycle compiled nothing


def test_another_model_left_with_the_tuned_defaults_is_warned_at_start(monkeypatch, caplog):
    """StepTrainer(overrides) names the defaults tuned on the embedded model that another model keeps, as train.py's
    start-up does (rlhf.config.tuned_defaults); an override of one of them takes it off the line."""
    import rlhf.launch.step_trainer as step_trainer

    def stop(*args, **kwargs):
        raise RuntimeError("built")  # the warning is decided before the model loads

    monkeypatch.setattr(step_trainer, "build_run", stop)
    with caplog.at_level("WARNING", logger=step_trainer.__name__), pytest.raises(RuntimeError, match="built"):
        StepTrainer(["model=smollm2-135m"])
    line = next(r.getMessage() for r in caplog.records if "defaults tuned on the embedded tiny model" in r.getMessage())
    assert "model=smollm2-135m" in line and "optimizer.lr=" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger=step_trainer.__name__), pytest.raises(RuntimeError, match="built"):
        StepTrainer(["model=smollm2-135m", "optimizer.lr=2e-5"])
    assert not any("optimizer.lr=" in r.getMessage() and "defaults tuned" in r.getMessage() for r in caplog.records)


def test_a_schedule_free_optimizer_evaluates_generates_and_saves_with_its_evaluation_weights(tmp_path, monkeypatch):
    """StepTrainer.evaluate, generate and save run with the optimizer in eval mode (its evaluation weights in the
    model), the next step in train mode again (rlhf.run.optimizer_modes). Red without the swap in any of the three."""
    from rlhf.run.optimizer_modes import innermost

    modes = []
    with StepTrainer([*FAST, "optimizer=schedule_free_adamw"]) as trainer:
        inner = innermost(trainer.run.optimizer)
        mode = lambda: "train" if inner.param_groups[0]["train_mode"] else "eval"  # noqa: E731
        trainer.step(texts=["a b c d"], texts_labels=["e f"])
        evaluate, save_model = trainer.run.evaluate, trainer.run.strategy.save_model
        monkeypatch.setattr(trainer.run, "evaluate", lambda: modes.append(("evaluate", mode())) or evaluate())
        monkeypatch.setattr(trainer.run.strategy, "save_model",
                            lambda *a: modes.append(("save", mode())) or save_model(*a))
        generate = trainer.model.generate
        monkeypatch.setattr(trainer.model, "generate", lambda **k: modes.append(("generate", mode())) or generate(**k))
        trainer.evaluate()
        trainer.generate(["a b"], max_new_tokens=2, do_sample=False)
        trainer.save(tmp_path / "final")
        assert mode() == "train"
        trainer.step(texts=["a b c d"], texts_labels=["e f"])
    assert modes == [("evaluate", "eval"), ("generate", "eval"), ("save", "eval")]
