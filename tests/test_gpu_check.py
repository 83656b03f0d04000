"""benchmarks/gpu_check.sh: the GPU check rehearsed on the CPU at the tiny size (every section runs, the page and the
JSON are written, the correctness checks pass), its goals judged from what was measured, its plan's estimate and
budget, the profile's summary of a trace, and the paths' comparison with the plain run."""

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
    assert report["header"]["part"] == "all" and report["header"]["plan_estimate_s"] > 0
    checks = [c["check"].split(" = ")[0].split(":")[0] for c in report["correctness"]]
    assert checks == ["DPO first-step loss", "SFT first-step loss", "GRPO first-step loss",
                      "shared-prompt layout under flex attention", "tiled output layer", "shared-prompt layout",
                      "padding-free pairs", "hardware=fsdp, one process", "hardware=zero3, one process",
                      "peft=lora (the adapters start at zero)", "GRPO, 8 completions a prompt",
                      "PPO, 8 completions a prompt", "resume from step 1 of 2"], checks
    rows = {c["check"].split(":")[0]: c for c in report["correctness"]}
    assert rows["shared-prompt layout under flex attention = two plain sequences a pair (DPO loss; gradients)"] == {
        "check": "shared-prompt layout under flex attention = two plain sequences a pair (DPO loss; gradients)",
        "value": "GPU only", "ok": None}
    # FSDP2 refuses one process by design: the row is its message, not a failure
    assert rows["hardware=fsdp, one process"]["ok"] is None
    assert rows["hardware=fsdp, one process"]["value"].startswith("refused: hardware=fsdp needs several processes")
    for name in ("hardware=zero3, one process", "peft=lora (the adapters start at zero)"):  # compared with the plain run
        assert rows[name]["ok"] is True and "tolerance 0.0001" in rows[name]["value"], rows[name]
    for name in ("GRPO, 8 completions a prompt", "PPO, 8 completions a prompt"):
        assert rows[name]["ok"] is True and rows[name]["value"].endswith("(finite)"), rows[name]
    assert all(c["ok"] is not False for c in report["correctness"]), report["correctness"]
    assert report["correctness"][-1]["bit_identical"]  # on a CPU a resume repeats the run bit for bit
    cost = report["checkpoint"]
    assert cost["checkpoint_s"] > 0 and cost["share"] == pytest.approx(cost["checkpoint_s"] / (60 * 30))
    assert cost["share_every_100_steps"] == pytest.approx(cost["checkpoint_s"] / (100 * cost["step_s"]))
    [row] = report["speed"]
    assert (row["size"], row["batch"], row["case"], row["shape"]) == ("3m", 8, "dpo_fp32", "short")
    for side in ("ours", "trl"):
        assert row[side]["samples_per_s"] > 0 and row[side]["peak_mem_mb"] > 0 and 0 < row[side]["mfu"] < 1
    # TRL's best options: Liger-Kernel is not installed here, so the column says why
    assert row["trl_best"] is None and "liger-kernel is not installed" in row["trl_best_why"]
    assert row["trl_best_fields"] == {"use_liger_kernel": True}
    profile = report["profile"]  # the profiled pair: both sides, no GPU events on a CPU
    assert (profile["size"], profile["case"]) == ("3m", "dpo_fp32")
    for side in ("rlhf", "TRL"):
        assert profile[side]["ms_per_step"] > 0 and profile[side]["span_ms"] > 0
        assert profile[side]["gpu_events"] == 0 and profile[side]["idle_share"] is None
    assert (tmp_path / "profile-rlhf.txt").exists() and (tmp_path / "profile-trl.txt").exists()
    kernels = {k["way"]: k for k in report["kernels"]}  # the output layer three ways (Liger not installed here)
    assert kernels["logits whole"]["ms"] > 0 and kernels["our torch tiles"]["ms"] > 0
    assert kernels["our torch tiles"]["loss_error"] < 1e-4 and "not installed" in kernels["Liger"]["failed"]
    assert "a GPU's" in kernels["our Triton kernel"]["failed"]
    skipped = {(s["case"], s.get("lever")): s["why"] for s in report["skipped"]}
    assert skipped[("dpo_bf16", None)] == "the memory record needs a GPU"
    assert skipped[("dpo_fp32", "an option not built yet")].startswith("its option is not built yet")
    [lever] = report["levers"]  # the rehearsal's lever: our DPO with the plain output layer
    assert lever["lever"] == "plain output layer" and lever["speed"] > 0 and lever["memory"] > 0
    pages = list(tmp_path.glob("20*-*.md"))
    assert len(pages) == 1 and "cpu" in pages[0].name and pages[0].name.endswith("-all.md"), pages
    page = pages[0].read_text()
    for heading in ("## Goals", "## Correctness", "## Speed and memory against TRL", "Checkpoint (DPO as shipped, "
                    "batch 8)", "## Profile (3m, batch 8, dpo_fp32, short rows", "| rlhf | (no GPU kernels in the trace)",
                    "## Levers", "## The output layer's log-probabilities", "| hardware=zero3, one process: 3 steps"):
        assert heading in page, heading
    assert "| 3m (4M) | 8 | dpo_fp32 | short | 2 |" in page
    assert "| DPO bf16 ≥ 1.3× TRL's samples/s (real lengths) | not measured | not measured |" in page
    summary = result.stdout.split("\n\n")[-2]  # the table after the page: goals, then each check
    assert "DPO bf16 ≥ 1.3× TRL's samples/s" in summary and "GRPO first-step loss = TRL's" in summary
    assert "device call 1 (the headline" in result.stdout and "--part rest" in result.stdout
    assert (tmp_path / "gpu_check.log").read_text().count("## Goals") == 1


