"""benchmarks/gpu_check.sh: the GPU check rehearsed on the CPU at the tiny size (every section runs, the page and the
JSON are written, the correctness checks pass), and its goals judged from what was measured."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_the_rehearsal_runs_every_section_and_writes_the_page(tmp_path):
    env = {**os.environ, "WHEELS": "none", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--device", "cpu"], capture_output=True,
                            text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The import check ran (what a library logs at import may come before its line, so not "the first line").
    assert any(line.startswith("versions: torch ") for line in result.stdout.splitlines()), result.stdout[:3000]
    assert "gemm_4bit_forward" not in result.stdout  # bitsandbytes' notice of a Hub kernel, quieted (tests/test_bitsandbytes_notice.py)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = [c["check"].split(" = ")[0] for c in report["correctness"]]
    assert checks == ["DPO first-step loss", "SFT first-step loss", "GRPO first-step loss", "tiled output layer",
                      "shared-prompt layout", "padding-free pairs", "resume from step 1 of 2"], checks
    assert all(c["ok"] for c in report["correctness"]), report["correctness"]
    assert report["correctness"][-1]["bit_identical"]  # on a CPU a resume repeats the run bit for bit
    cost = report["checkpoint"]
    assert cost["checkpoint_s"] > 0 and cost["share"] == pytest.approx(cost["checkpoint_s"] / (60 * 30))
    assert cost["share_every_100_steps"] == pytest.approx(cost["checkpoint_s"] / (100 * cost["step_s"]))
    [row] = report["speed"]
    assert (row["size"], row["batch"], row["case"]) == ("3m", 8, "grpo_fp32")
    for side in ("ours", "trl"):
        assert row[side]["samples_per_s"] > 0 and row[side]["peak_mem_mb"] > 0 and 0 < row[side]["mfu"] < 1
    kernels = {k["way"]: k for k in report["kernels"]}  # the output layer three ways (Liger not installed here)
    assert kernels["logits whole"]["ms"] > 0 and kernels["our tiles"]["ms"] > 0
    assert kernels["our tiles"]["loss_error"] < 1e-4 and "not installed" in kernels["Liger"]["failed"]
    assert {"size": "100m", "batch": 64, "case": "dpo_bf16", "why": "the memory record needs a GPU"} in report["skipped"]
    [lever] = report["levers"]  # the rehearsal's lever: our GRPO with the plain output layer
    assert lever["lever"] == "plain output layer" and lever["speed"] > 0 and lever["memory"] > 0
    pages = list(tmp_path.glob("20*-*.md"))
    assert len(pages) == 1 and "cpu" in pages[0].name, pages  # named after the machine
    page = pages[0].read_text()
    for heading in ("## Goals", "## Correctness", "## Speed and memory", "Checkpoint (DPO as shipped, batch 8)",
                    "## Levers", "## The output layer's log-probabilities"):
        assert heading in page, heading
    assert "| 3m (4M) | 8 | grpo_fp32 | 1 |" in page
    assert "| DPO bf16 ≥ 1.3× TRL's samples/s | not measured | not measured |" in page
    summary = result.stdout.split("\n\n")[-1]  # the table after the page: goals, then each check
    assert "DPO bf16 ≥ 1.3× TRL's samples/s" in summary and "GRPO first-step loss = TRL's" in summary
    assert (tmp_path / "gpu_check.log").read_text().count("## Goals") == 1


def _row(case, ratio, ours_mb=100.0, trl_mb=200.0, size="100m", batch=8, mfu=0.1):
    return {"size": size, "batch": batch, "case": case, "ratio": ratio,
            "ours": {"peak_mem_mb": ours_mb, "mfu": mfu}, "trl": {"peak_mem_mb": trl_mb}}


def test_goals_are_met_only_by_every_row_that_reads_them_and_unmeasured_ones_say_so():
    data = {"speed": [_row("dpo_bf16", 1.4), _row("dpo_bf16", 1.2, batch=64), _row("sft_bf16", 1.5),
                      _row("dpo_bf16", 1.5, size="1b", batch=64, mfu=0.41, ours_mb=300.0, trl_mb=250.0)],
            "checkpoint": {"share": 0.019}}
    verdicts = {goal: (measured, verdict) for goal, measured, verdict in gpu_check.goals(data)}
    assert verdicts["DPO bf16 ≥ 1.3× TRL's samples/s"] == ("100m b8 1.40×; 100m b64 1.20×; 1b b64 1.50×", "NOT met")
    assert verdicts["SFT bf16 ≥ 1.3×"][1] == "met"
    assert verdicts["GRPO (HF generate), 8 completions a prompt ≥ 1.5×"] == ("not measured", "not measured")
    assert verdicts["peak GPU memory ≤ TRL's"][1] == "NOT met"  # the 1b row is above TRL's
    assert verdicts["bf16 MFU, DPO at ~1B, batch 64 ≥ 40%"] == ("41.0%", "met")
    assert verdicts["a checkpoint at the default interval, batch 8 ≤ 2% of training"] == ("1.90%", "met")
    data["checkpoint"] = {"share": 0.021}
    assert gpu_check.goals(data)[-1][2] == "NOT met"


def test_sections_left_out_are_named_and_an_unknown_one_is_refused():
    """--skip layouts,kernels: a later device call spends its budget on what an earlier one did not reach."""
    import argparse

    assert gpu_check.skipped_sections("layouts, kernels") == {"layouts", "kernels"}
    assert gpu_check.skipped_sections("") == set()
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section.*layout; the sections are losses, layouts"):
        gpu_check.skipped_sections("layout")


def test_the_plan_names_what_the_benchmark_has():
    gpu_check.check_plan(gpu_check.PLAN)
    with pytest.raises(ValueError, match="unknown size or case"):
        gpu_check.check_plan([("100m", 8, "dpo_bf17")])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        gpu_check.check_plan([("100m", 12, "grpo_bf16")])


@pytest.mark.parametrize("lever", gpu_check.LEVERS, ids=lambda lever: f"{lever[0]}-{lever[2]}-{lever[3]}")
def test_each_lever_composes_and_passes_the_config_check(lever):
    """The GPU runs each lever's overrides once: a typo there would cost a lent minute, so each composes here."""
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    size, batch, case, _, overrides = lever
    algo, case_overrides, _ = gpu_check.bench.CASES[case]
    check_config(compose_config(f"algo={algo}", *case_overrides, *overrides))


