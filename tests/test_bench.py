"""benchmarks/bench.py: the benchmark against TRL runs at a tiny size, both sides compute the same losses, and the
tokens it credits each sample with are the tokens our tokenization makes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("shape", list(bench.SHAPES))
def test_rows_fit_their_shape_and_are_credited_the_tokens_they_tokenize_to(shape):
    tokenizer = byte_tokenizer()
    prompt_max, completion_max = bench.SHAPES[shape]
    for algo, cls in (("dpo", DPO), ("sft", SFT)):
        rows = bench.make_rows(algo, shape, 64)
        assert rows == bench.make_rows(algo, shape, 64)  # seeded: both sides train on the same file
        assert all(prompt_max // 2 <= len(r["prompt"]) <= prompt_max for r in rows)
        tokenized = [cls().tokenize(r, tokenizer) for r in rows]
        counted = sum(len(v) for t in tokenized for k, v in t.items() if k.endswith("input_ids")) / len(rows)
        assert bench.tokens_per_sample(algo, rows) == pytest.approx(counted)


def test_the_benchmark_runs_at_a_tiny_size_and_both_sides_compute_the_same_losses(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--sizes", "3m", "--shapes", "short", "--cases",
         "dpo_fp32,sft_fp32", "--steps", "2", "--batch", "2", "--rows", "32", "--threads", "1", "--out", str(tmp_path),
         "--profile"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    for algo in ("dpo", "sft"):
        ours, trl = report["losses"]["3m"][algo]
        assert abs(ours - trl) < bench.LOSS_TOLERANCE, (algo, ours, trl)
    assert [r["case"] for r in report["results"]] == ["dpo_fp32", "sft_fp32"]
    for row in report["results"]:
        for side in ("ours", "trl"):
            assert row[side]["samples_per_s"] > 0 and 0 < row[side]["mfu"] < 1 and row[side]["peak_mem_mb"] > 0
        assert row["ratio"] == pytest.approx(row["ours"]["samples_per_s"] / row["trl"]["samples_per_s"])
        ours = row["ours"]  # our MFU counts the tokens our run computes: for DPO a pair's shared prompt once
        data_mfu = ours["mfu"] * ours["tokens_per_s"] / ours["computed_tokens_per_s"]
        assert (ours["computed_tokens_per_s"] < 0.95 * ours["tokens_per_s"]) == (row["case"] == "dpo_fp32")
        assert data_mfu == pytest.approx(row["trl"]["mfu"] * ours["samples_per_s"] / row["trl"]["samples_per_s"])
    table = (tmp_path / "bench.md").read_text()
    assert "| 3m (3.7M) | short | dpo_fp32 |" in table and "| 3m (3.7M) | short | sft_fp32 |" in table
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    cost = report["checkpoints"]["3m"]  # two checkpoints written, timed against a step
    assert cost["checkpoint_s"] > 0 and cost["share"] == pytest.approx(cost["checkpoint_s"] / (100 * cost["step_s"]))
    assert "| 3m |" in table.split("Checkpoints")[1]
    for case in ("dpo_fp32", "sft_fp32"):  # --profile: both sides' operator tables, the same steps (3-4 of 4)
        for side in ("rlhf", "trl"):
            profile = (tmp_path / "profile" / f"3m-short-{case}-{side}" / "profile.txt").read_text()
            assert profile.startswith("steps 3-4: ") and "aten::" in profile, (case, side)
    assert "profiled" in table.splitlines()[0]  # the header says the timings carry the profiler


def test_on_a_gpu_our_side_runs_hardware_gpu_in_the_precision_of_the_case():
    """--device cuda: float32 cases turn hardware=gpu's bf16 off, bf16 cases keep it (no duplicate override, which
    Hydra would refuse), and as shipped ours is hardware=auto's precision (bf16 on a GPU; on a CPU what its
    instructions allow)."""
    def hardware(case, device):
        command = bench._our_command(case, ROOT, ROOT, ROOT, 8, 2, 2, ROOT, [], device)
        return [a for a in command if a.startswith("hardware")]

    assert hardware("dpo_fp32", "cuda") == ["hardware=gpu", "hardware.threads_per_process=2",
                                            "hardware.mixed_precision=no"]
    assert hardware("dpo_bf16", "cuda") == ["hardware=gpu", "hardware.threads_per_process=2"]
    assert hardware("dpo_shipped", "cuda") == ["hardware=gpu", "hardware.threads_per_process=2"]
    assert hardware("dpo_bf16", "cpu") == ["hardware=cpu", "hardware.threads_per_process=2",
                                           "hardware.mixed_precision=bf16"]
    assert hardware("dpo_shipped", "cpu") == ["hardware=cpu", "hardware.threads_per_process=2",
                                              "hardware.mixed_precision=auto"]


def test_levers_runs_each_variant_and_writes_its_table(tmp_path):
    """benchmarks/levers.py at the smallest size: every variant runs (a bad override would fail its run), and the
    table has a row per variant with its rounds' values and the ratio to the defaults (1.00 for the defaults)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "levers.py"), "--rounds", "1", "--steps", "2",
                             "--out", str(tmp_path), "loop=optimizer.fused=false"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in (tmp_path / "levers-3m-short-dpo.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| defaults", "| loop"]  # after the header
    defaults, loop = (row.split(" | ") for row in rows[1:])
    assert defaults[4] == "1.00" and float(loop[3]) > 0 and loop[1] == "optimizer.fused=false"
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "levers.py"), "nonsense"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "write a lever as NAME=OVERRIDES" in bad.stderr
    # --base reaches every run, the defaults' first: a base the config refuses stops the first run
    base = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "levers.py"), "--rounds", "1", "--steps", "2",
                           "--out", str(tmp_path / "base"), "--base", "algo.beta=-1", "loop=optimizer.fused=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert base.returncode != 0 and "algo.beta=-1 must be > 0" in base.stderr + base.stdout, base.stderr[-2000:]
    assert "round 1 defaults" not in base.stdout