def _row(case, ratio, ours_mb=100.0, trl_mb=200.0, size="100m", batch=8, mfu=0.1, shape="real", ratio_best=None):
    return {"size": size, "batch": batch, "case": case, "shape": shape, "ratio": ratio, "ratio_best": ratio_best,
            "ours": {"peak_mem_mb": ours_mb, "mfu": mfu}, "trl": {"peak_mem_mb": trl_mb}}


def test_goals_are_met_only_by_every_row_that_reads_them_and_unmeasured_ones_say_so():
    data = {"speed": [_row("dpo_bf16", 1.4), _row("dpo_bf16", 1.2, batch=64), _row("sft_bf16", 1.5, ratio_best=1.1),
                      _row("dpo_bf16", 1.5, size="1b", batch=16, mfu=0.41, ours_mb=300.0, trl_mb=250.0),
                      _row("dpo_bf16", 0.5, batch=64, shape="short")],  # short rows: not a real-lengths goal's
            "checkpoint": {"share": 0.019}}
    verdicts = {goal: (measured, verdict) for goal, measured, verdict in gpu_check.goals(data)}
    assert verdicts["DPO bf16 ≥ 1.3× TRL's samples/s (real lengths)"] == (
        "100m b8 1.40×; 100m b64 1.20×; 1b b16 1.50×", "NOT met")
    assert verdicts["SFT bf16 ≥ 1.3× (real lengths)"][1] == "met"
    assert verdicts["ahead of TRL with its best options (Liger-Kernel; SFT padding-free)"] == (
        "100m b8 sft_bf16 1.10×", "met")
    assert verdicts["GRPO (HF generate), 128 new tokens, 8 completions a prompt ≥ 1.5×"] == ("not measured",
                                                                                            "not measured")
    assert verdicts["peak GPU memory ≤ TRL's"][1] == "NOT met"  # the 1b row is above TRL's
    assert verdicts["bf16 MFU, DPO at ~1B, real lengths ≥ 40%"] == ("41.0% (batch 16)", "met")
    assert verdicts["a checkpoint at the default interval, batch 8 ≤ 2% of training"] == ("1.90%", "met")
    data["speed"][2]["ratio_best"] = 0.9
    assert gpu_check.goals(data)[3][2] == "NOT met"
    data["checkpoint"] = {"share": 0.021}
    assert gpu_check.goals(data)[-1][2] == "NOT met"


def test_sections_left_out_are_named_and_an_unknown_one_is_refused():
    """--skip layouts,kernels: a later device call spends its budget on what an earlier one did not reach."""
    import argparse

    assert gpu_check.skipped_sections("layouts, kernels") == {"layouts", "kernels"}
    assert gpu_check.skipped_sections("") == set()
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section.*layout; the sections are losses, layouts"):
        gpu_check.skipped_sections("layout")