def test_a_pair_of_several_rounds_alternates_the_sides_and_reports_the_medians(tmp_path, monkeypatch):
    """Three rounds: ours, TRL, ours, TRL, ours, TRL (each a process of its own); the row is each side's median run
    and the ratio of the medians, with every round's ratio (red if the sides run in blocks, or a mean is taken)."""
    calls, ours_speeds, trl_speeds = [], iter([100.0, 300.0, 200.0]), iter([100.0, 150.0, 400.0])

    def ours(case, model_dir, data, work, batch, steps, threads, extra, device):
        calls.append("ours")
        return {"samples_per_s": next(ours_speeds), "peak_mem_mb": 10.0}

    def trl(case, model_dir, data, work, batch, steps, threads, device):
        calls.append("trl")
        return {"samples_per_s": next(trl_speeds), "peak_mem_mb": 20.0}

    monkeypatch.setattr(gpu_check.bench, "run_ours", ours)
    monkeypatch.setattr(gpu_check.bench, "run_trl", trl)
    row = gpu_check.speed_pair("3m", 8, "dpo_fp32", tmp_path, 1000, tmp_path, "cpu", {"float32": 1e12}, 2, rounds=3)
    assert calls == ["ours", "trl"] * 3
    assert row["ours"]["samples_per_s"] == 200.0 and row["trl"]["samples_per_s"] == 150.0
    assert row["ratio"] == pytest.approx(200 / 150)
    assert row["round_ratios"] == pytest.approx([1.0, 2.0, 0.5])
    assert gpu_check.ratio_cell(row) == "**1.33×** (0.50–2.00, 3 rounds)"
    assert gpu_check.ratio_cell({"ratio": 1.2, "round_ratios": [1.2]}) == "**1.20×**"
    assert gpu_check.median_run([{"samples_per_s": s} for s in (4.0, 1.0, 3.0, 2.0)]) == {"samples_per_s": 2.0}
