"""The generation evaluation against independent computations: the KL estimate against the exact KL of a tiny
vocabulary (every sequence enumerated), KL 0 and win rate 0.5 when policy = reference, rewards equal to the reward
functions on the decoded completions, the same completions however the prompts are dealt to processes."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import datasets
import pytest
import torch
import transformers

from rlhf.evaluation import generated
from rlhf.evaluation.generated import EVAL_REFERENCE, GenerationEval
from rlhf.models.reference import FrozenCopy

PAD, EOS, A, B = 0, 1, 2, 3  # a vocabulary of four tokens
ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))


class Letters:
    """A tokenizer of the letters a and b (tokens 2 and 3), with pad 0 and EOS 1."""

    bos_token, pad_token_id, eos_token_id = None, PAD, EOS

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [A if c == "a" else B for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join({A: "a", B: "b"}.get(i, "") for i in ids)


def tiny_lm(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper distributions than the initialization's, so that the KL is far from 0
        model.lm_head.weight.mul_(8)
    return model


def evaluation(policy, algo, prompts=("ab",), **options) -> GenerationEval:
    settings = {"prompts": len(prompts), "samples": 1, "greedy": False, "win_rate": False, "max_new_tokens": 3,
                "batch_size": 1, "reward_funcs": {"as": lambda prompts, completions, **_: [c.count("a") for c in
                                                                                            completions]}}
    evaluator = GenerationEval(**{**settings, **options})
    evaluator.setup(policy, Letters(), algo, datasets.Dataset.from_list([{"prompt": p} for p in prompts]))
    return evaluator


@torch.no_grad()
def sequence_logp(model, prompt: list[int], completion: list[int]) -> float:
    ids = torch.tensor([prompt + completion])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    return float(sum(logps[len(prompt) - 1 + i, token] for i, token in enumerate(completion)))


def exact_kl(policy, reference, prompt: list[int], length: int) -> float:
    """KL(policy || reference) summed over every completion of at most ``length`` tokens: those ended by EOS, and
    those cut at ``length`` without one."""
    others = (PAD, A, B)
    completions = [[*body, EOS] for n in range(length) for body in itertools.product(others, repeat=n)]
    completions += [list(body) for body in itertools.product(others, repeat=length)]
    total_p, kl = 0.0, 0.0
    for completion in completions:
        p = sequence_logp(policy, prompt, completion)
        kl += math.exp(p) * (p - sequence_logp(reference, prompt, completion))
        total_p += math.exp(p)
    assert abs(total_p - 1) < 1e-6, total_p  # every completion enumerated once
    return kl


def test_the_kl_estimate_matches_the_exact_kl_of_a_tiny_vocabulary():
    """Red when the estimate scores the samples at the wrong positions (left padding kept), drops EOS's
    log-probability, or reads the log-ratio the wrong way round."""
    policy, reference = tiny_lm(0), tiny_lm(1)
    algo = SimpleNamespace(frozen={"reference": reference}, reference=FrozenCopy())
    evaluator = evaluation(policy, algo, prompts=("ab", "b"), samples=3000, batch_size=2)  # "b" left-padded
    metrics = evaluator(policy, ONE_PROCESS)
    exact = (exact_kl(policy, reference, [A, B], 3) + exact_kl(policy, reference, [B], 3)) / 2
    assert exact > 0.2
    assert abs(metrics["eval/gen/kl"] - exact) < 4 * metrics["eval/gen/kl_stderr"], (metrics, exact)
    assert 0 < metrics["eval/gen/kl_stderr"] < 0.1


def test_policy_equal_to_reference_has_kl_0_and_wins_half():
    policy = tiny_lm(0)
    evaluator = evaluation(policy, SimpleNamespace(frozen={}), prompts=("ab", "ba", "a"), samples=8, greedy=True,
                           win_rate=True, batch_size=2)
    assert set(evaluator.frozen) == {EVAL_REFERENCE}  # no reference of its own: a frozen copy of the initial policy
    metrics = evaluator(policy, ONE_PROCESS)
    assert metrics["eval/gen/kl"] == 0 and metrics["eval/gen/kl_stderr"] == 0
    assert metrics["eval/gen/win_rate"] == 0.5
    assert evaluator.last["greedy"] == evaluator.last["reference"]


def test_rewards_are_the_reward_functions_on_the_decoded_completions():
    policy = tiny_lm(0)
    evaluator = evaluation(policy, SimpleNamespace(frozen={}), prompts=("ab", "ba", "a"), samples=5, batch_size=2)
    metrics = evaluator(policy, ONE_PROCESS)
    completions = evaluator.last["completions"]
    assert len(completions) == 15 and len(set(completions)) > 1
    expected = [c.count("a") for c in completions]
    assert metrics["eval/gen/reward"] == pytest.approx(sum(expected) / 15, abs=1e-12)
    assert metrics["eval/gen/rewards/as"] == metrics["eval/gen/reward"]
    assert evaluator.last["rewards"] == expected


def test_processes_draw_what_one_process_draws(monkeypatch):
    """The prompts dealt to two processes in batches, each batch seeded by its index: together they sample what
    one process samples (the sums' all-reduce replaced by a plain sum of the two processes' values)."""
    policy = tiny_lm(0)
    prompts = ("ab", "ba", "a", "b", "aa")
    one = evaluation(policy, SimpleNamespace(frozen={}), prompts=prompts, samples=3, batch_size=2)
    alone = one(policy, ONE_PROCESS)
    seen = {}
    monkeypatch.setattr(generated, "sum_over_processes", lambda sums, accelerator: seen.setdefault(
        accelerator.process_index, {k: float(v) for k, v in sums.items()}))
    by_rank = []
    for rank in (0, 1):
        evaluator = evaluation(policy, SimpleNamespace(frozen={}), prompts=prompts, samples=3, batch_size=2)
        evaluator._metrics = lambda totals: totals
        evaluator(policy, SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu")))
        by_rank.append(evaluator.last["completions"])
    # batches 0 and 2 on rank 0, batch 1 on rank 1 (and batch 0 again on rank 1, counted 0)
    assert by_rank[0][:6] + by_rank[1] + by_rank[0][6:] == one.last["completions"]
    total = {k: seen[0][k] + seen[1][k] for k in seen[0]}
    assert one._metrics(total) == pytest.approx(alone)


def test_samples_are_scored_as_the_policy_sampled_them():
    """Each sampled sequence's log-probability as scored for the KL equals the policy's own, computed one sequence
    at a time without padding (red when the prompt's left padding is kept in the scored layout)."""
    policy = tiny_lm(0)
    prompts = generated.collate_prompts([{"prompt_ids": [A, B], "prompt": "ab"}, {"prompt_ids": [B], "prompt": "b"}],
                                        PAD)
    settings = generated.Sampling(max_new_tokens=3, pad_id=PAD, eos_ids=(EOS,), tokenizer=Letters())
    sampled = generated.sample(policy, prompts["input_ids"], prompts["attention_mask"], 6, 7, settings)
    with torch.no_grad():
        scored = generated.completion_stats(policy, generated.scoring_batch(sampled)).logps
    for row in range(12):
        prompt = [A, B] if row < 6 else [B]
        completion = sampled["completion_ids"][row][: int(sampled["completion_mask"][row].sum())].tolist()
        assert float(scored[row]) == pytest.approx(sequence_logp(policy, prompt, completion), abs=1e-5)


@pytest.mark.serial
def test_one_process_and_two_sample_the_same_completions(tmp_path):
    """eval=generate on the embedded task's held-out prompts at step 0: hardware=cpu and hardware=cpu_ddp (the
    prompts dealt to two processes, an idle turn on one of them) report the same rewards, lengths and win rate (red
    when a process seeds its batches by its own position instead of the batch's)."""
    import json

    from rlhf import train
    from tests.conftest import FAST, compose_config

    common = [*FAST, "train.max_steps=0", "eval=generate", "eval.prompts=12", "eval.batch_size=4", "eval.samples=3"]
    found = []
    for hardware in ("cpu", "cpu_ddp"):
        train(compose_config(*common, f"hardware={hardware}", output_dir=tmp_path / hardware))
        lines = [json.loads(line) for line in (tmp_path / hardware / "metrics.jsonl").read_text().splitlines()]
        found.append({k: v for line in lines for k, v in line.items() if k.startswith("eval/gen/")})
    assert found[0]["eval/gen/kl"] == 0 and found[0]["eval/gen/win_rate"] == 0.5
    assert set(found[0]) == set(found[1]) and len(found[0]) >= 8
    assert found[1] == pytest.approx(found[0], abs=1e-9)


def test_the_evaluations_own_reference_copy_shows_in_the_memory_preflight(tmp_path):
    """SFT has no reference: eval=generate builds a frozen copy of the initial policy, and the preflight counts it
    and names it (red when the preflight counts only the algorithm's frozen models)."""
    import json

    from rlhf import train
    from tests.conftest import FAST, compose_config

    frozen = {}
    for option in ("none", "generate"):
        train(compose_config(*FAST, "algo=sft", "train.max_steps=0", f"eval={option}", "eval.prompts=4"
                             if option == "generate" else "seed=0", output_dir=tmp_path / option))
        frozen[option] = json.loads((tmp_path / option / "summary.json").read_text())["memory_predicted_mb"]["frozen"]
    assert frozen["none"] == 0 and frozen["generate"] > 0
    assert "(frozen: eval=generate's copy of the initial policy)" in (tmp_path / "generate" / "train.log").read_text()


def test_a_policy_that_cannot_generate_is_refused_before_anything_is_copied():
    from rlhf.core.errors import UserError
    from rlhf.embedded.tiny_model import TinySpec

    scorer = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      warm_start_steps=0).build("sequence_classification")
    evaluator = GenerationEval()
    with pytest.raises(UserError, match="no language-model head to generate with .* Fix: eval=none"):
        evaluator.setup(scorer.model, scorer.tokenizer, SimpleNamespace(frozen={}),
                        datasets.Dataset.from_list([{"prompt": "ab"}]))
    assert evaluator.frozen == {}


