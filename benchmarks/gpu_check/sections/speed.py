"""The GPU check's timed runs: a pair against TRL (and TRL with its best options) by turns in the call's long-lived
workers (:mod:`gpu_check.workers.turns`), a lever against our defaults the same way, a
profile of both sides (top kernels, the GPU's idle share), and the allocator's record of both sides at the peak."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check import plan as plans
from gpu_check.sections.preflight import fallbacks
from gpu_check.state import threads
from gpu_check.workers.turns import pair_runs


def write_data(algo: str, shape: str, batch: int, steps: int, work: Path) -> tuple[Path, list[dict]]:
    """The rows of a case (enough for ``steps`` steps and one more batch, at least 64), written once per algorithm,
    shape and count into ``work``."""
    rows = bench.make_rows(algo, shape, max(64, batch * (steps + 1)))
    data = work / f"{algo}-{shape}-{len(rows)}.jsonl"
    if not data.exists():
        bench.write_jsonl(rows, data)
    return data, rows


def best_options_missing() -> str | None:
    """Why TRL's best options cannot run here (Liger-Kernel does not import), or ``None``."""
    try:
        import liger_kernel  # noqa: F401
    except Exception as error:  # noqa: BLE001  (missing, or broken against this torch)
        return f"liger-kernel does not import here ({type(error).__name__}; benchmarks/device_wheels.sh carries it)"
    return None


def with_overrides(extra: list[str], more: list[str]) -> list[str]:
    """``extra`` and those of ``more`` whose keys ``extra`` does not set (a lever's own value wins)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [*extra, *(o for o in more if o.split("=", 1)[0] not in keys)]


def side_specs(size: str, batch: int, case: str, shape: str, model_dir: Path, work: Path, device: str, steps: int,
               total_steps: int, fallbacks: list[str], best_fields: dict | None, lever: list[str] | None = None
               ) -> dict[str, dict]:
    """Each side's build spec for :func:`gpu_check.workers.turns.pair_runs`: ours (with the preflight's ``fallbacks``);
    TRL's and, with ``best_fields``, TRL's best; or with ``lever``, ours and ours with the lever's overrides."""
    algo = bench.CASES[case][0]
    data, _ = write_data(algo, shape, batch, total_steps, work)
    folder = work / f"{size}-{batch}-{case}-{shape}" / f"{len(list(work.glob(f'{size}-{batch}-{case}-{shape}/*')))}"
    common = {"case": case, "model_dir": str(model_dir), "data": str(data), "batch": batch, "steps": steps,
              "threads": threads(), "device": device, "shape": shape, "size": size, "max_steps": total_steps + 2}
    ours = {**common, "run_dir": str(folder / "ours"), "cache": str(work / "cache"), "extra": fallbacks}
    if lever is not None:
        return {"ours": ours, "lever": {**ours, "run_dir": str(folder / "lever"),
                                        "extra": with_overrides(lever, fallbacks)}}
    specs = {"ours": ours, "trl": {**common, "out": str(folder / "trl"), "fields": {}}}
    if best_fields:
        specs["trl_best"] = {**common, "out": str(folder / "trl_best"), "fields": best_fields}
    return specs


def op_timeouts(size: str, batch: int, case: str, shape: str, steps: int, warmup: int) -> dict[str, float]:
    """Seconds each worker op of a pair may take before its side is stopped: a build ~3x its estimate with the
    warm-up's steps at a tenth of the expected speed and the compiler's first graphs; a window 10x its steps + 60 s;
    the profile likewise; a free a minute."""
    step_s = plans.step_seconds(size, batch, case, shape)
    return {"build": 3 * plans.BUILD_S[size] + 10 * warmup * step_s + 3 * plans.FIRST_COMPILE_S,
            "run": 10 * steps * step_s + 60.0, "profile": 10 * bench.PROFILED_STEPS * step_s + 90.0, "free": 60.0}


def out_of_memory(failed: dict[str, str]) -> bool:
    """Whether a side failed for the device's memory (its message says so)."""
    return any("out of memory" in why.lower() or "outofmemory" in why.lower() for why in failed.values())


