"""rlhf/telemetry/bf16_updates.py: half a bf16 step at a weight, the steps until an update is seen, their median over
sampled weights, and the watch over a run's first step (against hand-computed values)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.telemetry import bf16_updates as b


def test_half_a_bf16_step_is_read_from_the_exponent():
    # bf16 keeps 8 significant bits: [1, 2) has spacing 2^-7, half of it 2^-8; [2, 4) 2^-7; 0.02 lies in
    # [2^-6, 2^-5): 2^-14; the sign does not count; 0 and subnormals: half of bf16's subnormal spacing 2^-133
    weights = torch.tensor([1.0, 1.5, 1.999, 2.0, 3.0, 0.02, -1.0, 0.0, 1e-40, 2.0**-126])
    expected = [2**-8, 2**-8, 2**-8, 2**-7, 2**-7, 2**-14, 2**-8, 2**-134, 2**-134, 2**-134]
    assert b.half_bf16_step(weights).tolist() == expected


def test_an_update_below_half_a_step_leaves_the_bf16_value_and_one_above_changes_it():
    """What the figure stands for, on bf16's own rounding: weights on the bf16 grid, moved by 0.99 and 1.01 of
    half a step (up and down). Not a power of two: below one the grid is twice as fine (an estimate from the
    weight's own exponent, off by 2 there for an update toward zero)."""
    weights = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    weights = weights[torch.frexp(weights).mantissa.abs() != 0.5]
    half = b.half_bf16_step(weights) * torch.where(torch.rand(len(weights)) < 0.5, -1.0, 1.0)
    below, above = (weights + 0.99 * half).bfloat16(), (weights + 1.01 * half).bfloat16()
    assert torch.equal(below.float(), weights) and not (above.float() == weights).any()


def test_steps_to_visible_divide_half_a_step_by_the_update():
    before = torch.tensor([1.0, 1.0, 0.02, 0.5, 3.0])
    after = before + torch.tensor([2**-10, -(2**-10), 5e-7, 0.0, 2**-5])
    steps = b.steps_to_visible(before, after)
    assert steps[:2].tolist() == [4.0, 4.0]  # 2^-8 / 2^-10, either way
    assert steps[2].item() == pytest.approx(2**-14 / 5e-7, rel=5e-3)  # ~122 steps at lr 5e-7 (float32 difference)
    assert math.isinf(steps[3]) and steps[4].item() == 0.25  # no update: never; 2^-7 / 2^-5: seen at once
    assert b.steps_to_visible(before[:1], after[:1], lr_scale=2.0).tolist() == [2.0]  # at twice the step's lr


def test_typical_is_the_median_counted_by_the_elements_each_sample_stands_for():
    ones = torch.ones(3)
    small = b.Sample(ones[:1], ones[:1] + 2**-10, stands_for=10)  # 4 steps, for 10 elements
    big = b.Sample(ones, ones + torch.tensor([2**-6, 2**-6, 0.0]))  # 2^-8 / 2^-6: 0.25 steps twice (one each), one
    # still: hidden (inf), its tensor moved
    frozen = b.Sample(ones, ones, stands_for=100)  # no element moved: no gradient yet, left out
    result = b.typical([small, big, frozen])
    assert result == b.Visibility(steps=4.0, at_once=2 / 13, sampled=4, still=3)
    mostly_still = big._replace(after=ones + torch.tensor([2**-6, 0.0, 0.0]))
    assert b.typical([mostly_still]).steps == math.inf  # two of its three still: hidden, the median
    assert b.typical([small._replace(stands_for=1), big]).steps == 0.25  # counted alike: the 0.25s are the majority
    assert b.typical([b.Sample(ones, ones)]) is None  # nothing moved
    assert b.weighted_median(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([1.0, 1.0, 5.0])) == 2.0


def test_a_sample_is_bounded_and_drawn_without_the_runs_random_numbers():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    index = b.sample_indices(1_000_000, 4096, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(index) == 4096 and int(index.max()) < 1_000_000 and torch.equal(index, index.sort().values)
    assert torch.equal(index, b.sample_indices(1_000_000, 4096, seed=3)) and b.sample_indices(100, 4096, 0) is None


def _optimizer(weight: torch.Tensor, warmup: int):
    """SGD on ``weight`` at peak lr 2^-10 with a linear warmup of ``warmup`` steps (its first step at lr 0)."""
    optimizer = torch.optim.SGD([weight], lr=2**-10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / warmup) if warmup else 1.0)
    return optimizer, scheduler


def test_the_watch_measures_the_first_step_with_a_learning_rate_scaled_to_the_peak(caplog):
    """Weights of 1.0 and a gradient of 1: at the peak lr 2^-10 a step moves a weight 2^-10, a quarter of half its
    bf16 step: 4 steps. Warmup of 4: step 1 at lr 0 moves nothing, step 2 at lr/4 is below half the peak (not
    measured), step 3 at lr/2 is measured and scaled to the peak: 4, not 8. A run of 10 steps is shorter than 4 x 4:
    warned, naming the fix."""
    weight = torch.nn.Parameter(torch.ones(100, 100))
    optimizer, scheduler = _optimizer(weight, warmup=4)
    watch = b.Bf16Watch([(weight, optimizer.param_groups[0])], max_steps=10, per_tensor=500)
    assert watch.before[0].numel() == 500  # a bounded sample of the 10,000 elements
    recorded = []
    caplog.set_level(logging.INFO, logger="rlhf")
    for step in (1, 2, 3, 4):
        weight.grad = -torch.ones_like(weight)  # upwards: the weights stay in [1, 2), where half a step is 2^-8
        optimizer.step()
        scheduler.step()
        watch.after_step(step, lambda metrics, at: recorded.append((at, metrics)))
    assert recorded == [(3, {b.METRIC: 4.0})]  # once
    assert "a typical weight that trains needs 4 optimizer step(s)" in caplog.text
    assert "and the run has 10" in caplog.text and "Fix: hardware.mixed_precision=no" in caplog.text


def test_a_run_long_enough_for_its_updates_is_not_warned(caplog):
    weight = torch.nn.Parameter(torch.ones(10, 10))
    optimizer, _ = _optimizer(weight, warmup=0)
    watch = b.Bf16Watch([(weight, optimizer.param_groups[0])], max_steps=16)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    caplog.set_level(logging.INFO, logger="rlhf")
    assert watch.after_step(1, lambda *_: None).steps == 4.0
    assert "needs 4 optimizer step(s)" in caplog.text and "hides" not in caplog.text


def _strategy(precision: str):
    return SimpleNamespace(mixed_precision=precision, unwrap=lambda model: model,
                           accelerator=SimpleNamespace(is_main_process=True))


def test_the_watch_samples_the_trainable_float32_matrices_of_a_run_that_computes_in_bf16():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)  # frozen: not in the optimizer
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    watched = b.watch(_strategy("bf16"), model, optimizer, max_steps=10).tensors
    assert [t for t, _ in watched] == [model[0].weight]  # biases and norms stay float32 under autocast
    assert b.watch(_strategy("no"), model, optimizer, 10).done  # float32: nothing to do
    assert b.watch(_strategy("bf16"), model, optimizer, 10, last={b.METRIC: 3.0}).done  # a resume of a measured run
    stored = model.to(torch.bfloat16)  # model.dtype=bfloat16: rounded away, not delayed; not measured
    assert b.watch(_strategy("no"), stored, torch.optim.AdamW(stored[0].parameters()), 10).done


