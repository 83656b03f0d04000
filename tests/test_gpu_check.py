"""benchmarks/gpu_check.sh: the GPU check rehearsed on the CPU at the tiny size (every section runs, the page and the
JSON are written, the correctness checks pass), its goals judged from what was measured, its plan's estimate and
budget, the profile's summary of a trace, and the paths' comparison with the plain run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhf.core.auto_choices import CHOICES
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench  # noqa: E402
from gpu_check import plan as plans  # noqa: E402
from gpu_check import state  # noqa: E402
from gpu_check.page.defaults import shown  # noqa: E402
from gpu_check.page.markdown import goals  # noqa: E402
from gpu_check.sections import correctness, preflight, speed, timed  # noqa: E402
from gpu_check.workers import isolated, turns, worker  # noqa: E402


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
    assert checks == ["preflight"] * 4 + ["DPO first-step loss", "SFT first-step loss", "GRPO first-step loss",
                      "shared-prompt layout under flex attention", "tiled output layer", "shared-prompt layout",
                      "padding-free pairs", "hardware=fsdp, one process", "hardware=zero3, one process",
                      "peft=lora (the adapters start at zero)", "GRPO, 8 completions a prompt",
                      "PPO, 8 completions a prompt", "resume from step 1 of 2"], checks
    rows = {c["check"].split(":")[0]: c for c in report["correctness"]}
    probed = {c["check"].split(": ", 1)[1].split(" = ")[0]: c for c in report["correctness"][:4]}
    assert all(c["ok"] is True for c in probed.values()), probed  # each GPU path's probe, at a CPU's sizes
    assert "tokens equal" in probed["static decoding"]["value"], probed  # greedy and sampled against generate
    assert "blocks skipped" in probed["pairs packed under flex attention with layout_masks' block mask"]["value"]
    assert "T=0.7, with a bias" in probed["the output layer's Triton kernel"]["value"]  # under Triton's interpreter
    assert rows["shared-prompt layout under flex attention = two plain sequences a pair (DPO loss; gradients)"] == {
        "check": "shared-prompt layout under flex attention = two plain sequences a pair (DPO loss; gradients)",
        "value": "GPU only", "ok": None}
    for name in ("hardware=fsdp, one process", "hardware=zero3, one process",
                 "peft=lora (the adapters start at zero)"):  # compared with the plain run
        assert rows[name]["ok"] is True and "tolerance 0.0001" in rows[name]["value"], rows[name]
    for name in ("GRPO, 8 completions a prompt", "PPO, 8 completions a prompt"):
        assert rows[name]["ok"] is True and rows[name]["value"].endswith("(finite)"), rows[name]
    assert all(c["ok"] is not False for c in report["correctness"]), report["correctness"]
    assert report["correctness"][-1]["bit_identical"]  # on a CPU a resume repeats the run bit for bit
    cost = report["checkpoint"]
    assert cost["checkpoint_s"] > 0 and cost["share"] == pytest.approx(cost["checkpoint_s"] / (60 * 30))
    assert cost["share_every_100_steps"] == pytest.approx(cost["checkpoint_s"] / (100 * cost["step_s"]))
    row, second = report["speed"]  # the second pair built in the same workers, after the first was freed
    assert (row["size"], row["batch"], row["case"], row["shape"]) == ("3m", 8, "dpo_fp32", "short")
    assert second["case"] == "sft_fp32" and second["failed"] == {} and second["trl"]["samples_per_s"] > 0
    assert second["blocks"] and not row["blocks"]  # in blocks: each side's run freed before the next is built
    for side in ("ours", "trl"):
        assert row[side]["samples_per_s"] > 0 and row[side]["peak_mem_mb"] > 0 and 0 < row[side]["mfu"] < 1
    # TRL's best options: Liger-Kernel is not installed here, so the column says why
    assert row["trl_best"] is None and "liger-kernel does not import here" in row["trl_best_why"]
    assert len(row["samples_per_s"]["ours"]) == 1 and row["failed"] == {}  # one window (rounds 1 on the CPU)
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
    low, high = lever["speed_range"]  # each round's ratio, turn by turn: what a default's verdict reads
    assert 0 < low <= high
    pages = list(tmp_path.glob("20*-*.md"))
    assert len(pages) == 1 and "cpu" in pages[0].name and pages[0].name.endswith("-all.md"), pages
    page = pages[0].read_text()
    compile_choice = shown(CHOICES["hardware.compile"].gpu)
    for heading in ("## Goals", "## Correctness", "## Speed and memory against TRL", "Checkpoint (DPO as shipped, "
                    "batch 8)", "## Profile (3m, batch 8, dpo_fp32, short rows", "| rlhf | (no GPU kernels in the trace)",
                    "## Levers", "## The output layer's log-probabilities", "| hardware=zero3, one process: 3 steps",
                    "## The `auto` defaults on a GPU", f"| `hardware.compile` | {compile_choice} |"):
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
    verdicts = {goal: (measured, verdict) for goal, measured, verdict in goals(data)}
    assert verdicts["DPO bf16 ≥ 1.3× TRL's samples/s (real lengths)"] == (
        "100m b8 1.40×; 100m b64 1.20×; 1b b16 1.50×", "NOT met")
    assert verdicts["SFT bf16 ≥ 1.3× (real lengths)"][1] == "met"
    best = "ahead of TRL with its best options (Liger-Kernel)"
    assert verdicts[best][1] == "not measured"  # rows without a best side (it failed, or did not run): not judged
    assert verdicts[best][0].startswith("not measured (100m b8 dpo_bf16: not run; ")
    assert verdicts["GRPO (static-cache decoding), 128 new tokens, 8 completions a prompt ≥ 1.5×"] == (
        "not measured", "not measured")
    assert verdicts["peak GPU memory ≤ TRL's"][1] == "NOT met"  # the 1b row is above TRL's
    assert verdicts["bf16 MFU, DPO at ~1B, real lengths ≥ 40%"] == ("41.0% (batch 16)", "met")
    assert verdicts["a checkpoint at the default interval, batch 8 ≤ 2% of training"] == ("1.90%", "met")
    for row in data["speed"]:
        row["ratio_best"] = 1.1
    assert goals(data)[3][2] == "met"
    data["speed"][2]["ratio_best"] = 0.9
    assert goals(data)[3][2] == "NOT met"
    data["checkpoint"] = {"share": 0.021}
    assert goals(data)[-1][2] == "NOT met"


def test_sections_left_out_are_named_and_an_unknown_one_is_refused():
    """--skip layouts,kernels: a later device call spends its budget on what an earlier one did not reach."""
    import argparse

    assert state.skipped_sections("layouts, kernels") == {"layouts", "kernels"}
    assert state.skipped_sections("") == set()
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section.*layout; the sections are losses, layouts"):
        state.skipped_sections("layout")


def test_the_plan_names_what_the_benchmark_has_and_pairs_are_chosen_from_it():
    plans.check_plan(plans.PLAN)
    with pytest.raises(ValueError, match="unknown size, case or shape"):
        plans.check_plan([("100m", 8, "dpo_bf17", "real")])
    with pytest.raises(ValueError, match="unknown size, case or shape"):
        plans.check_plan([("100m", 8, "dpo_bf16", "longer")])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        plans.check_plan([("100m", 12, "grpo_bf16", "real")])
    assert plans.parse_pairs("100m/32/sft_bf16, 1b/16/dpo_bf16", plans.HEADLINE) == [
        ("1b", 16, "dpo_bf16", "real"), ("100m", 32, "sft_bf16", "real")]  # in the plan's order
    assert plans.parse_pairs("100m/64/dpo_bf16/short", plans.PLAN) == [("100m", 64, "dpo_bf16", "short")]
    with pytest.raises(ValueError, match="not in this part's plan. Fix: one of 1b/16/dpo_bf16/real"):
        plans.parse_pairs("1b/64/dpo_bf16", plans.HEADLINE)


def test_the_estimate_scales_with_tokens_and_rounds_and_learns_from_the_pairs_run():
    real, short = (plans.step_seconds("1b", 16, "dpo_bf16", shape) for shape in ("real", "short"))
    assert real == pytest.approx(16 * 2 * 641 / plans.TOKENS_PER_S[("1b", "dpo")])  # padded tokens at the rate
    assert short == plans.STEP_FLOOR_S["1b"]  # 16 short pairs: launch-bound
    grpo = plans.step_seconds("100m", 16, "grpo_bf16", "real")
    assert grpo > 128 * plans.DECODE_S_PER_TOKEN["100m"]  # a forward pass per new token (128 at real lengths)
    steps = plans.steps_for("1b", 16, "dpo_bf16", "real")
    assert steps == 3 and plans.steps_for("100m", 16, "sft_bf16", "real") == 36  # ~2 s of GPU work a window
    one = plans.run_seconds("1b", 16, "dpo_bf16", "real")
    assert one == pytest.approx(plans.STARTUP_S["1b"] + 2 * steps * real)
    pair = plans.pair_seconds("1b", 16, "dpo_bf16", "real", 3, 3)  # built once a side, then 9 windows by turns
    assert pair == pytest.approx(3 * (plans.BUILD_S["1b"] + 3 * real) + 9 * (steps * real + plans.TURN_S))
    assert plans.calibrated(100.0, []) == 100.0
    assert plans.calibrated(100.0, [(50.0, 75.0), (50.0, 75.0)]) == pytest.approx(150.0)
    assert plans.calibrated(100.0, [(10.0, 100.0)]) == 300.0 and plans.calibrated(100.0, [(10.0, 1.0)]) == 50.0
    # the whole headline (3 rounds, three sides, the profile, every cost charged) fits its device call's budget with
    # a 5% margin, and that call's limit leaves the grace and a minute; the rest takes what the session leaves
    (_, headline, headline_limit), (_, rest, rest_limit) = state.DEVICE_CALLS
    budget = int(headline.split("--budget-s ")[1])
    assert plans.plan_seconds(plans.HEADLINE, 3, profiled=plans.PROFILE_CASE) <= 0.95 * budget and budget <= 480
    assert plans.plan_seconds(plans.HEADLINE + plans.LATER[:1], 3, profiled=plans.PROFILE_CASE) > 0.95 * budget
    assert headline_limit >= budget + state.GRACE_S + 60 and headline_limit <= 900 - 60 - 240
    assert rest_limit is None and state.rest_call(239) is None  # no machine starts with less than 4 minutes
    command, limit = state.rest_call(900 - 90 - headline_limit)  # a 900 s session, a machine start of 90 s
    assert limit <= 900 - 90 - headline_limit and limit >= int(command.split("--budget-s ")[1]) + state.GRACE_S + 60
    assert plans.parse_pairs("1b/32/dpo_bf16", plans.HEADLINE + plans.LATER) == [("1b", 32, "dpo_bf16", "real")]


def test_a_budget_skips_what_would_pass_it_and_bounds_each_run_by_the_deadline(monkeypatch):
    import time


    budget = state.SectionBudget(time.perf_counter() - 100.0, 400.0, 55.0)
    assert budget.fits(299.0) and not budget.fits(301.0)
    assert bench.timeout_s() == pytest.approx(355.0, abs=1.0)  # a run of its own: until the deadline
    monkeypatch.setattr(bench, "DEADLINE", time.perf_counter() + 100.0)
    time.sleep(0.2)
    assert bench.timeout_s() == pytest.approx(99.8, abs=0.1)  # read when the run starts, not once a pair
    monkeypatch.setattr(bench, "DEADLINE", time.perf_counter() - 100.0)
    assert bench.timeout_s() == 5.0
    assert state.SectionBudget(time.perf_counter() - 100.0, 10.0, 0.0, enforced=False).fits(1e9)
    assert bench.DEADLINE is None


def test_a_trace_gives_the_top_kernels_and_the_share_of_the_window_the_gpu_sits_idle():

    def event(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [event("cpu_op", "aten::mm", 0, 1000),  # the window: 0 to 1000 us
                             event("kernel", "gemm", 100, 200), event("kernel", "gemm", 250, 150),  # overlapping
                             event("kernel", "softmax", 600, 100), event("gpu_memcpy", "copy", 900, 50),
                             {"ph": "i", "name": "marker", "ts": 5000}]}  # not a span
    summary = speed.trace_summary(trace)
    assert summary["span_ms"] == pytest.approx(1.0) and summary["gpu_events"] == 4
    assert summary["busy_ms"] == pytest.approx(0.45)  # 100-400, 600-700, 900-950
    assert summary["idle_share"] == pytest.approx(0.55)
    assert summary["kernels"] == [{"name": "gemm", "calls": 2, "ms": pytest.approx(0.35), "share": pytest.approx(0.35 / 0.45)},
                                  {"name": "softmax", "calls": 1, "ms": pytest.approx(0.1), "share": pytest.approx(0.1 / 0.45)}]
    cpu = speed.trace_summary({"traceEvents": [event("cpu_op", "aten::mm", 0, 10)]})
    assert cpu["idle_share"] is None and cpu["kernels"] == [] and cpu["gpu_events"] == 0


def test_a_path_is_compared_with_the_plain_run_where_the_math_is_the_same():
    from gpu_check.sections.correctness import PATH_STEPS, compare_logs, refusal

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


@pytest.mark.parametrize("lever", [lever for lever in plans.LEVERS if lever[5] is not None],
                         ids=lambda lever: f"{lever[0]}-{lever[2]}-{lever[4]}")
def test_each_lever_composes_and_passes_the_config_check(lever):
    """The GPU runs each lever's overrides once: a typo there would cost a lent minute, so each composes here, on the
    hardware the check's runs of ours use there (``hardware=gpu``: flex attention is refused on a CPU)."""
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    size, batch, case, shape, _, overrides = lever
    algo, case_overrides, _ = bench.CASES[case]
    check_config(compose_config(f"algo={algo}", "hardware=gpu", *case_overrides, *overrides))


