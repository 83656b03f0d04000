"""The GPU check's timed runs (``benchmarks/gpu_check.py``): a pair against TRL (and TRL with its best options) in
alternating rounds, a lever against our defaults, a profile of both sides (top kernels, the GPU's idle share), and
the allocator's record of both sides at the peak."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/bench.py)
from gpu_check_correctness import _threads  # noqa: E402

SIDES = ("ours", "trl", "trl_best")  # the order of a round


def write_data(algo: str, shape: str, batch: int, steps: int, work: Path) -> tuple[Path, list[dict]]:
    """The rows of a case (enough for ``2 x steps`` steps and one more batch, at least 64), written once per
    algorithm, shape and count into ``work``."""
    rows = bench.make_rows(algo, shape, max(64, batch * (2 * steps + 1)))
    data = work / f"{algo}-{shape}-{len(rows)}.jsonl"
    if not data.exists():
        bench.write_jsonl(rows, data)
    return data, rows


def best_options_missing() -> str | None:
    """Why TRL's best options cannot run here (Liger-Kernel not installed), or ``None``."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (benchmarks/device_wheels.sh carries it to the GPU machine)"
    return None


def speed_pair(size: str, batch: int, case: str, shape: str, model_dir: Path, params: int, work: Path, device: str,
               peaks: dict, steps: int, rounds: int = 1) -> dict:
    """Ours, TRL's and TRL's with its best options (``bench.TRL_BEST``) on one case, with MFU as the benchmark
    computes it.

    ``rounds`` runs of each side, alternating (ours, TRL, TRL's best, ours, ...), each a process of its own: the row
    is each side's median run (its samples/s, memory and MFU) and the ratios of the medians, with every round's ratio
    beside them. One pair measured once per call moved by up to 50% between calls on an H200
    (docs/gpu/2026-11-27-nvidia-h200-second-run.md); the rounds show that spread within one call. TRL's best side
    failing (or not installed) leaves its column empty with the reason; ours or TRL's failing fails the pair."""
    algo = bench.CASES[case][0]
    data, rows = write_data(algo, shape, batch, steps, work)
    best_fields = bench.TRL_BEST.get(algo)
    best_why = None if best_fields else "no best options for this algorithm"
    best_why = best_why or best_options_missing()
    sides: dict[str, list[dict]] = {side: [] for side in SIDES}
    for k in range(rounds):
        case_dir = work / f"{size}-{batch}-{shape}" / f"round{k}"
        case_dir.mkdir(parents=True, exist_ok=True)
        sides["ours"].append(bench.run_ours(case, model_dir, data, case_dir, batch, steps, _threads(), [], device,
                                            shape=shape))
        sides["trl"].append(bench.run_trl(case, model_dir, data, case_dir, batch, steps, _threads(), device,
                                          shape=shape))
        if best_why is None:
            try:
                sides["trl_best"].append(bench.run_trl(case, model_dir, data, case_dir / "best", batch, steps,
                                                       _threads(), device, shape=shape, fields=best_fields))
            except Exception as error:  # noqa: BLE001  (e.g. a Liger kernel this GPU or model lacks)
                best_why = f"failed: {str(error).strip().splitlines()[-1][:200] if str(error).strip() else error}"
    per_sample = bench.tokens_per_sample(algo, rows, shape)
    live = algo == "dpo"  # a live reference runs forward each step (no case here precomputes it)
    flops = 6.0 * params + (2.0 * params if live else 0.0)
    peak = peaks["bfloat16" if case in bench.BF16 or case in bench.SHIPPED_TRL_BF16 else "float32"] \
        if "bfloat16" in peaks else peaks["float32"]
    for run in [run for runs in sides.values() for run in runs]:
        run["tokens_per_s"] = run["samples_per_s"] * per_sample
        run["mfu"] = flops * run.get("computed_tokens_per_s", run["tokens_per_s"]) / peak
    ours, theirs = median_run(sides["ours"]), median_run(sides["trl"])
    row = {"size": size, "batch": batch, "case": case, "shape": shape, "params": params, "steps": steps, "ours": ours,
           "trl": theirs, "ratio": ours["samples_per_s"] / theirs["samples_per_s"], "rounds": rounds,
           "round_ratios": [o["samples_per_s"] / t["samples_per_s"] for o, t in zip(sides["ours"], sides["trl"])],
           "samples_per_s": {name: [s["samples_per_s"] for s in runs] for name, runs in sides.items()},
           "trl_best": None, "ratio_best": None, "trl_best_fields": best_fields or {}}
    if best_why is None and sides["trl_best"]:
        best = median_run(sides["trl_best"])
        row.update(trl_best=best, ratio_best=ours["samples_per_s"] / best["samples_per_s"],
                   round_ratios_best=[o["samples_per_s"] / b["samples_per_s"]
                                      for o, b in zip(sides["ours"], sides["trl_best"])])
    else:
        row["trl_best_why"] = best_why
    return row