def test_an_adapter_reference_is_the_policy_with_its_adapter_off_and_no_copy():
    """algo/reference=adapter: the evaluation holds no copy of the LoRA policy; the reference is the policy with its
    adapter switched off, for the KL and for the win rate's completions. A fresh adapter (B = 0) is the base: KL 0
    and win rate 0.5; a trained adapter (B perturbed) has a KL > 0 (red with the adapter left on for the reference,
    and with a copy made)."""
    import peft

    from rlhf.models.reference_adapters import AdapterOff

    policy = peft.get_peft_model(tiny_lm(0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"]))
    algo = SimpleNamespace(frozen={}, reference=AdapterOff())
    evaluator = evaluation(policy, algo, prompts=("ab", "ba", "a"), samples=8, greedy=True, win_rate=True,
                           batch_size=2)
    assert evaluator.frozen == {}
    metrics = evaluator(policy, ONE_PROCESS)
    assert metrics["eval/gen/kl"] == 0 and metrics["eval/gen/win_rate"] == 0.5
    base_greedy = list(evaluator.last["reference"])
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 2)
    metrics = evaluator(policy, ONE_PROCESS)
    assert metrics["eval/gen/kl"] > 3 * metrics["eval/gen/kl_stderr"] > 0
    # the reference's own completions still come from the base (the adapter off for the generation too)
    assert evaluator.last["reference"] == base_greedy != evaluator.last["greedy"]
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and not any(m.disable_adapters for m in layers)  # the adapter is on again after the evaluation


def test_which_references_need_the_evaluations_own_copy_and_the_memory_script_counts_it():
    """A copy of the initial policy where the algorithm holds no model that scores any sequence (none, precomputed,
    GRPO's copy strategy at beta=0); none where it does, or where the strategy switches the policy's own adapter.
    scripts/memory.py predicts the same: eval=generate adds the policy's weights to the frozen part with a
    precomputed reference, nothing with the adapter one (red when it ignores the evaluation)."""
    import importlib.util
    import sys

    from rlhf.models.precomputed import Precomputed
    from rlhf.models.reference import NoReference
    from rlhf.models.reference_adapters import AdapterOff, SecondAdapter
    from tests.conftest import ROOT

    assert not generated.needs_own_copy(FrozenCopy(), has_model=True)
    assert generated.needs_own_copy(FrozenCopy(), has_model=False)  # GRPO with beta=0 builds none
    assert generated.needs_own_copy(NoReference(), has_model=False)
    assert generated.needs_own_copy(Precomputed.__new__(Precomputed), has_model=False)
    assert not generated.needs_own_copy(AdapterOff(), has_model=False)
    assert not generated.needs_own_copy(SecondAdapter("unused"), has_model=False)

    spec = importlib.util.spec_from_file_location("memory_script", ROOT / "scripts" / "memory.py")
    memory = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = memory
    spec.loader.exec_module(memory)
    cache: dict = {}

    def frozen(*overrides: str) -> float:
        return memory.predict_one("Qwen2.5-0.5B", ["algo=dpo", *overrides], False, cache).frozen

    weights = memory.predict_one("Qwen2.5-0.5B", ["algo=dpo"], False, cache).weights
    assert frozen("algo/reference=precomputed", "eval=generate") == pytest.approx(
        frozen("algo/reference=precomputed") + weights)
    assert frozen("peft=lora", "algo/reference=adapter", "eval=generate") == frozen("peft=lora",
                                                                                     "algo/reference=adapter")