def test_a_run_whose_learning_rate_stays_low_is_measured_at_its_last_step():
    """A warmup as long as the run never reaches half the peak: measured at the last step, not never."""
    weight = torch.nn.Parameter(torch.ones(10, 10))
    optimizer, scheduler = _optimizer(weight, warmup=8)
    watch = b.Bf16Watch([(weight, optimizer.param_groups[0])], max_steps=3)
    recorded = []
    for step in (1, 2, 3):
        weight.grad = -torch.ones_like(weight)
        optimizer.step()
        scheduler.step()
        watch.after_step(step, lambda metrics, at: recorded.append((at, metrics)))
    assert recorded == [(3, {b.METRIC: 4.0})]


def test_an_input_embedding_only_looked_up_is_not_watched_and_a_tied_one_is():
    """autocast rounds the weights of matrix products, not the rows a lookup reads: an untied input embedding's
    updates reach the forward pass as they are (counting it gave an untied model's median a bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(tied: bool):
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))

    for tied in (False, True):
        model = tiny(tied)
        watched = {id(t) for t, _ in b.watch(_strategy("bf16"), model, torch.optim.AdamW(model.parameters()), 10).tensors}
        embedding = model.get_input_embeddings().weight
        assert (id(embedding) in watched) == tied and id(model.model.layers[0].mlp.up_proj.weight) in watched
