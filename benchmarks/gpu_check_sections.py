"""The GPU check's timed sections (``benchmarks/gpu_check.py``): the speed pairs in the plan's order while the budget
lasts (the profiled pair's profile right after it), the levers against our defaults, the memory records."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import bench
import gpu_check_plan as plans
from gpu_check_correctness import last_line
from gpu_check_speed import (
    MEMORY_CASE,
    best_options_missing,
    defaults_run,
    lever_run,
    memory_records,
    profile_pair,
    ratio_cell,
    speed_pair,
)


def speed_section(plan: list[tuple], profiled: tuple | None, rounds: int, report, budget, model, work: Path,
                  device: str, out: Path) -> None:
    """Each pair of ``plan`` whose estimate (corrected by the pairs so far) fits the budget; ``profiled``'s profile
    right after its pair, where it fits too."""
    measured: list[tuple[float, float]] = []  # (estimated, measured) seconds of each pair run
    liger_first = best_options_missing() is None  # Triton compiles Liger's kernels once per call
    for size, batch, case, shape in plan:
        sides = 3 if bench.CASES[case][0] in bench.TRL_BEST and best_options_missing() is None else 2
        raw = plans.pair_seconds(size, batch, case, shape, rounds, sides) + (plans.LIGER_FIRST_S if liger_first else 0)
        guess = plans.calibrated(raw, measured)
        entry = {"size": size, "batch": batch, "case": case, "shape": shape}
        if not budget.fits(guess):
            report.add("skipped", {**entry, "why": f"out of the time budget (estimated {guess:.0f} s)"})
            budget.note(f"skipped {size} b{batch} {case} {shape}: {guess:.0f} s would pass the budget")
            continue
        began = time.perf_counter()
        steps = plans.steps_for(size, case, shape)
        try:
            model_dir, params = model(size)
            row = speed_pair(size, batch, case, shape, model_dir, params, work, device, report.data["peaks"], steps,
                             rounds)
        except Exception as error:  # noqa: BLE001  (a case that fails on this GPU is a finding)
            traceback.print_exc()
            report.add("skipped", {**entry, "why": f"failed: {last_line(error)}"})
            budget.note(f"{size} b{batch} {case} {shape} FAILED")
            continue
        took = time.perf_counter() - began
        measured.append((raw, took))
        liger_first = False
        report.add("speed", row)
        budget.note(f"{size} b{batch} {case} {shape}: {ratio_cell(row).replace('**', '')}, against TRL's best "
                    f"{ratio_cell(row, best=True).replace('**', '')}; peak MB {row['ours']['peak_mem_mb']:.0f} vs "
                    f"{row['trl']['peak_mem_mb']:.0f} [{took:.0f} s, estimated {raw:.0f}]")
        if (size, batch, case, shape) == profiled:
            profile_section(profiled, report, budget, model, work, device, out, measured)


def profile_section(case_entry: tuple, report, budget, model, work: Path, device: str, out: Path,
                    measured: list) -> None:
    size, batch, case, shape = case_entry
    guess = plans.calibrated(2 * plans.run_seconds(size, batch, case, shape), measured)
    if not budget.fits(guess):
        report.add("skipped", {"size": size, "batch": batch, "case": case, "shape": shape,
                               "lever": "(profile)", "why": "out of the time budget"})
        return
    try:
        report.add("profile", profile_pair(size, batch, case, shape, model(size)[0], work, device,
                                           plans.steps_for(size, case, shape), out))
        budget.note(f"profiled {size} b{batch} {case} {shape}, both sides")
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        report.add("skipped", {"size": size, "batch": batch, "case": case, "shape": shape, "lever": "(profile)",
                               "why": f"failed: {last_line(error)}"})


def levers_section(levers: list, rounds: int, report, budget, model, work: Path, device: str) -> None:
    """Each lever against our defaults on its case: the speed section's row where it ran (its median run), else one
    run of the defaults here, first."""
    baselines = {(r["size"], r["batch"], r["case"], r.get("shape", "short")): r["ours"] for r in report.data["speed"]}
    for size, batch, case, shape, name, overrides in levers:
        entry = {"size": size, "batch": batch, "case": case, "shape": shape, "lever": name}
        key = (size, batch, case, shape)
        if overrides is None:
            report.add("skipped", {**entry, "why": "its option is not built yet (gpu_check_plan.LEVERS: None)"})
            continue
        one = plans.run_seconds(size, batch, case, shape)
        steps = plans.steps_for(size, case, shape)
        if not budget.fits(one * (1 if key in baselines else 2)):
            report.add("skipped", {**entry, "why": "out of the time budget"})
            budget.note(f"skipped lever {name} on {size} b{batch} {case} {shape}: out of the time budget")
            continue
        try:
            model_dir = model(size)[0]
            if key not in baselines:
                baselines[key] = defaults_run(size, batch, case, shape, model_dir, work, device, steps)
            row = lever_run(size, batch, case, shape, name, overrides, model_dir, work, device, steps, baselines[key])
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
        report.data["memory"] = memory_records(models[size][0], work, device, plans.steps_for(size, case, shape))
        report.save()
        budget.note("memory at the peak recorded, both sides")
    except Exception as error:  # noqa: BLE001
        report.add("skipped", {**entry, "why": f"memory record failed: {last_line(error)}"})
