"""rlhf/models/generation.py: FSDP2's parameters gathered once for a generation, counted on 2 CPU processes; sampling
from softmax(logits / T) alone, whatever the model's own generation defaults; the ids a completion stops at."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.serial
def test_fsdp2_parameters_are_gathered_once_for_a_generation_not_at_every_token():
    """Two processes, FSDP2 over 2 decoder layers and the root (3 units): generating 8 tokens gathers each layer at
    every forward pass (8 forward passes: 16 all-gathers or more; FSDP2 keeps the root gathered) without the block,
    each unit at most once within it, with the same tokens and no synced generation; after the block the layers are
    sharded again (a forward pass gathers them)."""
    import torch.multiprocessing as mp

    from rlhf.hardware import free_port
    from tests.models import workers

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(workers.generation_gathers, args=(free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        every, once = results[rank]["every forward"], results[rank]["once"]
        assert every[0] >= 16 and once[0] <= 3, (every[0], once[0])
        assert once[1] == every[1] and len(once[1]) > 0  # the same tokens
        assert once[2] is False and every[2] is True  # within the block, generation is no collective
        assert results[rank]["forward after"] >= 2, results[rank]["forward after"]
        # a generation before any forward pass leaves training's gathers as they are (the root not resharded)
        assert results[rank]["step after generation-first"] == results[rank]["step after forward-first"], results


@pytest.mark.serial
def test_zero3_parameters_are_gathered_once_for_a_generation_not_at_every_token():
    """Two processes, a DeepSpeed ZeRO-3 engine: without the block, the all-gathers grow with the tokens generated
    (each forward pass gathers each layer: 12 tokens gather more than 4); within it they do not (the model is gathered
    once, whatever the length), with the same tokens and no synced generation; after the block the engine's hooks
    are as they were (none added, no module pushed on DeepSpeed's stack again), the parameters partitioned again, and
    training steps gather (the hooks work) and lower the loss; a second rollout after training steps (the parameter
    coordinator's trace recorded) works alike, and training goes on after it."""
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    from rlhf.hardware import free_port
    from tests.models import workers

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(workers.zero3_generation_gathers, args=(free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        out = results[rank]
        short, long = out["every forward", 4], out["every forward", 12]
        once_short, once_long = out["once", 4], out["once", 12]
        assert long[0] > short[0] > 0, (short[0], long[0])  # per token without the block
        assert once_long[0] == once_short[0] < long[0], (once_short[0], once_long[0], long[0])
        assert once_long[1] == long[1] and once_short[1] == short[1] and len(long[1]) == 12  # the same tokens
        assert once_long[2] is False and long[2] is True
        assert out["hooks after"] == out["hooks before"], (out["hooks before"], out["hooks after"])
        assert out["parameters partitioned after"]
        assert out["step after"] > 0 and out["losses"][1] < out["losses"][0], out
        # generate -> train -> generate -> train: the second rollout gathers as the first, training goes on
        assert out["once after training"] == once_long[0], out
        assert out["losses"][3] < out["losses"][2] < out["losses"][1], out["losses"]


def test_gather_for_generation_false_gathers_nothing_and_says_whether_to_sync(monkeypatch):
    """algo.gather_for_generation=false reaches the block (red if the option were dropped on the way), which then
    touches nothing and yields whether the parameters are sharded: synced generation for a partitioned model."""
    import torch

    from rlhf.algos.grpo import GRPO
    from rlhf.models import generation
    from rlhf.models.generation import gathered_for_generation
    from tests.algos.test_grpo import _source

    plain = torch.nn.Linear(2, 2)
    with gathered_for_generation(plain, enabled=False) as still_sharded:
        assert still_sharded is False
    plain.weight.ds_id = 0  # what a ZeRO-3 parameter carries
    with gathered_for_generation(plain, enabled=False) as still_sharded:
        assert still_sharded is True
    seen = []
    real = generation.gathered_for_generation
    monkeypatch.setattr(generation, "gathered_for_generation", lambda model, enabled=True: seen.append(enabled) or
                        real(model, enabled))
    for option in (False, True):
        algo = GRPO(num_generations=2, max_completion_length=3, gather_for_generation=option)
        source, _ = _source(algo)
        source.next()
        assert seen[-1] is option


def _sampled(model, seed):
    from rlhf.models.generation import Sampling, sample, stop_ids
    from rlhf.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    ids = torch.tensor([tok("abcab=")["input_ids"]] * 2)
    settings = Sampling(temperature=1.0, max_new_tokens=24, pad_id=tok.pad_token_id, eos_ids=stop_ids(tok, model),
                        tokenizer=tok)
    return sample(model, ids, torch.ones_like(ids), 3, seed, settings)["completion_ids"]


def test_sampling_ignores_the_models_own_generation_defaults():
    """A model whose generation_config.json carries its authors' sampling defaults (as many Hub models' do) samples,
    and decodes greedily, exactly the tokens of the same model without them: only softmax(logits / T)."""
    from transformers import GenerationConfig

    from tests.conftest import fast_initial_model

    plain = fast_initial_model()
    opinionated = fast_initial_model()
    opinionated.generation_config = GenerationConfig(
        repetition_penalty=3.0, no_repeat_ngram_size=1, min_p=0.3, top_k=2, temperature=0.2, do_sample=True,
        min_new_tokens=20, eos_token_id=opinionated.generation_config.eos_token_id)
    for seed in (0, None):  # sampled, then greedy
        a, b = _sampled(plain, seed), _sampled(opinionated, seed)
        assert torch.equal(a, b), seed
    assert opinionated.generation_config.repetition_penalty == 3.0  # the model's own config is put back


def test_a_lora_policy_samples_without_its_base_models_defaults_and_keeps_them_after():
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    from tests.conftest import fast_initial_model

    plain = get_peft_model(fast_initial_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    base = fast_initial_model()
    base.generation_config = GenerationConfig(repetition_penalty=3.0, top_k=2, temperature=0.2, do_sample=True,
                                              eos_token_id=base.generation_config.eos_token_id)
    opinionated = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert torch.equal(_sampled(plain, 0), _sampled(opinionated, 0))
    assert opinionated.get_base_model().generation_config.repetition_penalty == 3.0  # put back where it lives


def test_a_completion_stops_at_the_tokenizers_eos_or_any_end_of_turn_id_of_the_model():
    from rlhf.models.generation import stop_ids
    from rlhf.models.tokenizer import byte_tokenizer
    from tests.conftest import fast_initial_model

    tok, model = byte_tokenizer(), fast_initial_model()
    model.generation_config.eos_token_id = [7, tok.eos_token_id, 9]
    assert stop_ids(tok, model) == (tok.eos_token_id, 7, 9)
    model.generation_config.eos_token_id = None
    assert stop_ids(tok, model) == (tok.eos_token_id,)