def median_run(runs: list[dict]) -> dict:
    """The run whose samples/s is the median of ``runs`` (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda run: run["samples_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def ratio_cell(row: dict, best: bool = False) -> str:
    """``**1.05×**``, and with several rounds the range of the rounds' ratios: ``**1.05×** (0.91–1.12, 3 rounds)``;
    ``best``: against TRL's best options (``-`` where that side did not run)."""
    ratio = row.get("ratio_best") if best else row["ratio"]
    if ratio is None:
        return "-"
    cell = f"**{ratio:.2f}×**"
    ratios = row.get("round_ratios_best" if best else "round_ratios", [])
    if len(ratios) > 1:
        cell += f" ({min(ratios):.2f}–{max(ratios):.2f}, {len(ratios)} rounds)"
    return cell


def lever_run(size: str, batch: int, case: str, shape: str, name: str, overrides: list[str], model_dir: Path,
              work: Path, device: str, steps: int, baseline: dict) -> dict:
    """Our side of ``case`` with ``overrides``, against ``baseline`` (our run of the same case with the defaults)."""
    algo = bench.CASES[case][0]
    data, _ = write_data(algo, shape, batch, steps, work)
    run_dir = work / f"lever-{size}-{batch}-{case}-{len(list(work.glob('lever-*')))}"
    ours = bench.run_ours_into(run_dir, case, model_dir, data, work / "cache", batch, steps, _threads(), overrides,
                               device, shape)
    return {"size": size, "batch": batch, "case": case, "shape": shape, "lever": name, "overrides": overrides,
            "ours": ours, "speed": ours["samples_per_s"] / baseline["samples_per_s"],
            "memory": ours["peak_mem_mb"] / baseline["peak_mem_mb"]}


def defaults_run(size: str, batch: int, case: str, shape: str, model_dir: Path, work: Path, device: str,
                 steps: int) -> dict:
    """Our side of ``case`` with the defaults, once: a lever's baseline where the speed section did not run it."""
    algo = bench.CASES[case][0]
    data, _ = write_data(algo, shape, batch, steps, work)
    run_dir = work / f"defaults-{size}-{batch}-{case}-{shape}"
    return bench.run_ours_into(run_dir, case, model_dir, data, work / "cache", batch, steps, _threads(), [], device,
                               shape)


# ---- the profile ---------------------------------------------------------------------------------------------------
TOP_KERNELS = 12  # kernels per side in the page's table
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that occupy the GPU