class FakeWorker:
    """A side's worker that answers at once: each window's samples/s from ``speeds``; ``fails``: the op it fails."""

    def __init__(self, side, calls, speeds, fails=None):
        self.side, self.calls, self.speeds, self.fails = side, calls, speeds, fails

    def ask(self, command, deadline):

        self.calls.append((command["op"], self.side))
        if command["op"] == self.fails:
            raise turns.SideFailed(f"{self.side} {command['op']} failed")
        if command["op"] == "run":
            return {"samples_per_s": next(self.speeds), "peak_mem_mb": 10.0, "compiles": 0}
        return {}


class FakePool:
    def __init__(self, workers):
        self.workers, self.dropped = workers, []

    def get(self, side):
        return self.workers[side]

    def drop(self, side):
        self.dropped.append(side)


def test_a_pair_times_its_sides_by_turns_and_reports_the_medians(tmp_path, monkeypatch):
    """Three rounds: ours, TRL, TRL's best, ours, ... (each side built once in its worker, then one window a turn):
    the row is each side's median window and the ratios of the medians, with every round's ratio (red if the sides
    run in blocks, or a mean is taken)."""

    calls = []
    pool = FakePool({"ours": FakeWorker("ours", calls, iter([100.0, 300.0, 200.0])),
                     "trl": FakeWorker("trl", calls, iter([100.0, 150.0, 400.0])),
                     "trl_best": FakeWorker("trl_best", calls, iter([50.0, 100.0, 400.0]))})
    monkeypatch.setattr(speed, "best_options_missing", lambda: None)
    row = speed.speed_pair("3m", 8, "dpo_fp32", "short", tmp_path, 1000, tmp_path, "cpu", {"float32": 1e12}, 2,
                               3, pool, 0.0, 1, ["hardware.compile=false"])
    builds = [("build", side) for side in ("ours", "trl", "trl_best")]
    frees = [("free", side) for side in ("ours", "trl", "trl_best")]
    assert calls == builds + [("run", "ours"), ("run", "trl"), ("run", "trl_best")] * 3 + frees
    assert row["ours"]["samples_per_s"] == 200.0 and row["trl"]["samples_per_s"] == 150.0
    assert row["ratio"] == pytest.approx(200 / 150) and row["ratio_best"] == pytest.approx(2.0)
    assert row["round_ratios"] == pytest.approx([1.0, 2.0, 0.5])
    assert row["round_ratios_best"] == pytest.approx([2.0, 3.0, 0.5])
    assert row["fallbacks"] == ["hardware.compile=false"] and row["compiles"]["ours"] == [0, 0, 0]
    assert speed.ratio_cell(row) == "**1.33×** (0.50–2.00, 3 rounds)"
    assert speed.ratio_cell(row, best=True) == "**2.00×** (0.50–3.00, 3 rounds)"
    assert speed.ratio_cell({"ratio": 1.2, "round_ratios": [1.2]}) == "**1.20×**"
    assert speed.ratio_cell({"ratio": 1.2, "ratio_best": None}, best=True) == "-"
    assert speed.median_run([{"samples_per_s": s} for s in (4.0, 1.0, 3.0, 2.0)]) == {"samples_per_s": 2.0}


