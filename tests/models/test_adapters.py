"""LoRA / QLoRA policies (the config group peft, rlhf/models/adapters.py) and the reference strategies that use
them or quantize (adapter, ref_adapter, int8): first-step losses against copy's, the adapter a run saves, the
merged model, and the combinations refused before anything loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

from rlhf.algos.dpo import DPO
from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.adapters import LoRA, NoAdapter, QLoRA
from rlhf.models.loading import Policy
from rlhf.models.quantize import quantized_copy
from rlhf.models.reference import FrozenCopy, Int8
from rlhf.models.reference_adapters import AdapterOff, SecondAdapter
from rlhf.models.tokenizer import byte_tokenizer
from rlhf.ops.completion_logps import completion_stats
from tests.conftest import FAST, compose_config, fast_initial_model
from tests.independent_logps import answer_logps, dpo_losses, mean

ROWS = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}, {"prompt": "hello=", "chosen": "olleh", "rejected": "hello"},
        {"prompt": "xyz=", "chosen": "zyx", "rejected": "zxy"}]


def _tiny(hidden: int = 16) -> Policy:
    torch.manual_seed(0)
    return TinySpec(hidden_size=hidden, num_layers=2, num_heads=2, intermediate_size=2 * hidden,
                    warm_start_steps=0).build()


def _first(policy: Policy, reference, beta: float = 0.1):
    """DPO set up on `policy` with `reference`: (algo, batch, first loss, reference log-probabilities)."""
    algo = DPO(beta=beta, reference=reference)
    algo.setup(policy.model, policy.tokenizer)
    batch = algo.collate([algo.tokenize(r, policy.tokenizer) for r in ROWS])
    policy.model.train()
    loss, _ = algo.loss(policy.model, batch)
    with torch.no_grad():
        ref = algo.reference.logps(batch, algo.ref_model, policy.model)
    return algo, batch, loss, ref


def _trained_adapter(policy: Policy) -> None:
    """Move a fresh adapter away from zero, as training would."""
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.2 * torch.randn_like(p))


# --- target modules per model family -----------------------------------------------------------------------------
FAMILIES = {
    "llama": (LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2), {"q_proj", "v_proj"}),
    "qwen2": (Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2), {"q_proj", "v_proj"}),
    "gpt2": (GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2), {"c_attn"}),
    "gpt_neox": (GPTNeoXConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2), {"query_key_value"}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_gets_adapters_on_peft_s_default_layers_and_the_count_is_predicted(family):
    config, expected = FAMILIES[family]
    model = AutoModelForCausalLM.from_config(config)
    lora = LoRA(r=4)
    predicted = lora.trainable_parameters(model)
    adapted = lora.apply(model)
    names = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in adapted.named_parameters() if "lora_A" in name}
    assert names == expected
    assert predicted == lora.trainable_parameters(adapted) == sum(
        p.numel() for p in adapted.parameters() if p.requires_grad) > 0
    assert all(not p.requires_grad for n, p in adapted.named_parameters() if "lora_" not in n)


def test_all_linear_and_a_list_of_names_choose_the_layers():
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"][0])
    every = LoRA(r=2, target_modules="all-linear")
    assert every.trainable_parameters(model) == every.trainable_parameters(every.apply(model))
    named = LoRA(r=2, target_modules=["o_proj"]).apply(AutoModelForCausalLM.from_config(FAMILIES["llama"][0]))
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in named.named_parameters() if p.requires_grad} == {"o_proj"}


# --- reference strategies --------------------------------------------------------------------------------------------
def test_adapter_off_reference_gives_copys_first_loss_exactly_and_the_base_once_the_adapter_trained():
    """Once the adapter trained, the loss is DPO's (Rafailov et al. 2023, eq. 7) on log-probabilities computed here:
    the policy's through the model with its adapter, the reference's through a fresh copy of the base model."""
    policy = _tiny()
    policy.model = LoRA(r=4, dropout=0.1).apply(policy.model)
    _, _, with_copy, _ = _first(policy, FrozenCopy())
    policy = _tiny()
    policy.model = LoRA(r=4, dropout=0.1).apply(policy.model)
    algo, batch, with_adapter, _ = _first(policy, AdapterOff())
    assert algo.frozen == {} and with_adapter.item() == with_copy.item()
    assert with_adapter.item() == pytest.approx(math.log(2), abs=1e-6)
    _trained_adapter(policy)
    loss, _ = algo.loss(policy.model, batch)
    with torch.no_grad():
        reference = algo.reference.logps(batch, None, policy.model).tolist()
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.model.named_parameters())
    prompts, chosen, rejected = ([r[k] for r in ROWS] for k in ("prompt", "chosen", "rejected"))
    base, tokenizer = _tiny().model, policy.tokenizer  # the policy's base, built apart
    ref_chosen, ref_rejected = (answer_logps(base, tokenizer, prompts, a) for a in (chosen, rejected))
    assert reference == pytest.approx(ref_chosen + ref_rejected, abs=1e-5)  # the adapter is off: the base
    pc, pr = (answer_logps(policy.model, tokenizer, prompts, a) for a in (chosen, rejected))
    expected = mean(dpo_losses(pc, pr, ref_chosen, ref_rejected, 0.1))
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    flipped = mean(dpo_losses(pr, pc, ref_rejected, ref_chosen, 0.1))  # a flipped sign, or swapped answers
    assert min(abs(flipped - expected), abs(math.log(2) - expected)) > 1e-3  # the test can fail


def test_qlora_policy_with_its_adapter_off_starts_at_log_2_exactly():
    """The 4-bit base runs one kernel for the policy and its adapter-off reference (both in training mode)."""
    policy = _tiny(hidden=64)
    policy.model = QLoRA(r=4).apply(quantized_copy(policy.model, QLoRA().loader_arguments()["quantization"]))
    assert type(policy.model.base_model.model.model.layers[0].mlp.up_proj.weight).__name__ == "Params4bit"
    _, _, loss, _ = _first(policy, AdapterOff())
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


def test_a_second_adapter_from_a_previous_run_is_the_reference(tmp_path):
    """A run with peft=lora saves its adapter in final/; a second run starts from it (peft.init_from) with it as the
    reference: the first loss is log 2 exactly, the reference's log-probabilities are those of the base plus that
    adapter (computed independently), and switching the adapter off would have given the base instead."""
    from peft import PeftModel

    from rlhf import train

    train(compose_config(*FAST, "peft=lora", "peft.r=4", "optimizer.lr=0.05", "train.eval_at_start=false",
                         output_dir=tmp_path / "sft"))
    adapter = tmp_path / "sft" / "final"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    tiny = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0)
    policy = tiny.build()
    policy.model = LoRA(init_from=str(adapter)).apply(policy.model)
    algo, batch, loss, ref = _first(policy, SecondAdapter(str(adapter)))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    independent = PeftModel.from_pretrained(tiny.build().model, str(adapter)).eval()  # eval: no LoRA dropout
    with torch.no_grad():
        assert torch.allclose(ref, completion_stats(independent, batch).logps, atol=1e-6, rtol=0)
        off = AdapterOff().logps(batch, None, policy.model)
    assert (ref - off).abs().max() > 1e-2  # the trained adapter really differs from the base
    trained = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and all(".default." in n for n in trained)  # the reference adapter stays frozen
    assert SecondAdapter(str(adapter)).memory_bytes(policy.model) == (adapter / "adapter_model.safetensors").stat().st_size
    # The same as a user runs it: the reference's path defaults to peft.init_from; the first step's loss is log 2,
    # and the held-out loss after training is DPO's on the trained adapter against the one it started from.
    run = tmp_path / "dpo"
    _run_and_check(run, ["peft=lora", f"peft.init_from={adapter}", "algo/reference=ref_adapter"],
                   lambda: PeftModel.from_pretrained(tiny.build().model, str(run / "final")), independent)
    first = next(line for line in _lines(run) if "train/loss" in line)
    assert first["step"] == 1 and first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)


INT8_TOLERANCE = 1e-3  # |first-step loss of int8 - copy's| at beta=0.1, 5x the largest measured (2e-4; docs/concepts/references.md)


def test_int8_reference_gives_copys_first_loss_within_the_stated_tolerance():
    policy = _tiny(hidden=64)
    _, _, with_copy, ref_copy = _first(policy, FrozenCopy())
    algo, batch, with_int8, ref_int8 = _first(policy, Int8(name_or_path=None))
    assert type(algo.ref_model.model.layers[0].mlp.up_proj).__name__ == "Linear8bitLt"
    assert abs(with_int8.item() - with_copy.item()) < INT8_TOLERANCE
    assert 0 < (ref_int8 - ref_copy).abs().max().item() < 0.05  # close, not equal (measured up to 0.02 nats)
    assert Int8().memory_bytes(policy.model) < 0.5 * NoAdapter().memory_bytes(policy.model)


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run_and_check(run: Path, overrides: list[str], trained_policy, reference: torch.nn.Module) -> dict:
    """A DPO run of a few steps on the embedded default with ``overrides``; its held-out loss at the end must be
    DPO's (Rafailov et al. 2023, eq. 7) on log-probabilities computed here, each held-out pair through the final
    policy (``trained_policy()``, built once the run wrote it) and through ``reference``. No evaluation at the start,
    so that the one at the end runs the reference rather than reading values kept from the start (int8's). The
    policy must train far enough from its reference that a flipped sign, swapped answers or a reference equal to
    the policy would give another loss."""
    from hydra.utils import instantiate

    from rlhf import train

    cfg = compose_config(*FAST, *overrides, "optimizer.lr=3e-2", "scheduler=constant", "scheduler.num_warmup_steps=0",
                         "train.eval_at_start=false", output_dir=run)
    final = train(cfg)
    rows = instantiate(cfg.data.task).rows("eval", ["prompt", "chosen", "rejected"])
    prompts, chosen, rejected = ([r[k] for r in rows] for k in ("prompt", "chosen", "rejected"))
    tokenizer, beta = byte_tokenizer(), cfg.algo.beta
    ref_chosen, ref_rejected = (answer_logps(reference, tokenizer, prompts, a) for a in (chosen, rejected))
    pc, pr = (answer_logps(trained_policy(), tokenizer, prompts, a) for a in (chosen, rejected))
    expected = mean(dpo_losses(pc, pr, ref_chosen, ref_rejected, beta))
    assert final["eval/loss"] == pytest.approx(expected, abs=1e-5)
    flipped = mean(dpo_losses(pr, pc, ref_rejected, ref_chosen, beta))  # a flipped sign, or swapped answers
    apart = {"flipped": abs(flipped - expected), "at_reference": abs(math.log(2) - expected)}
    assert min(apart.values()) > 1e-3, f"a broken loss would be within {apart} of the right one: the test cannot fail"
    return final


@pytest.mark.parametrize("option", ["adapter", "int8"])
def test_dpo_runs_with_the_adapter_and_int8_references_on_the_embedded_default(option, tmp_path):
    """The reference is the initial policy: with its adapter off (peft=lora; the adapter starts at zero), or loaded
    in 8 bits (here through transformers and bitsandbytes directly, from the initial policy's saved weights)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if option == "adapter":
        reference = fast_initial_model()
        overrides = ["peft=lora", "algo/reference=adapter"]
        trained = lambda: PeftModel.from_pretrained(fast_initial_model(), str(tmp_path / "run" / "final"))  # noqa: E731
    else:
        fast_initial_model().save_pretrained(tmp_path / "initial")
        reference = AutoModelForCausalLM.from_pretrained(
            tmp_path / "initial", dtype=torch.float32, device_map={"": "cpu"},
            quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0))
        overrides = ["algo/reference=int8"]
        trained = lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")  # noqa: E731
    _run_and_check(tmp_path / "run", overrides, trained, reference)
    saved = "adapter_model.safetensors" if option == "adapter" else "model.safetensors"
    assert (tmp_path / "run" / "final" / saved).exists()


def test_fsdp_keeps_an_8bit_reference_whole():
    """FSDP2 would shard bitsandbytes' 8-bit matrices without their scales (the forward then fails, measured on 2
    CPU processes): an 8-bit frozen model is placed whole, as DataParallel places it, without a process group."""
    from types import SimpleNamespace

    from rlhf.hardware.fsdp import FSDP2

    strategy = FSDP2(device="cpu", num_processes=2)
    strategy.accelerator = SimpleNamespace(device=torch.device("cpu"))
    reference = Int8()(_tiny(hidden=64).model)
    assert strategy._place_frozen(reference) is reference
    assert type(reference.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Params"


# --- the run: final/, merged/, refusals ----------------------------------------------------------------------------
def test_merge_writes_a_plain_model_that_computes_what_the_adapter_did(tmp_path):
    from peft import PeftModel

    from rlhf import train
    from rlhf.models.loading import load_policy

    train(compose_config(*FAST, "peft=lora", "peft.merge=true", "optimizer.lr=0.05", "train.eval_at_start=false",
                         output_dir=tmp_path / "run"))
    final = tmp_path / "run" / "final"
    merged = load_policy(name_or_path=str(final / "merged"))
    tiny = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=0)
    adapted = PeftModel.from_pretrained(tiny.build().model, str(final)).eval()
    ids = merged.tokenizer("abc=cba", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged.model(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5,
                                   rtol=1e-5)
        assert not torch.allclose(tiny.build().model(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-3)


@pytest.mark.parametrize("option", ["adapter", "ref_adapter"])
def test_an_adapter_reference_without_an_adapter_is_refused_before_anything_loads(option):
    from rlhf.config.checks import check_config

    with pytest.raises(UserError, match=f"algo/reference={option} uses the policy's LoRA adapter, but peft=none.*"
                                        "Fix: peft=lora"):
        check_config(compose_config("algo=dpo", f"algo/reference={option}"))


@pytest.mark.parametrize("option", ["none", "lora", "qlora"])
def test_each_peft_option_composes_and_builds(option):
    from hydra.utils import instantiate

    assert isinstance(instantiate(compose_config(f"peft={option}").peft), NoAdapter)


# --- exact resume ------------------------------------------------------------------------------------------------
def _run_files(run) -> dict:
    """What must match bit for bit: the adapter in final/, and the last checkpoint's model, optimizer and rank files."""
    from safetensors.torch import load_file

    last = run / "checkpoints" / "step_00000006"
    files = {"adapter": load_file(run / "final" / "adapter_model.safetensors"),
             "model": load_file(last / "model.safetensors")}
    for name in ("optimizer.pt", "scheduler.pt", "rank_0.pt"):
        files[name] = torch.load(last / name, weights_only=True)
    files["rank_0.pt"]["train"]["last"] = {k: v for k, v in files["rank_0.pt"]["train"]["last"].items()
                                           if not k.startswith("perf/")}
    return files


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_a_lora_run_resumed_from_its_checkpoint_ends_bit_for_bit_as_an_uninterrupted_one(peft, tmp_path):
    """6 steps in one go, and 3 steps then a resume to 6: the same adapter, optimizer, random state and metrics.
    The checkpoint holds the adapter only (the frozen base is built again from the config and checked)."""
    from safetensors import safe_open

    from rlhf import train
    from tests.conftest import assert_equal_trees
    from tests.runs import metrics

    common = [*FAST, f"peft={peft}", "peft.dropout=0.1", "algo/reference=adapter", "algo.disable_dropout=false",
              "scheduler=constant", "train.save_every_steps=3", "train.eval_every_steps=3", "train.keep_last=null"]
    train(compose_config(*common, "train.max_steps=6", output_dir=tmp_path / "whole"))
    train(compose_config(*common, "train.max_steps=3", output_dir=tmp_path / "resumed"))
    train(compose_config(*common, "train.max_steps=6", "resume=auto", "resume_changes=[train.max_steps]",
                         output_dir=tmp_path / "resumed"))
    assert_equal_trees(_run_files(tmp_path / "whole"), _run_files(tmp_path / "resumed"))
    assert metrics(tmp_path / "whole") == metrics(tmp_path / "resumed")
    with safe_open(str(tmp_path / "whole" / "checkpoints" / "step_00000003" / "model.safetensors"), "pt") as file:
        assert all("lora_" in key for key in file.keys()) and len(file.metadata()["frozen_sha256"]) == 64


def test_a_resume_onto_another_base_is_refused(tmp_path):
    from rlhf import train

    common = [*FAST, "peft=lora", "train.max_steps=2", "train.save_every_steps=2"]
    train(compose_config(*common, output_dir=tmp_path / "run"))
    with pytest.raises(UserError, match="frozen weights of the model built for this resume differ"):
        train(compose_config(*common, "train.max_steps=3", "resume=auto",
                             "resume_changes=[train.max_steps,model.tiny.init_seed]", "model.tiny.init_seed=1",
                             output_dir=tmp_path / "run"))


@pytest.mark.serial
def test_two_processes_train_an_adapter_against_its_base_and_resume_exactly(tmp_path):
    """The practitioner's case on CPU: hardware=cpu_ddp (2 processes, gloo), each holding its own 4-bit base, the
    reference being that base with the adapter off; a resume from step 2 ends as the run that went on did. (QLoRA
    only: LoRA is the same path without quantization, and each 2-process run costs ~25 s here.)"""
    peft = "qlora"
    from safetensors.torch import load_file

    from rlhf import train
    from tests.conftest import assert_equal_trees
    from tests.runs import metrics

    common = [*FAST, "hardware=cpu_ddp", "hardware.timeout_s=60", f"peft={peft}", "algo/reference=adapter",
              "train.per_device_batch_size=2", "train.max_steps=4", "train.save_every_steps=2",
              "train.eval_at_start=false", "train.keep_last=null"]
    train(compose_config(*common, output_dir=tmp_path / "whole"))
    step_2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    train(compose_config(*common, f"resume={step_2}", output_dir=tmp_path / "resumed"))
    for name in ("final/adapter_model.safetensors", "checkpoints/step_00000004/model.safetensors"):
        assert_equal_trees(load_file(tmp_path / "whole" / name), load_file(tmp_path / "resumed" / name), name)
    for rank in (0, 1):
        step = f"checkpoints/step_00000004/rank_{rank}.pt"
        whole, resumed = (torch.load(r / step, weights_only=True) for r in (tmp_path / "whole", tmp_path / "resumed"))
        assert_equal_trees(whole["rng"]["torch"], resumed["rng"]["torch"], step)
    assert metrics(tmp_path / "whole")[-2:] == metrics(tmp_path / "resumed")[-2:]  # step 4: training, evaluation


def test_a_4bit_base_stored_as_float32_trains_and_saves(tmp_path):
    """quant_storage=float32 (what ZeRO-3 and FSDP want for a float32 model) keeps packed 4-bit bytes in float32
    tensors, many of them NaN as floats: the finiteness check before each save reads only what trains."""
    from rlhf import train

    final = train(compose_config(*FAST, "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "peft=qlora",
                                 "peft.quant_storage=float32", "train.save_every_steps=3",
                                 output_dir=tmp_path / "run"))
    assert math.isfinite(final["train/loss"]) and (tmp_path / "run" / "final" / "adapter_model.safetensors").exists()


def test_zero_loads_a_quantized_base_non_strictly(monkeypatch):
    """DeepSpeed's checkpoint holds bitsandbytes' quantization constants as entries of the module's state, which a
    freshly built 4-bit model does not list: the load is strict for every other model. (Runs of hardware=zero2/zero3
    with peft=qlora resumed bit for bit by hand on 2 CPU processes: docs/how-to/lora-qlora.md.)"""
    from rlhf.hardware.zero import ZeRO

    calls = []

    class Engine(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def load_checkpoint(self, path, **kwargs):
            calls.append(kwargs["load_module_strict"])
            return path, None

    plain = _tiny(hidden=64).model
    four_bit = quantized_copy(plain, QLoRA().loader_arguments()["quantization"])
    for module in (plain, four_bit):
        ZeRO(stage=2).load_state(Engine(module), None, Path("/unused"))
    assert calls == [True, False]


@pytest.mark.parametrize(("reference", "key"), [("adapter", "peft.init_from"), ("ref_adapter", "algo.reference.path")])
def test_an_adapter_folder_without_an_adapter_is_refused_before_anything_loads(reference, key, tmp_path):
    from rlhf.config.checks import check_config

    overrides = ["peft=lora", f"algo/reference={reference}", f"{key}={tmp_path}"]
    with pytest.raises(UserError, match=f"{key}={tmp_path}: no adapter_config.json there .*Fix: the final/ folder"):
        check_config(compose_config(*overrides))
