"""rlhf/telemetry/mfu.py and the loop's perf/* metrics: samples/s and model FLOPs utilization. About 6 s."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from rlhf import train
from rlhf.telemetry import mfu as perf


def test_samples_per_s_and_mfu_are_in_every_training_line(fast_config, tmp_path):
    train(fast_config("algo=dpo"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if "train/loss" in line]
    assert len(trained) == 3
    for line in trained:
        assert all(math.isfinite(line[key]) and line[key] > 0 for key in ("perf/samples_per_s", "perf/mfu"))
        # One step per log window of 4 pairs (train.per_device_batch_size): pairs, not sequences, are counted.
        assert line["perf/samples_per_s"] * line["perf/step_time_s"] == pytest.approx(4.0)
        assert line["perf/mfu"] < 1


def test_model_flops_per_token_and_mfu_on_hand_values():
    policy = torch.nn.Linear(4, 2)  # 10 parameters, all trained: 6 x 10
    reference = torch.nn.Linear(3, 1).requires_grad_(False)  # 4 parameters, forward only: 2 x 4
    assert perf.flops_per_token(policy, []) == 60
    assert perf.flops_per_token(policy, [reference]) == 68
    policy.weight.requires_grad_(False)  # 8 frozen: their weight gradients are not computed (LoRA's case)
    assert perf.flops_per_token(policy, [reference]) == 4 * 10 + 2 * 2 + 2 * 4
    # 68 FLOPs a token at 1000 tokens/s on 2 processes of 1e5 FLOP/s each.
    assert perf.mfu(68, 1000, 1e5, 2) == pytest.approx(0.34)


def test_the_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    probes = []
    monkeypatch.setattr(perf, "probe", lambda device: probes.append(device) or {"float32": 2e9})
    cpu = torch.device("cpu")
    assert perf.peak_flops(cpu, torch.float32, tmp_path) == 2e9
    assert perf.peak_flops(cpu, torch.bfloat16, tmp_path) == 2e9  # no bfloat16 measured: the float32 peak
    assert len(probes) == 1  # the second read the first's file
    assert [p.suffix for p in (tmp_path / "peak_flops").iterdir()] == [".json"]  # no temporary file left


def test_the_probe_measures_float32_and_bfloat16_where_supported():
    measured = perf.probe(torch.device("cpu"))
    assert measured["float32"] > 1e8
    assert ("bfloat16" in measured) == perf.bf16_supported(torch.device("cpu"))


def test_evaluations_are_left_out_of_the_speed(fast_config, tmp_path, monkeypatch):
    from rlhf.run import loop

    evaluate = loop._evaluate

    def slow(run, record, step):
        if step == 1:
            time.sleep(2.0)  # an evaluation after step 1, before the window of step 2
        evaluate(run, record, step)

    monkeypatch.setattr(loop, "_evaluate", slow)
    train(fast_config("algo=dpo", "train.eval_every_steps=1", "train.max_steps=2"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    second = next(line for line in lines if line["step"] == 2 and "train/loss" in line)
    assert second["perf/step_time_s"] < 2.0


def test_on_a_busy_cpu_the_peak_is_at_least_one_thread_times_the_threads(monkeypatch):
    # Two threads that wait for each other (busy cores) reach less than one thread alone.
    monkeypatch.setattr(perf, "_matmul_flops", lambda device, dtype: 1e9 if torch.get_num_threads() == 1 else 5e8)
    monkeypatch.setattr(perf, "bf16_supported", lambda device: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert perf.probe(torch.device("cpu")) == {"float32": 2e9}
        assert torch.get_num_threads() == 2  # set back
    finally:
        torch.set_num_threads(threads)


def test_a_checkpoints_seconds_are_logged_at_its_step_and_left_out_of_the_speed(fast_config, tmp_path, monkeypatch):
    from rlhf.run import loop

    save = loop._save_checkpoint

    def slow(run, state):
        time.sleep(2.0)
        return save(run, state)

    monkeypatch.setattr(loop, "_save_checkpoint", slow)
    train(fast_config("algo=sft", "train.save_every_steps=1", "train.max_steps=2", "train.log_every_steps=1"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    saved = [line for line in lines if "perf/checkpoint_time_s" in line]
    assert [line["step"] for line in saved] == [1, 2] and all(line["perf/checkpoint_time_s"] >= 2.0 for line in saved)
    second = next(line for line in lines if line["step"] == 2 and "train/loss" in line)
    assert second["perf/step_time_s"] < 2.0  # step 1's checkpoint is not in step 2's window
