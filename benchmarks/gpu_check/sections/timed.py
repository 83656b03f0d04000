"""The GPU check's timed sections: the speed pairs in the plan's order while the budget
lasts (the profiled pair's profile right after its rounds), the levers against our defaults, the memory records."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check import plan as plans
from gpu_check.sections.preflight import fallback_overrides, lever_blocked
from gpu_check.sections.speed import (
    MEMORY_CASE,
    best_options_missing,
    lever_pair,
    memory_records,
    profile_summary,
    ratio_cell,
    speed_pair,
)
from gpu_check.state import last_line


def device_memory_gb(device: str) -> float | None:
    """The device's memory in GB (``None`` on a CPU)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 1e9 if device == "cuda" else None


def speed_section(plan: list[tuple], profiled: tuple | None, rounds: int, report, budget, model, work: Path,
                  device: str, out: Path, pool, preflight_rows: list[dict]) -> None:
    """Each pair of ``plan`` whose estimate (corrected by the pairs so far) fits the budget, in ``pool``'s workers;
    ``profiled``'s profile right after its rounds, in the same builds. Each turn's windows are saved as they come
    (``report.data["partial"]``), so that a call stopped at its limit keeps what it timed."""
    measured: list[tuple[float, float]] = []  # (estimated, measured) seconds of each pair run
    # once a call, charged to the first pair (the workers started during the preflight, already measured)
    first = plans.FIRST_COMPILE_S + plans.TRL_IMPORT_S
    previous_size = None
    memory_gb = device_memory_gb(device)
    warmup = plans.WARMUP_STEPS[device]
    for size, batch, case, shape in plan:
        entry = {"size": size, "batch": batch, "case": case, "shape": shape}
        key = (size, batch, case, shape)
        algo = bench.CASES[case][0]
        needs = plans.MIN_MEMORY_GB.get(key)
        if needs and memory_gb is not None and memory_gb < needs:
            report.add("skipped", {**entry, "why": f"needs ~{needs} GB of GPU memory; this GPU has {memory_gb:.0f}"})
            continue
        sides = 3 if algo in bench.TRL_BEST and best_options_missing() is None else 2
        profile_s = plans.profile_seconds(*key) if key == profiled else 0.0
        switch = plans.SIZE_SWITCH_S if previous_size not in (None, size) else 0.0
        raw = plans.pair_seconds(size, batch, case, shape, rounds, sides) + first + profile_s + switch
        guess = plans.calibrated(raw, measured)
        if not budget.fits(guess):
            report.add("skipped", {**entry, "why": f"out of the time budget (estimated {guess:.0f} s)"})
            budget.note(f"skipped {size} b{batch} {case} {shape}: {guess:.0f} s would pass the budget")
            continue
        began = time.perf_counter()
        previous_size = size
        steps = plans.steps_for(size, batch, case, shape)
        folders = {"ours": work / "profile-ours", "trl": work / "profile-trl"} if key == profiled else None

        def partial(runs, failed, entry=entry):
            report.add("partial", {**entry, "samples_per_s": {s: [r["samples_per_s"] for r in rs]
                                                              for s, rs in runs.items()}, "failed": failed})

        try:
            model_dir, params = model(size)
            row = speed_pair(size, batch, case, shape, model_dir, params, work, device, report.data["peaks"], steps,
                             rounds, pool, budget.deadline(), warmup, fallback_overrides(preflight_rows, algo),
                             key in plans.BLOCKS, folders, partial)
        except Exception as error:  # noqa: BLE001  (a case that fails on this GPU is a finding)
            traceback.print_exc()
            report.add("skipped", {**entry, "why": f"failed: {last_line(error)}"})
            budget.note(f"{size} b{batch} {case} {shape} FAILED: {last_line(error)}")
            first = 0.0
            continue
        took = time.perf_counter() - began
        measured.append((raw, took))
        first = 0.0
        report.add("speed", row)
        budget.note(f"{size} b{batch} {case} {shape}: {ratio_cell(row).replace('**', '')}, against TRL's best "
                    f"{ratio_cell(row, best=True).replace('**', '')}; peak MB {row['ours']['peak_mem_mb']:.0f} vs "
                    f"{row['trl']['peak_mem_mb']:.0f} [{took:.0f} s, estimated {raw:.0f}]")
        if folders is not None:
            try:
                report.add("profile", profile_summary(key, {"rlhf": folders["ours"], "TRL": folders["trl"]}, out))
                budget.note(f"profiled {size} b{batch} {case} {shape}, both sides")
            except Exception as error:  # noqa: BLE001
                report.add("skipped", {**entry, "lever": "(profile)", "why": f"failed: {last_line(error)}; "
                                       f"{row['failed']}"})


