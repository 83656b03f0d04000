"""The optimizer benchmark's report: one folder (``<sweep dir>/report/``) with ``report.md``, ``results.csv`` (one
row per workload and optimizer), ``runs.csv`` (one row per job), ``profile.png`` (the performance profile of the
tuned track; ``profile_self_tuning.png`` for the self-tuning one) and ``manifest.json`` (versions, seeds, data
fingerprints, machine and threads, the plan, the command).

Every figure comes from the confirm runs (fresh seeds, held-out rows): the final score (median, bootstrap 95%
interval, min-max), the steps and training seconds to the workload's target (median over runs; a miss is inf), the
memory at the end split into weights (trainable and frozen), gradients, optimizer state and the rest of the peak
(activations, buffers, allocator), the KL to the start model where ``eval=generate`` measures it (``eval/gen/kl``),
each study's chosen point with the keys on the edge of their range, and the partition of the tensors among the
optimizer's rules. Across workloads: the performance profile and its score, and the geometric-mean speed-up of
seconds to target over the reference optimizer (:mod:`rlhf.sweeps.bench.scores`).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlhf.sweeps.bench import scores
from rlhf.sweeps.bench.plan import SELF_TUNING, TUNED, Bench, Job
from rlhf.sweeps.results import Run

FOLDER = "report"
MARKDOWN = f"{FOLDER}/report.md"
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "peft", "bitsandbytes", "hydra-core", "numpy",
            "scipy", "heavyball", "schedulefree", "prodigyopt")


def _load(folder: Path, name: str) -> Any:
    file = folder / name
    return json.loads(file.read_text()) if file.is_file() else None


def _records(folder: Path) -> list[dict[str, Any]] | None:
    try:
        return Run(folder).metrics
    except Exception:  # no run folder: a job that never started
        return None


def target(bench: Bench, jobs: Sequence[Job], workload: str) -> float | None:
    """The workload's target: its own, else the reference optimizer's median final score over its confirm runs (a
    failed run counting as the worst), the worse middle one for an even count: one of its runs' scores, so that at
    least half of them reach it. ``None`` where it has none (half or more of the reference's runs failed)."""
    own = next(w for w in bench.workloads if w.name == workload)
    if own.target is not None:
        return own.target
    worst = -math.inf if own.direction == "maximize" else math.inf  # a failed run counts as the worst score
    values = [worst if j.value is None else j.value for j in jobs if j.stage == "confirm" and j.workload == workload
              and j.optimizer == bench.reference]
    if not values:
        return None
    middle = float(np.quantile(values, 0.5, method="lower" if own.direction == "maximize" else "higher"))
    return middle if math.isfinite(middle) else None  # half or more of the reference's runs failed: no target


def rows(bench: Bench, jobs: Sequence[Job], sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per workload and optimizer, from its confirm jobs; fills each confirm job's time to target."""
    out = []
    for w in bench.workloads:
        goal = target(bench, jobs, w.name)
        for name in bench.spaces:
            own = [j for j in jobs if j.stage == "confirm" and j.workload == w.name and j.optimizer == name]
            for job in own:
                records = _records(sweep_dir / job.folder) if job.launched else None
                reached = (scores.time_to_target(records, w.metric, w.direction, goal) if goal is not None
                           else scores.MISSED)
                job.reached = reached
            finals = [j.value for j in own if j.value is not None]
            final = scores.summary(finals) if finals else None
            steps = [j.reached.steps for j in own]
            seconds = [j.reached.seconds if not math.isnan(j.reached.seconds) else math.inf
                       for j in own]
            memory = _memory([sweep_dir / j.folder for j in own if j.value is not None])
            kl = [_final(sweep_dir / j.folder, "eval/gen/kl") for j in own if j.value is not None]
            kl = [v for v in kl if v is not None]
            out.append({
                "workload": w.name, "optimizer": name, "track": bench.track(name), "steps": own[0].steps if own
                else w.max_steps, "metric": w.metric, "target": goal,
                "final_median": final["median"] if final else None, "final_low": final["low"] if final else None,
                "final_high": final["high"] if final else None, "final_min": final["min"] if final else None,
                "final_max": final["max"] if final else None, "runs": len(finals), "jobs": len(own),
                "reached": sum(math.isfinite(s) for s in steps),
                "met_at_start": sum(s == 0 for s in steps),
                "steps_to_target": float(np.median(steps)) if steps else math.inf,
                "seconds_to_target": float(np.median(seconds)) if seconds else math.inf,
                "seconds_low": scores.summary(seconds)["low"] if seconds else math.inf,
                "seconds_high": scores.summary(seconds)["high"] if seconds else math.inf,
                **memory, "kl": float(np.median(kl)) if kl else None,
                "chosen": [{"study": j.study, "point": j.point, "edges": bench.edges(name, j.point)}
                           for j in own if j.index == 0 and j.point],
                "partition": _partition(next((sweep_dir / j.folder for j in own if j.value is not None), None)),
            })
    return out


def _final(folder: Path, key: str) -> float | None:
    value = ((_load(folder, "summary.json") or {}).get("final") or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _memory(folders: Sequence[Path]) -> dict[str, float | None]:
    """Median over the runs of the memory at the end, in MB: weights (trainable and frozen), gradients, optimizer
    state as held, the peak, and the rest of the peak (activations, buffers, the allocator's slack)."""
    parts: dict[str, list[float]] = {"weights_mb": [], "gradients_mb": [], "optimizer_state_mb": [],
                                     "peak_mb": [], "rest_mb": []}
    for folder in folders:
        summary = _load(folder, "summary.json") or {}
        predicted, held = summary.get("memory_predicted_mb") or {}, summary.get("memory_held_mb") or {}
        peak = (summary.get("final") or {}).get("perf/peak_mem_mb")
        weights = (predicted.get("weights") or 0.0) + (predicted.get("frozen") or 0.0)
        gradients = predicted.get("gradients") or 0.0
        state = held.get("optimizer_state")
        if peak is None or state is None:
            continue
        parts["weights_mb"].append(weights)
        parts["gradients_mb"].append(gradients)
        parts["optimizer_state_mb"].append(state)
        parts["peak_mb"].append(peak)
        parts["rest_mb"].append(max(0.0, peak - weights - gradients - state))
    return {k: float(np.median(v)) if v else None for k, v in parts.items()}


def _partition(folder: Path | None) -> str:
    """The optimizer's partition of the trainable tensors (``partition.json``), in one line."""
    record = _load(folder, "partition.json") if folder else None
    if not record:
        return ""
    parts = [f"{p['part']}: {p['tensors']} tensors, {p['parameters']:,} params"
             + (f" ({p['rule']})" if p.get("rule") else "") for p in record.get("parts", [])]
    return f"{record.get('partition', '').rsplit('.', 1)[-1]}: " + "; ".join(parts)


def ranked(bench: Bench, table: Sequence[Mapping[str, Any]]) -> list[str]:
    """The workloads that rank the optimizers: those with a target that no run met before training (met at the
    start, every optimizer would tie at 0 s, or one would be infinitely faster)."""
    return [w.name for w in bench.workloads
            if not any(r["met_at_start"] or r["target"] is None for r in table if r["workload"] == w.name)]


def times_to_target(bench: Bench, table: Sequence[Mapping[str, Any]], names: Sequence[str],
                    label: Mapping[str, str] | None = None, key: str = "seconds_to_target") -> dict[str, dict]:
    """``{workload: {optimizer: seconds to target}}`` over the workloads that rank (:func:`ranked`)."""
    label = label or {}
    return {w: {label.get(r["optimizer"], r["optimizer"]): r[key] for r in table
                if r["workload"] == w and r["optimizer"] in names} for w in ranked(bench, table)}


def profiles(bench: Bench, table: Sequence[Mapping[str, Any]], r_max: float,
             key: str = "seconds_to_target") -> dict[str, scores.Profile]:
    """The performance profile of each track; the self-tuning one holds the tuned reference as a yardstick."""
    def times(names: Sequence[str], label: Mapping[str, str]) -> dict[str, dict[str, float]]:
        return times_to_target(bench, table, names, label, key)

    if not ranked(bench, table):
        return {}

    out = {}
    if bench.tuned():
        out[TUNED] = scores.performance_profile(times(bench.tuned(), {}), r_max)
    if bench.self_tuning():
        names = [*bench.self_tuning(), *([bench.reference] if bench.reference in bench.tuned() else [])]
        out[SELF_TUNING] = scores.performance_profile(
            times(names, {bench.reference: f"{bench.reference} (tuned)"}), r_max)
    return out


def where_they_ran(jobs: Sequence[Job], sweep_dir: Path) -> str:
    """One line on what the confirm runs' seconds depend on: their machines and thread counts (each value with its
    count of runs) and the CPUs other work kept busy beside them (the range of the runs' medians)."""
    machines: dict[str, int] = {}
    busy = []
    for job in jobs:
        if job.stage != "confirm" or job.value is None:
            continue
        env = _load(sweep_dir / job.folder, "environment.json") or {}
        key = f"{env.get('machine', '?')}, {env.get('threads_per_process', '?')} thread(s)"
        machines[key] = machines.get(key, 0) + 1
        load = ((_load(sweep_dir / job.folder, "summary.json") or {}).get("load") or {}).get("busy_cpus_other")
        if load and load.get("median") is not None:
            busy.append(load["median"])
    text = "; ".join(f"{k} ({n} runs)" for k, n in machines.items()) or "no confirm run finished"
    if busy:
        text += f"; CPUs busy with other work beside them: {min(busy):.2f} to {max(busy):.2f} (medians)"
    return ("Seconds depend on where the runs ran: " + text
            + (" — **not alike: compare steps, not seconds**" if len(machines) > 1 else "") + ".")


def _number(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _not_ranked(workload: str, goal: float | None, own: Sequence[Mapping[str, Any]]) -> str:
    if goal is None:
        why = f"no target (half or more of the reference's runs failed; give hydra.sweeper.workloads.{workload}.target)"
    else:
        why = "the target was met before training by " + ", ".join(
            f"{r['optimizer']} ({r['met_at_start']})" for r in own if r["met_at_start"]) + " (raise the target)"
    return f"**Not ranked**: {why}; this workload is left out of the profile and the speed-ups."


def interval_note(bench: Bench) -> str:
    """What the interval means with this many runs: the percentile bootstrap's interval of a median of n <= 5 runs
    is their range, which holds the true median with probability 1 - 2 x 0.5^n (75% for 3), not 95%."""
    n = bench.studies * bench.confirm_seeds
    if n > 5:
        return f"{n} runs each."
    return (f"With {n} runs each, that interval is their range (min to max), which holds the true median with "
            f"probability {1 - 2 * 0.5 ** n:.0%}, not 95%: more studies narrow it.")


def consistent_edges(chosen: Sequence[Mapping[str, Any]], studies: int) -> dict[str, str]:
    """The keys that every study chose on the same edge of its range (``{"optimizer.lr": "high"}``)."""
    if studies < 2 or len(chosen) < studies:  # one study agreeing with itself says nothing
        return {}
    keys = set.intersection(*(set(c["edges"]) for c in chosen))
    return {k: chosen[0]["edges"][k] for k in keys if len({c["edges"][k] for c in chosen}) == 1}


def _point(bench: Bench, optimizer: str, point: Mapping[str, float], edges: Mapping[str, str],
           agreed: Mapping[str, str] = {}) -> str:  # noqa: B006 (read only)
    dims = {d.key: d for d in bench.spaces[optimizer]}
    texts = []
    for key, value in point.items():
        shown = f"{value:.3g}" + (" of the steps" if dims[key].of_steps else "")
        mark = ("" if key not in edges else f" **({edges[key]} edge in every study)**" if key in agreed
                else f" ({edges[key]} edge)")
        texts.append(f"{key.removeprefix('optimizer.')}={shown}{mark}")
    return ", ".join(texts)


def markdown(bench: Bench, table: Sequence[Mapping[str, Any]], profs: Mapping[str, scores.Profile],
             speedups: Mapping[str, scores.Speedup], jobs: Sequence[Job], r_max: float, sweep_dir: Path) -> str:
    counts = bench.counts()
    failed = [j for j in jobs if j.launched and j.value is None]
    unrun = [j for j in jobs if not j.launched]
    plan = bench.describe().split("\n")
    lines = ["# Optimizer benchmark", "", plan[0] + ":", "", *(f"- {line.strip()}" for line in plan[1:]), "",
             f"{counts['runs']} runs; {len(failed)} failed (misses)"
             + (": " + "; ".join(f"{j.folder}: {j.reason[:120]}" for j in failed[:8]) if failed else "")
             + (f"; {len(unrun)} confirm runs not run, every trial of their study having failed (misses)"
                if unrun else "") + ".", "",
             "Every figure is from the confirm runs (the held-out rows, fresh seeds): the median and the percentile "
             f"bootstrap's 95% interval of the median over the runs. {interval_note(bench)}", "",
             where_they_ran(jobs, sweep_dir), ""]
    for w in bench.workloads:
        own = [r for r in table if r["workload"] == w.name]
        goal = own[0]["target"] if own else None
        lines += [f"## {w.name}: {w.metric} ({w.direction}), target {_number(goal)}"
                  + ("" if w.target is not None else f" (the tuned {bench.reference}'s median)"), "",
                  *([_not_ranked(w.name, goal, own), ""] if w.name not in ranked(bench, table) else []),
                  "| optimizer | track | steps | final: median [95% CI] (runs) | reached | steps to target | "
                  "seconds to target [95% CI] | weights / grads / state / rest MB | peak MB | KL |",
                  "|---|---|---:|---|---:|---:|---|---|---:|---:|"]
        for r in own:
            final = (f"{_number(r['final_median'])} [{_number(r['final_low'])}, {_number(r['final_high'])}] "
                     f"({r['runs']} of {r['jobs']})") if r["final_median"] is not None else f"failed (0 of {r['jobs']})"
            memory = " / ".join(_number(r[k], 3) for k in ("weights_mb", "gradients_mb", "optimizer_state_mb",
                                                           "rest_mb"))
            lines.append(f"| {r['optimizer']} | {r['track']} | {r['steps']} | {final} | {r['reached']} of "
                         f"{r['jobs']} | {_number(r['steps_to_target'])} | {_number(r['seconds_to_target'], 3)} "
                         f"[{_number(r['seconds_low'], 3)}, {_number(r['seconds_high'], 3)}] | {memory} | "
                         f"{_number(r['peak_mb'], 4)} | {_number(r['kl'], 3)} |")
        lines.append("")
    lines += ["## Across workloads", "",
              f"Performance profile of seconds to target (AlgoPerf: the fraction of workloads on which an optimizer "
              f"is within a factor tau of the fastest, its area from 1 to r_max = {r_max:g} over r_max - 1); "
              f"speed-up: the geometric mean of {bench.reference}'s seconds to target over the optimizer's, on the "
              "workloads both reached.", "",
              "| optimizer | track | profile score | speed-up over " + bench.reference + " (workloads counted; "
              "missed by it; missed by " + bench.reference + ") |", "|---|---|---:|---|"]
    for track, prof in profs.items():
        for name in prof.optimizers:
            plain = name.removesuffix(" (tuned)")
            s = speedups.get(plain)
            speed = (f"{'-' if math.isnan(s.speedup) else _number(s.speedup, 3)} ({s.workloads_counted}; "
                     f"{s.optimizer_missed}; {s.baseline_missed})") if s else "-"
            lines.append(f"| {name} | {track} | {prof.scores[name]:.3f} | {speed} |")
    if not profs:
        lines.append("| - | - | - | nothing ranked: no workload has a target that no run met before training |")
    lines.append("")
    if TUNED in profs:
        lines += ["![performance profile](profile.png)", ""]
    if SELF_TUNING in profs:
        lines += ["![performance profile, self-tuning](profile_self_tuning.png)", ""]
    lines += ["## Chosen points", "", "Each study's choice (best final score on the validation rows); a key in the "
              "outer 10% of its range is marked (edge). One study's mark is often chance (with 4 keys, 59% of "
              "uniform draws have one); **bold**: every study chose that edge, so the best may lie beyond it: widen "
              "the range.", ""]
    for r in table:
        agreed = consistent_edges(r["chosen"], bench.studies)
        for choice in r["chosen"]:
            lines.append(f"- {r['workload']} / {r['optimizer']} / study {choice['study']}: "
                         + _point(bench, r["optimizer"], choice["point"], choice["edges"], agreed))
    lines += ["", "## Partitions", ""]
    for name in bench.spaces:
        partition = next((r["partition"] for r in table if r["optimizer"] == name and r["partition"]), "")
        lines.append(f"- {name}: {partition or '-'}")
    return "\n".join(lines) + "\n"


def manifest(bench: Bench, jobs: Sequence[Job], sweep_dir: Path) -> dict[str, Any]:
    """What the report's numbers depend on: versions, seeds, data, machine and threads, the plan, the command."""
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    environments, data = {}, {}
    for job in jobs:
        env = _load(sweep_dir / job.folder, "environment.json")
        if env:
            environments.setdefault(json.dumps({k: v for k, v in env.items() if k != "tokenized_data"},
                                               sort_keys=True), []).append(job.folder)
            if env.get("tokenized_data"):
                data.setdefault(job.workload, set()).add(env["tokenized_data"])
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv, "commit": commit,
            "versions": versions, "plan": bench.describe(), "counts": bench.counts(), "r_max": bench.r_max,
            "targets": {w.name: target(bench, jobs, w.name) for w in bench.workloads},
            "seeds": {"search (a study's index)": sorted({j.seed for j in jobs if j.stage == "search"}),
                      "confirm": sorted({j.seed for j in jobs if j.stage == "confirm"})},
            "data_fingerprints": {k: sorted(v) for k, v in data.items()},
            "environments": [{"environment": json.loads(k), "jobs": len(v)} for k, v in environments.items()]}


def write(bench: Bench, jobs: Sequence[Job], sweep_dir: Path) -> list[Path]:
    """The report folder; returns its files."""
    r_max = bench.r_max
    from rlhf.sweeps.bench.profile_plot import profile_plot

    folder = Path(sweep_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    table = rows(bench, jobs, Path(sweep_dir))
    profs = profiles(bench, table, r_max)
    everyone = [*bench.spaces]
    times = times_to_target(bench, table, everyone)
    speedups = scores.geometric_mean_speedup(times, bench.reference) if times and bench.reference in everyone else {}
    written = [folder / "report.md", folder / "results.csv", folder / "runs.csv", folder / "manifest.json"]
    written[0].write_text(markdown(bench, table, profs, speedups, jobs, r_max, Path(sweep_dir)))
    fields = [k for k in table[0] if k not in ("chosen", "partition")] if table else []
    with open(written[1], "w", newline="") as file:
        out = csv.DictWriter(file, fields + ["profile_score", "speedup"], extrasaction="ignore")
        out.writeheader()
        for r in table:
            prof = profs.get(r["track"])
            out.writerow({**r, "profile_score": prof.scores.get(r["optimizer"]) if prof else None,
                          "speedup": speedups[r["optimizer"]].speedup if r["optimizer"] in speedups else None})
    keys = sorted({k for j in jobs for k in j.point})
    with open(written[2], "w", newline="") as file:
        out = csv.writer(file)
        out.writerow(["stage", "workload", "optimizer", "track", "study", "index", "seed", "steps", "value",
                      "steps_to_target", "seconds_to_target", "reason", "folder", *keys])
        for j in jobs:
            reached = j.reached
            out.writerow([j.stage, j.workload, j.optimizer, j.track, j.study, j.index, j.seed, j.steps, j.value,
                          reached.steps if reached else "",
                          ("inf" if math.isnan(reached.seconds) else reached.seconds) if reached else "", j.reason, j.folder,
                          *(j.point.get(k, "") for k in keys)])
    written[3].write_text(json.dumps(manifest(bench, jobs, Path(sweep_dir)), indent=2, default=str))
    titles = {TUNED: "tuned optimizers", SELF_TUNING: f"self-tuning, beside the tuned {bench.reference}"}
    for track, prof in profs.items():
        path = folder / ("profile.png" if track == TUNED else "profile_self_tuning.png")
        profile_plot(prof, path, f"Seconds to target: {titles[track]}")
        written.append(path)
    return written