def test_a_failed_side_is_dropped_and_named_and_blocks_free_each_side_before_the_next():
    """TRL's best failing its second window: its worker is dropped, its later turns left out, the others go on; with
    blocks each side runs all its windows, then frees its run before the next side is built."""
    from gpu_check.workers.turns import pair_runs, turns

    assert turns(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert turns(["a", "b"], 2, blocks=True) == [(0, "a"), (1, "a"), (0, "b"), (1, "b")]
    calls = []
    speeds = iter([1.0] * 20)
    pool = FakePool({"ours": FakeWorker("ours", calls, speeds), "trl": FakeWorker("trl", calls, speeds),
                     "trl_best": FakeWorker("trl_best", calls, speeds, fails="run")})
    specs = {"ours": {}, "trl": {}, "trl_best": {}}
    runs, failed = pair_runs(specs, 2, 1, 1, pool, 0.0)
    assert [len(runs[s]) for s in specs] == [2, 2, 0] and failed == {"trl_best": "trl_best run failed"}
    assert pool.dropped == ["trl_best"] and ("run", "trl_best") in calls and ("free", "trl_best") not in calls
    calls.clear()
    pool = FakePool({side: FakeWorker(side, calls, speeds) for side in ("ours", "trl")})
    pair_runs({"ours": {}, "trl": {}}, 2, 1, 1, pool, 0.0, blocks=True)
    assert calls == [("build", "ours"), ("run", "ours"), ("run", "ours"), ("free", "ours"),
                     ("build", "trl"), ("run", "trl"), ("run", "trl"), ("free", "trl")]


def test_a_gpu_path_that_fails_its_preflight_is_not_measured_and_auto_falls_back_by_name(tmp_path, monkeypatch):
    """A probe that raises (faked here) gives a failed row, and the levers that ask for its path are skipped; where
    auto picks that path on a GPU (here the Triton kernel and static decoding, as the table would after a page
    measured them) it is turned off by its named override for the call, which reaches every run of ours whose
    algorithm has the key (not GRPO's generation in DPO's runs); a lever's own value of the key wins."""
    import dataclasses

    from rlhf.core import auto_choices

    table = dict(auto_choices.CHOICES)
    table["algo.fused_output_layer"] = dataclasses.replace(table["algo.fused_output_layer"], gpu="triton")
    table["algo.generation"] = dataclasses.replace(table["algo.generation"], gpu="static")
    table["hardware.compile"] = dataclasses.replace(table["hardware.compile"], gpu=False)
    monkeypatch.setattr(auto_choices, "CHOICES", table)

    def boom(device):
        raise RuntimeError("triton: out of resources")

    probes = [("Triton output layer", boom, "algo.fused_output_layer=triton"),
              ("compiled layers", boom, "hardware.compile=layers"),
              ("static-cache decoding", lambda device: "fine", "algo.generation=static"),
              ("flex attention", boom, "model.attn_implementation=flex_attention"),
              ("decoding", boom, "algo.generation=static")]
    rows = preflight.preflight("cpu", probes)
    assert [r["ok"] for r in rows] == [False, False, True, False, False]
    assert rows[0]["value"] == ("raised RuntimeError: triton: out of resources; turned off for this call: "
                                "algo.fused_output_layer=true")
    assert rows[1]["override"] is None and rows[1]["value"].endswith("levers asking for hardware.compile=layers skipped")
    assert rows[2]["value"].endswith(": fine")
    assert preflight.fallback_overrides(rows, "dpo") == ["algo.fused_output_layer=true"]
    assert preflight.fallback_overrides(rows, "grpo") == ["algo.fused_output_layer=true",
                                                          "algo.generation=transformers"]
    flex = "model.attn_implementation=flex_attention failed the preflight"
    assert preflight.lever_blocked(rows, ["model.attn_implementation=flex_attention"]) == flex
    assert preflight.lever_blocked(rows, ["algo.padding_free=true"]) == flex  # flex attention by another option
    assert preflight.lever_blocked(rows, ["hardware.compile=layers"]) == "hardware.compile=layers failed the preflight"
    assert preflight.lever_blocked(rows, ["algo.shared_prompt=false"]) is None
    specs = speed.side_specs("3m", 8, "dpo_fp32", "short", tmp_path, tmp_path, "cpu", 2, 10,
                             preflight.fallback_overrides(rows, "dpo"), {"use_liger_kernel": True})
    assert specs["ours"]["extra"] == ["algo.fused_output_layer=true"] and specs["trl_best"]["fields"]
    assert "extra" not in specs["trl"]  # TRL's sides run as TRL ships them
    lever = speed.side_specs("3m", 8, "dpo_fp32", "short", tmp_path, tmp_path, "cpu", 2, 10,
                             ["algo.fused_output_layer=true", "hardware.compile=false"], None,
                             lever=["algo.fused_output_layer=false"])
    assert lever["lever"]["extra"] == ["algo.fused_output_layer=false", "hardware.compile=false"]


def test_a_window_of_ours_counts_only_its_own_samples_where_the_verdicts_stay_on_the_device(tmp_path):
    """train.nonfinite_on_device=true (a GPU path not yet auto's choice): the warm-up steps' verdicts are still on the device when the
    window starts; read inside the window, their samples would count in its samples/s (3 warm-up + 2 timed steps of
    8 samples gave 40 where 16 ran)."""

    model_dir = tmp_path / "model"
    bench.build_model("3m", model_dir)
    data, _ = speed.write_data("dpo", "short", 8, 6, tmp_path)
    spec = {"case": "dpo_fp32", "model_dir": str(model_dir), "data": str(data), "batch": 8, "steps": 2, "threads": 1,
            "device": "cpu", "shape": "short", "size": "3m", "max_steps": 8, "run_dir": str(tmp_path / "run"),
            "cache": str(tmp_path / "cache"), "extra": ["train.nonfinite_on_device=true"]}
    ours = worker.Ours(spec)
    assert ours.run.verdicts is not None  # the verdicts are kept on the device here, as on a GPU
    ours.steps(3)  # the warm-up
    window = ours.window(2)
    assert window["samples_per_s"] * window["seconds"] == pytest.approx(16.0)


def test_an_isolated_call_returns_its_result_and_a_crash_a_hang_or_an_error_fail_it_alone():
    """The preflight's probes, the models' builds and the in-process checks run this way on a GPU: a process that
    aborts (a compiler's crash, a broken CUDA context) or hangs fails its own call, not the coordinator."""

    assert isolated.call("math:sqrt", [16.0], 30) == 4.0
    assert isolated.call("os.path:split", ["a/b"], 30) == ["a", "b"]  # JSON: a tuple comes back as a list
    with pytest.raises(isolated.IsolatedFailed, match="ValueError: math domain error"):
        isolated.call("math:sqrt", [-1.0], 30)
    with pytest.raises(isolated.IsolatedFailed, match=r"os:abort ended without a result \(exit -6\)"):
        isolated.call("os:abort", [], 30)
    with pytest.raises(isolated.IsolatedFailed, match="time:sleep passed its 1 s: stopped"):
        isolated.call("time:sleep", [60], 1)
    # a reply anywhere on a line (a child's partial line before it), not a line that only looks like one
    assert isolated.reply_at('12%|###@gpu_check {"built_s": 1.5}') == (7, {"built_s": 1.5})
    assert isolated.reply_at("@gpu_check {not json") == (-1, None)


def test_a_required_side_that_fails_ends_the_pair_and_blocks_profile_each_side_before_dropping_it(tmp_path):
    """Ours failing its build: no other side is built or timed (the pair has no row without it). With blocks, the
    profiled side is profiled right after its rounds and dropped before the next side is built."""
    from gpu_check.workers.turns import pair_runs

    calls = []
    speeds = iter([1.0] * 20)
    pool = FakePool({"ours": FakeWorker("ours", calls, speeds, fails="build"), "trl": FakeWorker("trl", calls, speeds),
                     "trl_best": FakeWorker("trl_best", calls, speeds)})
    runs, failed = pair_runs({"ours": {}, "trl": {}, "trl_best": {}}, 3, 1, 1, pool, 0.0,
                             profile={"ours": tmp_path, "trl": tmp_path})
    assert calls == [("build", "ours")] and set(failed) == {"ours"} and runs["trl"] == []
    calls.clear()
    pool = FakePool({side: FakeWorker(side, calls, speeds) for side in ("ours", "trl")})
    pair_runs({"ours": {}, "trl": {}}, 2, 1, 1, pool, 0.0, blocks=True, profile={"ours": tmp_path, "trl": tmp_path})
    assert calls == [("build", "ours"), ("run", "ours"), ("run", "ours"), ("profile", "ours"), ("free", "ours"),
                     ("build", "trl"), ("run", "trl"), ("run", "trl"), ("profile", "trl"), ("free", "trl")]


def test_the_preflights_fallbacks_reach_the_paths_and_a_lever_that_only_asks_for_one_is_skipped(tmp_path):
    """A failed probe's override reaches the runs of ours outside the speed pairs too (here a path's command), and
    a lever whose overrides are all fallbacks already would compare a run with itself: skipped, saying why."""

    rows = [{"check": "preflight: Triton output layer", "ok": False, "failed": True,
             "override": "algo.fused_output_layer=false"},
            {"check": "preflight: static-cache decoding", "ok": False, "failed": True,
             "override": "algo.generation=transformers"}]
    preflight.CALL_ROWS[:] = rows
    try:
        command = correctness.path_command(tmp_path, tmp_path, tmp_path, tmp_path, "cpu", "dpo", ["peft=lora"])
        assert "algo.fused_output_layer=false" in command and "algo.generation=transformers" not in command
        assert preflight.algo_options("dpo") == {"fused_output_layer": False}
    finally:
        preflight.CALL_ROWS.clear()
    report = state.Report(tmp_path, {})
    budget = state.SectionBudget(0.0, 1.0, 0.0, enforced=False)
    levers = [("3m", 8, "dpo_fp32", "short", "plain output layer", ["algo.fused_output_layer=false"])]
    timed.levers_section(levers, 1, report, budget, lambda size: pytest.fail("built"), tmp_path, "cpu",
                                      None, rows)
    [skipped] = report.data["skipped"]
    assert skipped["why"].startswith("the preflight turned its option off for this call already"), skipped
    report = state.Report(tmp_path, {})  # on a GPU, a lever that asks for what auto runs there already
    same = [("100m", 32, "dpo_bf16", "real", "shared prompt", ["algo.shared_prompt=true"])]
    timed.levers_section(same, 1, report, budget, lambda size: pytest.fail("built"), tmp_path, "cuda", None, [])
    [skipped] = report.data["skipped"]
    assert "is what auto runs on a GPU already" in skipped["why"], skipped


def test_a_worker_op_is_stopped_at_its_own_time_and_nothing_is_sent_past_the_deadline(tmp_path):
    """A real worker: a build given half a second (the worker still importing) is stopped then, its process killed;
    an op whose time has passed is not sent; close past the call's deadline kills at once."""
    import time

    from gpu_check.workers.turns import SideFailed, Worker

    worker = Worker("ours", 1, tmp_path / "workers.log", name="ours")
    began = time.perf_counter()
    with pytest.raises(SideFailed, match="build passed its time"):
        worker.ask({"op": "build", "spec": {}, "warmup": 1}, time.perf_counter() + 0.5)
    assert time.perf_counter() - began < 3.0 and worker.process.poll() is not None
    other = Worker("trl", 1, tmp_path / "workers.log", name="trl")
    with pytest.raises(SideFailed, match="not run"):
        other.ask({"op": "run", "steps": 1}, time.perf_counter() - 1.0)
    assert other.process.poll() is not None
    other.close(deadline=time.perf_counter() - 1.0)