def auto_values(case: str) -> set[str]:
    """The ``key=value`` overrides that a GPU run of ``case`` has already: each ``auto`` option's GPU choice
    (``rlhf.core.auto_choices.CHOICES``) where the case does not set the key."""
    from rlhf.core.auto_choices import CHOICES

    set_by_case = {o.split("=", 1)[0] for o in bench.CASES[case][1]}
    return {f"{key}={str(c.gpu).lower() if isinstance(c.gpu, bool) else c.gpu}" for key, c in CHOICES.items()
            if key not in set_by_case}


def levers_section(levers: list, rounds: int, report, budget, model, work: Path, device: str, pool,
                   preflight_rows: list[dict]) -> None:
    """Each lever against our defaults on its case, by turns in two of our workers."""
    warmup = plans.WARMUP_STEPS[device]
    for size, batch, case, shape, name, overrides in levers:
        entry = {"size": size, "batch": batch, "case": case, "shape": shape, "lever": name}
        if overrides is None:
            report.add("skipped", {**entry, "why": "its option is not built yet (gpu_check.plan.LEVERS: None)"})
            continue
        blocked = lever_blocked(preflight_rows, overrides)
        already = fallback_overrides(preflight_rows, bench.CASES[case][0])
        if not blocked and all(o in already for o in overrides):
            blocked = f"the preflight turned its option off for this call already ({', '.join(overrides)}): " \
                      "both sides would be the same run"
        elif not blocked and device == "cuda" and all(o in auto_values(case) for o in overrides):
            blocked = f"{', '.join(overrides)} is what auto runs on a GPU already (rlhf/core/auto_choices.py): " \
                      "both sides would be the same run"
        if blocked:
            report.add("skipped", {**entry, "why": blocked})
            continue
        if not budget.fits(plans.pair_seconds(size, batch, case, shape, rounds, 2)):
            report.add("skipped", {**entry, "why": "out of the time budget"})
            budget.note(f"skipped lever {name} on {size} b{batch} {case} {shape}: out of the time budget")
            continue
        try:
            row = lever_pair(size, batch, case, shape, name, overrides, model(size)[0], work, device,
                             plans.steps_for(size, batch, case, shape), rounds, pool, budget.deadline(), warmup,
                             fallback_overrides(preflight_rows, bench.CASES[case][0]))
        except Exception as error:  # noqa: BLE001  (a lever that fails here, e.g. a kernel this GPU lacks)
            report.add("skipped", {**entry, "why": f"failed: {last_line(error)}"})
            budget.note(f"lever {name} on {size} b{batch} {case} FAILED")
            continue
        report.add("levers", row)
        budget.note(f"lever {name} on {size} b{batch} {case}: {row['speed']:.2f}x speed, {row['memory']:.2f}x memory")


def memory_section(report, budget, models: dict, work: Path, device: str) -> None:
    size, batch, case, shape = MEMORY_CASE
    entry = {"size": size, "batch": batch, "case": case, "shape": shape}
    if device != "cuda":
        report.add("skipped", {**entry, "why": "the memory record needs a GPU"})
        return
    if size not in models or not budget.fits(2 * plans.run_seconds(*MEMORY_CASE)):
        report.add("skipped", {**entry, "why": "its model was not built in this call, or out of the time budget"})
        return
    try:
        report.data["memory"] = memory_records(models[size][0], work, device,
                                               plans.steps_for(size, batch, case, shape))
        report.save()
        budget.note("memory at the peak recorded, both sides")
    except Exception as error:  # noqa: BLE001
        report.add("skipped", {**entry, "why": f"memory record failed: {last_line(error)}"})