def test_the_plan_names_what_the_benchmark_has_and_pairs_are_chosen_from_it():
    gpu_check.check_plan(gpu_check.PLAN)
    with pytest.raises(ValueError, match="unknown size, case or shape"):
        gpu_check.check_plan([("100m", 8, "dpo_bf17", "real")])
    with pytest.raises(ValueError, match="unknown size, case or shape"):
        gpu_check.check_plan([("100m", 8, "dpo_bf16", "longer")])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        gpu_check.check_plan([("100m", 12, "grpo_bf16", "real")])
    plans = gpu_check.plans
    assert plans.parse_pairs("100m/32/sft_bf16, 1b/16/dpo_bf16", plans.HEADLINE) == [
        ("1b", 16, "dpo_bf16", "real"), ("100m", 32, "sft_bf16", "real")]  # in the plan's order
    assert plans.parse_pairs("100m/64/dpo_bf16/short", plans.PLAN) == [("100m", 64, "dpo_bf16", "short")]
    with pytest.raises(ValueError, match="not in this part's plan. Fix: one of 1b/16/dpo_bf16/real"):
        plans.parse_pairs("1b/64/dpo_bf16", plans.HEADLINE)


def test_the_estimate_scales_with_tokens_and_rounds_and_learns_from_the_pairs_run():
    plans = gpu_check.plans
    real, short = (plans.step_seconds("1b", 16, "dpo_bf16", shape) for shape in ("real", "short"))
    assert real == pytest.approx(16 * 2 * 641 / plans.TOKENS_PER_S[("1b", "dpo")])  # padded tokens at the rate
    assert short == plans.STEP_FLOOR_S["1b"]  # 16 short pairs: launch-bound
    grpo = plans.step_seconds("100m", 16, "grpo_bf16", "real")
    assert grpo > 128 * plans.DECODE_S_PER_TOKEN["100m"]  # a forward pass per new token (128 at real lengths)
    one = plans.run_seconds("1b", 16, "dpo_bf16", "real")
    assert one == pytest.approx(plans.STARTUP_S["1b"] + 2 * plans.STEPS[("1b", "dpo")] * real)
    assert plans.pair_seconds("1b", 16, "dpo_bf16", "real", 3, 3) == pytest.approx(9 * one)
    assert plans.calibrated(100.0, []) == 100.0
    assert plans.calibrated(100.0, [(50.0, 75.0), (50.0, 75.0)]) == pytest.approx(150.0)
    assert plans.calibrated(100.0, [(10.0, 100.0)]) == 300.0 and plans.calibrated(100.0, [(10.0, 1.0)]) == 50.0
    # the headline's first pair and its profile fit the first call's default budget; the whole headline does not
    first = plans.pair_seconds(*plans.HEADLINE[0], 3, 3) + plans.LIGER_FIRST_S + 2 * one
    assert first < 400 < plans.plan_seconds(plans.HEADLINE, 3)


def test_a_budget_skips_what_would_pass_it_and_bounds_each_run(monkeypatch):
    import time

    import gpu_check_state

    budget = gpu_check_state.SectionBudget(time.perf_counter() - 100.0, 400.0, 55.0)
    assert budget.fits(299.0) and not budget.fits(301.0)
    assert gpu_check.bench.TIMEOUT_S == pytest.approx(355.0, abs=1.0)
    assert gpu_check_state.SectionBudget(time.perf_counter() - 100.0, 10.0, 0.0, enforced=False).fits(1e9)


def test_a_trace_gives_the_top_kernels_and_the_share_of_the_window_the_gpu_sits_idle():
    import gpu_check_speed

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [event("cpu_op", "aten::mm", 0, 1000),  # the window: 0 to 1000 us
                             event("kernel", "gemm", 100, 200), event("kernel", "gemm", 250, 150),  # overlapping
                             event("kernel", "softmax", 600, 100), event("gpu_memcpy", "copy", 900, 50),
                             {"ph": "i", "name": "marker", "ts": 5000}]}  # not a span
    summary = gpu_check_speed.trace_summary(trace)
    assert summary["span_ms"] == pytest.approx(1.0) and summary["gpu_events"] == 4
    assert summary["busy_ms"] == pytest.approx(0.45)  # 100-400, 600-700, 900-950
    assert summary["idle_share"] == pytest.approx(0.55)
    assert summary["kernels"] == [{"name": "gemm", "calls": 2, "ms": pytest.approx(0.35), "share": pytest.approx(0.35 / 0.45)},
                                  {"name": "softmax", "calls": 1, "ms": pytest.approx(0.1), "share": pytest.approx(0.1 / 0.45)}]
    cpu = gpu_check_speed.trace_summary({"traceEvents": [event("cpu_op", "aten::mm", 0, 10)]})
    assert cpu["idle_share"] is None and cpu["kernels"] == [] and cpu["gpu_events"] == 0