def test_attention_kernels_times_flash_and_math(monkeypatch, capsys):
    """benchmarks/attention_kernels.py at one small shape: a row per dtype and length, both kernels timed."""
    spec = importlib.util.spec_from_file_location("attention_kernels", ROOT / "benchmarks" / "attention_kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    monkeypatch.setattr(sys, "argv", ["attention_kernels.py", "--sizes", "3m", "--lengths", "16", "24",
                                      "--batch", "2", "--repeats", "1"])
    assert kernels.main() == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 3m")]
    assert [(row[2], row[3]) for row in rows] == [("bf16", "16"), ("bf16", "24"), ("float32", "16"),
                                                  ("float32", "24")]
    assert all(float(value) > 0 for row in rows for value in row[4:9])


def test_logps_kernels_times_both_ways_and_finds_them_equal(monkeypatch, capsys):
    """benchmarks/logps_kernels.py at small shapes: both ways run, and they agree bit for bit ("equal")."""
    spec = importlib.util.spec_from_file_location("logps_kernels", ROOT / "benchmarks" / "logps_kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    monkeypatch.setattr(kernels, "SHAPES", [(2, 9, 300), (3, 5, 2000)])
    monkeypatch.setattr(sys, "argv", ["logps_kernels.py"])
    kernels.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "one pass" in line]
    assert len(lines) == 4 and all(line.endswith(", equal") for line in lines), lines
    monkeypatch.setattr(kernels, "FUSED_SHAPES", [(2, 9, 8, 300)])
    monkeypatch.setattr(sys, "argv", ["logps_kernels.py", "--fused"])
    kernels.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "fused" in line]
    assert len(lines) == 4 and all(line.endswith(", agree") for line in lines), lines


def test_trl_trainers_build_with_the_best_options_of_each_algorithm(tmp_path):
    """TRL's best side (bench.TRL_BEST) builds for each algorithm at the tiny size, as the GPU check's workers build it
    (use_liger_kernel left out where Liger-Kernel does not import here): a field TRL refuses (SFT's padding_free
    without packing and with a max_length) fails here, not on a lent GPU."""
    import torch

    try:
        import liger_kernel  # noqa: F401

        has_liger = True
    except ImportError:
        has_liger = False
    bench.build_model("3m", tmp_path / "model")
    for algo in ("dpo", "sft", "grpo"):
        data = tmp_path / f"{algo}.jsonl"
        bench.write_jsonl(bench.make_rows(algo, "short", 16), data)
        fields = {k: v for k, v in bench.TRL_BEST[algo].items() if has_liger or k != "use_liger_kernel"}
        spec = {"case": f"{algo}_fp32", "model_dir": str(tmp_path / "model"), "data": str(data), "batch": 8,
                "steps": 1, "out": str(tmp_path / f"trl-{algo}"), "shape": "short", "fields": fields}
        trainer = bench.trl_trainer(spec, 2, torch.device("cpu"))
        assert trainer.args.max_steps == 2 and trainer.args.per_device_train_batch_size == 8
        for key, value in fields.items():
            assert getattr(trainer.args, key) == value, (algo, key)