def speed_pair(size: str, batch: int, case: str, shape: str, model_dir: Path, params: int, work: Path, device: str,
               peaks: dict, steps: int, rounds: int, pool, deadline: float, warmup: int, fallbacks: list[str] = (),
               blocks: bool = False, profile: dict[str, Path] | None = None, on_turn=None) -> dict:
    """Ours, TRL's and TRL's with its best options (``bench.TRL_BEST``) on one case, with MFU as the benchmark
    computes it, in the call's long-lived workers (``pool``: :mod:`gpu_check.workers.turns`).

    ``rounds`` timed windows of each side by turns (ours, TRL, TRL's best, ours, ...; ``blocks``: one side after
    another, where they do not fit on the device together): the row is each side's median window (its samples/s,
    memory and MFU) and the ratios of the medians, with every round's ratio beside them, and the graphs compiled
    in each window (a window with a compile is not steady state: the page flags it). TRL's best side failing (or
    not installed) leaves its column empty with the reason; ours or TRL's failing fails the pair."""
    algo = bench.CASES[case][0]
    best_fields = bench.TRL_BEST.get(algo)
    best_why = None if best_fields else "no best options for this algorithm"
    best_why = best_why or best_options_missing()
    specs = side_specs(size, batch, case, shape, model_dir, work, device, steps,
                       warmup + rounds * steps + bench.PROFILED_STEPS, list(fallbacks),
                       best_fields if best_why is None else None)
    timeouts = op_timeouts(size, batch, case, shape, steps, warmup)
    sides, failed = pair_runs(specs, rounds, steps, warmup, pool, deadline, blocks, profile, on_turn, timeouts)
    oom_retry = not blocks and out_of_memory(failed)
    if oom_retry:  # the sides did not fit together: each alone, dropping its run before the next is built
        specs = side_specs(size, batch, case, shape, model_dir, work, device, steps,
                           warmup + rounds * steps + bench.PROFILED_STEPS, list(fallbacks),
                           best_fields if best_why is None else None)
        sides, failed = pair_runs(specs, rounds, steps, warmup, pool, deadline, True, profile, on_turn, timeouts)
        blocks = True
    for side in ("ours", "trl"):
        if not sides[side]:
            raise RuntimeError(f"{side}: {failed.get(side, 'no window timed')}")
    if "trl_best" in failed:
        best_why = f"failed: {failed['trl_best']}"
    per_sample = bench.tokens_per_sample(algo, bench.make_rows(algo, shape, 64), shape)
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
           "compiles": {name: [s.get("compiles", 0) for s in runs] for name, runs in sides.items()},
           "blocks": blocks, "blocks_after_oom": oom_retry, "fallbacks": list(fallbacks), "trl_best": None, "ratio_best": None,
           "trl_best_fields": best_fields or {}, "failed": failed}
    if best_why is None and sides.get("trl_best"):
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


def lever_pair(size: str, batch: int, case: str, shape: str, name: str, overrides: list[str], model_dir: Path,
               work: Path, device: str, steps: int, rounds: int, pool, deadline: float, warmup: int,
               fallbacks: list[str] = ()) -> dict:
    """Our side of ``case`` with ``overrides`` against our defaults on it, by turns in two of our workers: the
    medians' ratios of speed and memory."""
    specs = side_specs(size, batch, case, shape, model_dir, work, device, steps, warmup + rounds * steps,
                       list(fallbacks), None, lever=overrides)
    sides, failed = pair_runs(specs, rounds, steps, warmup, pool, deadline,
                              timeouts=op_timeouts(size, batch, case, shape, steps, warmup))
    if not sides["ours"] or not sides["lever"]:
        raise RuntimeError("; ".join(f"{side}: {why}" for side, why in failed.items()) or "no window timed")
    ours, baseline = median_run(sides["lever"]), median_run(sides["ours"])
    return {"size": size, "batch": batch, "case": case, "shape": shape, "lever": name, "overrides": overrides,
            "ours": ours, "defaults": baseline, "speed": ours["samples_per_s"] / baseline["samples_per_s"],
            "memory": ours["peak_mem_mb"] / baseline["peak_mem_mb"],
            "speed_range": _spread([lever["samples_per_s"] / plain["samples_per_s"]  # each round's, turn by turn
                                    for lever, plain in zip(sides["lever"], sides["ours"])])}


def _spread(ratios: list[float]) -> tuple[float, float] | None:
    """``(lowest, highest)`` of the rounds' ratios (None without rounds): what a default's verdict reads
    (:func:`gpu_check.page.defaults.verdict`)."""
    return (min(ratios), max(ratios)) if ratios else None


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


def profile_summary(case_entry: tuple, folders: dict[str, Path], out: Path) -> dict:
    """Both sides' :func:`trace_summary` and ms per step from the profiled steps their workers wrote into
    ``folders`` (``{"rlhf": ..., "TRL": ...}``); each side's ``profile.txt`` copied to ``out/profile-<side>.txt``."""
    size, batch, case, shape = case_entry
    result = {"size": size, "batch": batch, "case": case, "shape": shape, "steps": bench.PROFILED_STEPS}
    for side, folder in folders.items():
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
    bench.run_ours_into(ours_dir, case, model_dir, data, work / "cache", batch, steps, threads(),
                        [*fallbacks(bench.CASES[case][0]), "train.profile_steps=1", "train.profile_memory=true"],
                        device, shape)
    bench.run_trl(case, model_dir, data, work, batch, steps, threads(), device, profile_to=trl_dir,
                  profile_memory=True, shape=shape)
    return {side: (folder / "memory.txt").read_text() for side, folder in (("rlhf", ours_dir), ("TRL", trl_dir))}