def test_a_path_is_compared_with_the_plain_run_where_the_math_is_the_same():
    from gpu_check_correctness import PATH_STEPS, compare_logs, refusal

    def logs(loss, logp=-100.0):
        return [{"train/loss": loss + k, "train/logps/chosen": logp, "train/logps/rejected": logp - 1}
                for k in range(PATH_STEPS)]

    plain = logs(0.69)
    assert compare_logs(plain, logs(0.69), "steps") == (0.0, True)
    worst, ok = compare_logs(plain, logs(0.69 + 2e-4), "steps")  # a later step's loss moved
    assert not ok and worst == pytest.approx(2e-4)
    assert compare_logs(plain, logs(0.8), "first")[1]  # "first": only the policy before any update
    assert not compare_logs(plain, logs(0.69, logp=-100.02), "first")[1]  # 2e-4 relative
    assert compare_logs(plain, logs(float("nan")), None) == (0.0, False)  # online RL: finite losses only
    assert not compare_logs(plain, logs(0.69)[:1], None)[1]  # a run that stopped early
    said = "[x][rlhf][ERROR] - error: hardware=fsdp needs several processes. Fix: hardware.num_processes=2"
    assert refusal("log\n" + said) == "hardware=fsdp needs several processes. Fix: hardware.num_processes=2"
    assert refusal("Traceback ...\nRuntimeError: boom") is None


@pytest.mark.parametrize("lever", [lever for lever in gpu_check.LEVERS if lever[5] is not None],
                         ids=lambda lever: f"{lever[0]}-{lever[2]}-{lever[4]}")
def test_each_lever_composes_and_passes_the_config_check(lever):
    """The GPU runs each lever's overrides once: a typo there would cost a lent minute, so each composes here."""
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    size, batch, case, shape, _, overrides = lever
    algo, case_overrides, _ = gpu_check.bench.CASES[case]
    check_config(compose_config(f"algo={algo}", *case_overrides, *overrides))


def test_a_pair_of_several_rounds_alternates_the_sides_and_reports_the_medians(tmp_path, monkeypatch):
    """Three rounds: ours, TRL, TRL's best, ours, ... (each a process of its own): the row is each side's median run
    and the ratios of the medians, with every round's ratio (red if the sides run in blocks, or a mean is taken)."""
    calls, ours_speeds = [], iter([100.0, 300.0, 200.0])
    trl_speeds, best_speeds = iter([100.0, 150.0, 400.0]), iter([50.0, 100.0, 400.0])

    def ours(case, model_dir, data, work, batch, steps, threads, extra, device, shape):
        calls.append("ours")
        return {"samples_per_s": next(ours_speeds), "peak_mem_mb": 10.0}

    def trl(case, model_dir, data, work, batch, steps, threads, device, shape, fields=None):
        calls.append("trl_best" if fields else "trl")
        assert fields in (None, {"use_liger_kernel": True})
        return {"samples_per_s": next(best_speeds if fields else trl_speeds), "peak_mem_mb": 20.0}

    monkeypatch.setattr(gpu_check.bench, "run_ours", ours)
    monkeypatch.setattr(gpu_check.bench, "run_trl", trl)
    import gpu_check_speed

    monkeypatch.setattr(gpu_check_speed, "best_options_missing", lambda: None)
    row = gpu_check.speed_pair("3m", 8, "dpo_fp32", "short", tmp_path, 1000, tmp_path, "cpu", {"float32": 1e12}, 2,
                               rounds=3)
    assert calls == ["ours", "trl", "trl_best"] * 3
    assert row["ours"]["samples_per_s"] == 200.0 and row["trl"]["samples_per_s"] == 150.0
    assert row["ratio"] == pytest.approx(200 / 150) and row["ratio_best"] == pytest.approx(2.0)
    assert row["round_ratios"] == pytest.approx([1.0, 2.0, 0.5])
    assert row["round_ratios_best"] == pytest.approx([2.0, 3.0, 0.5])
    assert gpu_check.ratio_cell(row) == "**1.33×** (0.50–2.00, 3 rounds)"
    assert gpu_check.ratio_cell(row, best=True) == "**2.00×** (0.50–3.00, 3 rounds)"
    assert gpu_check.ratio_cell({"ratio": 1.2, "round_ratios": [1.2]}) == "**1.20×**"
    assert gpu_check.ratio_cell({"ratio": 1.2, "ratio_best": None}, best=True) == "-"
    assert gpu_check.median_run([{"samples_per_s": s} for s in (4.0, 1.0, 3.0, 2.0)]) == {"samples_per_s": 2.0}