def trace_summary(trace: dict, top: int = TOP_KERNELS) -> dict:
    """From a Chrome trace of a profiled window (``torch.profiler``'s ``export_chrome_trace``): the window's span
    (first event's start to last event's end), the GPU's busy time (the union of its kernels', copies' and sets'
    intervals), its idle share (1 - busy / span), and the ``top`` kernels by total time (name, calls, ms, share of
    the busy time). A trace without GPU events (a CPU's) has ``gpu_events`` 0 and no idle share."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not events:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_share": None, "gpu_events": 0, "kernels": []}
    span_us = max(float(e["ts"]) + float(e["dur"]) for e in events) - min(float(e["ts"]) for e in events)
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_EVENTS)
    busy_us, end = 0.0, float("-inf")
    for start, stop in gpu:  # the union of the intervals
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            entry = totals.setdefault(e.get("name", "?"), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e["dur"])
    kernels = [{"name": name, "calls": int(calls), "ms": us / 1e3, "share": us / busy_us if busy_us else 0.0}
               for name, (calls, us) in sorted(totals.items(), key=lambda item: -item[1][1])[:top]]
    return {"span_ms": span_us / 1e3, "busy_ms": busy_us / 1e3, "idle_share": 1.0 - busy_us / span_us if gpu else None,
            "gpu_events": len(gpu), "kernels": kernels}


def profile_pair(size: str, batch: int, case: str, shape: str, model_dir: Path, work: Path, device: str,
                 steps: int, out: Path) -> dict:
    """Both sides of ``case`` once more with ``bench.PROFILED_STEPS`` steps recorded by torch.profiler (from the
    timed window's first, as ``bench.py --profile`` does): each side's :func:`trace_summary` and its ms per step;
    each side's ``profile.txt`` copied to ``out/profile-<side>.txt``."""
    algo = bench.CASES[case][0]
    data, _ = write_data(algo, shape, batch, steps, work)
    ours_dir, trl_dir = work / "profile-ours", work / "profile-trl"
    bench.run_ours_into(ours_dir, case, model_dir, data, work / "cache", batch, steps, _threads(),
                        [f"train.profile_steps={bench.PROFILED_STEPS}"], device, shape)
    bench.run_trl(case, model_dir, data, work / "profile-trl-run", batch, steps, _threads(), device,
                  profile_to=trl_dir, shape=shape)
    result = {"size": size, "batch": batch, "case": case, "shape": shape, "steps": bench.PROFILED_STEPS}
    for side, folder in (("rlhf", ours_dir), ("TRL", trl_dir)):
        text = (folder / "profile.txt").read_text()
        summary = trace_summary(json.loads((folder / "profile_trace.json").read_text()))
        summary["ms_per_step"] = float(text.split(" ms per step")[0].rsplit(" ", 1)[-1])
        result[side] = summary
        shutil.copy(folder / "profile.txt", out / f"profile-{side.lower()}.txt")
    return result


# ---- memory: what is live at the peak ---------------------------------------------------------------------------------
MEMORY_CASE = ("100m", 64, "dpo_bf16", "short")  # where ours was above TRL's (docs/gpu/bench-h200-b64.md: +1.3 GB)


def memory_records(model_dir: Path, work: Path, device: str, steps: int) -> dict[str, str]:
    """Both sides of :data:`MEMORY_CASE` again with the CUDA allocator's history recorded over a profiled step
    (``train.profile_memory``; TRL's side through the same profiler): each side's ``memory.txt`` (the peak, and
    what was live then by the line that allocated it)."""
    size, batch, case, shape = MEMORY_CASE
    data, _ = write_data(bench.CASES[case][0], shape, batch, steps, work)
    ours_dir, trl_dir = work / "memory-ours", work / "memory-trl"
    bench.run_ours_into(ours_dir, case, model_dir, data, work / "cache", batch, steps, _threads(),
                        ["train.profile_steps=1", "train.profile_memory=true"], device, shape)
    bench.run_trl(case, model_dir, data, work, batch, steps, _threads(), device, profile_to=trl_dir,
                  profile_memory=True, shape=shape)
    return {side: (folder / "memory.txt").read_text() for side, folder in (("rlhf", ours_dir), ("TRL", trl_dir))}
