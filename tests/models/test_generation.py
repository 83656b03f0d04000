"""rlhf/models/generation.py: FSDP2's parameters gathered once for a generation, counted on 2 CPU processes."""

from __future__ import annotations

import pytest


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
