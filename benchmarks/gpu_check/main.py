"""The GPU check's coordinator: everything that needs a GPU, in two device calls, each written as a dated page
(``docs/gpu/<date>-<device>.md``) and a summary table of the goals on stdout.

    bash benchmarks/device_wheels.sh        # here, once: the wheels the GPU machine lacks (.whl/, carried)
    # device run, carry [".whl"], timeout_s 550 (the first call; the plan's estimate ~430 s):
    bash benchmarks/gpu_check.sh --part headline --budget-s 460
    # device run, carry [".whl"], right after, only if status's budget_left_s >= 240 (the second call, in what the
    # session's device time leaves): timeout_s budget_left_s - 30
    bash benchmarks/gpu_check.sh --part rest --budget-s <budget_left_s - 120>
    WHEELS=none bash benchmarks/gpu_check.sh --device cpu   # the rehearsal: tiny sizes, every section
    bash benchmarks/gpu_check.sh --part headline --pairs 1b/16/sft_bf16,100m/32/dpo_bf16   # a later call: named pairs

``benchmarks/gpu_check.sh`` runs ``python benchmarks/gpu_check`` (``python -m gpu_check`` with ``benchmarks/`` on the
path does the same). Parts (``--part``): ``headline`` is the speed section at real lengths
(:data:`gpu_check.plan.HEADLINE`) and the profile; ``rest`` is everything else; ``all`` (the rehearsal's) both. Sections, in order (each result is
written to ``<out>/gpu_check.json`` as soon as it exists, so a run stopped at its limit still leaves what it
measured); a section during which torch's compiler hit its recompile limit fails (:mod:`gpu_check.recompiles`):

0. **Preflight** (every part, ~60 s: :data:`gpu_check.sections.preflight.PROBES`, side by side, each in a process of
   its own; on the CPU's rehearsal too, at a CPU's sizes): each GPU path against a reference that shares none of its
   code (:mod:`gpu_check.sections.probes`): the output layer's Triton kernel against float64 (values and gradients,
   a temperature and a bias in play), compiled decoder layers against eager, pairs packed under flex attention with
   ``rlhf.data.layout_masks``' own block mask against sdpa with its dense mask, the static-cache decoder's tokens
   against transformers' ``generate``'s (greedy, and sampled with one seed). A path that fails is not measured: the
   levers that ask for it are skipped, and where ``auto`` chooses it on a GPU it is turned off for the rest of the
   call by its named override (``algo.fused_output_layer=true``, ``hardware.compile=false``,
   ``algo.generation=transformers``), given to every run of ours (losses, paths, resume, speed, levers, memory; a
   lever that only asks for a fallback is skipped), and its row on the page says so. On a GPU the models are built
   and the in-process checks (losses, layouts, kernels) run each in a process of its own
   (:mod:`gpu_check.workers.isolated`), so this process holds no CUDA work a sticky error could break.

1. **Correctness** (float32): the first-step DPO, SFT and GRPO losses of ours and TRL's on the same batch
   (``benchmarks/bench.py``'s checks), |Δ| < 1e-4; the tiled output layer, the shared-prompt layout (on a GPU also
   under flex attention's block mask) and padding-free pairs against two plain sequences a pair: DPO's loss and
   every parameter's gradient; **every single-GPU path** (:data:`gpu_check.sections.correctness.PATHS`:
   ``hardware=fsdp`` and ``hardware=zero3`` on one process, ``peft=lora``, GRPO, PPO) for a few steps, against
   ``hardware=gpu``'s losses where the math is the same; a resume against the uninterrupted run (bit for bit, else
   the largest difference).
2. **Checkpoint cost**: the resume's first run's checkpoint seconds as a share of training.
3. **The output layer's kernels** (:data:`gpu_check.sections.kernels.WAYS`): the logits whole, our torch tiles and
   Triton kernel, Liger-Kernel's, and any kernel added to that list.
4. **Speed and memory** against TRL at equal settings and against TRL with its own best options (Liger-Kernel: TRL
   1.16's padding-free needs flash attention for SFT and falls back to padding for DPO), in the plan's order, each
   pair started only while its estimate (:func:`gpu_check.plan.pair_seconds`, corrected by the pairs before it) fits
   the budget: samples/s, the ratios with their range over ``--rounds`` alternating rounds, peak GPU memory, MFU.
5. **Profile** (headline): the first pair's both sides under torch.profiler: top CUDA kernels, the GPU's idle share.
6. **Levers** (:data:`gpu_check.plan.LEVERS`): our side with one option changed against our defaults on the same
   case; what they say of each ``auto`` default (:mod:`gpu_check.page.defaults`).
7. **Memory at the peak** (a GPU only): both sides' allocator history over a profiled step.

Then the goals (:data:`gpu_check.plan.GOALS`) are judged from what was measured ("not measured" where a case did not
run).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check import plan as plans
from gpu_check import state
from gpu_check.page.markdown import page, summary
from gpu_check.plan import LEVERS, PLAN, check_levers, check_plan
from gpu_check.recompiles import RecompileWatch
from gpu_check.sections import correctness, preflight
from gpu_check.sections.correctness import LOSS_TOLERANCE
from gpu_check.sections.speed import best_options_missing
from gpu_check.sections.timed import levers_section, memory_section, speed_section
from gpu_check.state import GRACE_S, Report, SectionBudget, device_commands, last_line, skipped_sections
from gpu_check.workers import isolated
from gpu_check.workers.turns import SIDES, Pool

ROOT = bench.ROOT
PARTS = {"headline": {"speed", "profile"},
         "rest": {"losses", "layouts", "paths", "resume", "kernels", "speed", "levers", "memory"}}
PARTS["all"] = PARTS["headline"] | PARTS["rest"]
PART_PLANS = {"headline": plans.HEADLINE, "rest": plans.SHORT, "all": plans.PLAN}
CORRECTNESS_SIZE = {"cuda": "100m", "cpu": "3m"}
RESUME_STEPS = {"cuda": 20, "cpu": 1}  # N: checkpoints at N and 2N


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def optional_version(name: str) -> str:
    """``name version``, or why it does not import (an optional package: its rows say so too)."""
    try:
        import importlib

        return f"{name} {getattr(importlib.import_module(name), '__version__', '?')}"
    except Exception as error:  # noqa: BLE001  (deepspeed raises more than ImportError without its dependencies)
        return f"{name} absent ({type(error).__name__})"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: the check; cpu: its rehearsal at tiny sizes (every code path, no figure)")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="where gpu_check.json and the page go")
    parser.add_argument("--part", default=None, choices=list(PARTS),
                        help="headline: real lengths and the profile (one call); rest: everything else (a second "
                             "call); all: both (default on the CPU rehearsal; on a GPU: headline)")
    parser.add_argument("--budget-s", type=int, default=460,
                        help="seconds the check may take: pairs and sections start only while their estimate fits")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: the CPUs)")
    parser.add_argument("--skip", default="", type=skipped_sections, help="sections to leave out, comma-separated")
    parser.add_argument("--pairs", default="", help="only these speed pairs of the part's plan, as size/batch/case"
                        "[/shape], comma-separated (a later call picks up the pairs an earlier one did not reach)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each side of a speed pair, alternating (default: 3 on a GPU, 1 on the CPU)")
    args = parser.parse_args()
    args.part = args.part or ("all" if args.device == "cpu" else "headline")
    args.rounds = args.rounds or (1 if args.device == "cpu" else 3)
    return args


def main() -> int:
    args = parse()
    started = time.perf_counter()
    try:  # what the GPU machine may lack or hold in another version: fail in seconds, naming it
        import importlib

        import rlhf  # noqa: F401  (first: it quiets bitsandbytes' notice of a Hub kernel, which peft's import prints)

        names = ["torch", "transformers", "accelerate", "peft", "datasets", "pyarrow", "huggingface_hub", "hydra",
                 "omegaconf", "trl"]
        print("versions: " + ", ".join(f"{n} {importlib.import_module(n).__version__}" for n in names)
              + ", " + ", ".join(optional_version(n) for n in ("deepspeed", "liger_kernel", "triton")), flush=True)
        import rlhf.run.loop  # noqa: F401  (the package imports against these versions)
    except ImportError as error:
        print(f"{error}: a package is missing or too old here. Fix: run benchmarks/device_wheels.sh where pip works and "
              "carry .whl (benchmarks/gpu_check.sh installs it)", file=sys.stderr)
        return 2
    import datasets
    import torch
    import transformers

    from rlhf.hardware.base import cpus_available
    from rlhf.telemetry.mfu import machine_name, probe

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    device, tiny = args.device, args.device == "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU here (the rehearsal is --device cpu)", file=sys.stderr)
        return 2
    state.THREADS[0] = args.threads or cpus_available()
    torch.set_num_threads(state.threads())
    check_plan(PLAN + plans.TINY_PLAN)
    check_levers(LEVERS, PLAN)
    check_levers(plans.TINY_LEVERS, plans.TINY_PLAN)
    plan = plans.TINY_PLAN if tiny else PART_PLANS[args.part]
    if args.pairs:  # the headline's call may also name the pairs its estimate leaves out
        plan = plans.parse_pairs(args.pairs, plan + (plans.LATER if args.part == "headline" else []))
    levers, profiled = (plans.TINY_LEVERS, plans.TINY_PROFILE) if tiny else (LEVERS, plans.PROFILE_CASE)
    sections = PARTS[args.part] - args.skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = machine_name(torch.device(device))
    estimate = plans.plan_seconds(plan, args.rounds, profiled=profiled if "profile" in sections else None) \
        if "speed" in sections else 0.0
    header = {"date": time.strftime("%Y-%m-%d"), "machine": f"{device_name}, {platform.system()}",
              "versions": bench.versions(), "command": "python benchmarks/gpu_check " + " ".join(sys.argv[1:]),
              "budget_s": args.budget_s, "elapsed_s": 0.0, "device": device, "part": args.part,
              "plan_estimate_s": estimate}
    report = Report(out, header)
    report.data["peaks"] = probe(torch.device(device))
    print(f"{device_name}: {header['versions']}; part {args.part}: {', '.join(sorted(sections))}", flush=True)
    budget = SectionBudget(started, args.budget_s, GRACE_S, enforced=not tiny)
    note = budget.note
    if "speed" in sections:
        note(f"the speed plan: {len(plan)} pair(s) x {args.rounds} round(s), estimated {estimate:.0f} s against a "
             f"{args.budget_s} s budget (pairs that would pass it are skipped)")
    pool = Pool(state.threads(), out)  # the workers' output: <out>/workers.log (of the 8 files that come back)
    if "speed" in sections:  # the workers' imports run while the preflight, the models and the correctness run
        pool.start([s for s in SIDES if s != "trl_best" or best_options_missing() is None])
    preflight_rows = preflight.preflight(device) if sections & {"speed", "levers"} or device == "cuda" else []
    for row in preflight_rows:
        report.add("correctness", {k: v for k, v in row.items() if k in ("check", "value", "ok")})
        if row.get("failed"):
            note(f"{row['check']} FAILED: {row['value']}")
    report.data["fallbacks"] = [r["override"] for r in preflight_rows if r.get("failed") and r.get("override")]
    preflight.CALL_ROWS[:] = preflight_rows  # every run of ours: paths, resume, memory, speed, levers
    with tempfile.TemporaryDirectory() as tmp, contextlib.closing(pool):
        work = Path(tmp)
        models: dict[str, tuple[Path, int]] = {}

        def isolated_on_gpu(target: str, args: list, cap_s: float, here):
            """``target(*args)``: on a GPU in a process of its own (:mod:`gpu_check.workers.isolated`; ``cap_s`` at most
            and never past the call's deadline), so that this process holds no CUDA work; on a CPU ``here()``."""
            if device != "cuda":
                return here()
            return isolated.call(target, args, min(cap_s, bench.timeout_s() or cap_s))

        def model(size: str) -> tuple[Path, int]:
            if size not in models:
                folder = work / f"model-{size}"
                models[size] = (folder, isolated_on_gpu("bench:build_model", [size, str(folder), device], 180.0,
                                                        lambda: bench.build_model(size, folder, device)))
                note(f"built {size}: {models[size][1] / 1e6:.1f}M parameters")
            return models[size]

        def guarded(what: str, section, estimate_s: float = 0.0):
            """Run one section; one that raises (or hits torch's recompile limit here) is a finding (a failed
            correctness row), not the end of the check; one that would pass the budget is a row saying so."""
            if not budget.fits(estimate_s):
                report.add("correctness", {"check": what, "value": "not run: out of the time budget", "ok": None})
                return None
            try:
                with RecompileWatch(what):
                    return section()
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                report.add("correctness", {"check": what, "value": f"raised {last_line(error)}", "ok": False})
                note(f"{what} RAISED {type(error).__name__}")
                return None

        size = CORRECTNESS_SIZE[device]
        startup = plans.STARTUP_S[size]
        if sections & {"losses", "layouts", "paths", "resume"}:
            model_dir, _ = model(size)
        if "losses" in sections:
            loss_options = {algo: preflight.algo_options(algo) for algo in ("dpo", "sft")}  # the preflight's
            for algo, (ours, theirs) in (guarded("losses against TRL", lambda: isolated_on_gpu(
                    "bench:check_losses", [str(model_dir), "short", 8, device, loss_options], 240.0,
                    lambda: bench.check_losses(model_dir, "short", device=device, options=loss_options)),
                    2 * startup) or {}).items():
                report.add("correctness", {"check": f"{algo.upper()} first-step loss = TRL's ({size}, float32)",
                                           "value": f"{ours:.6f} vs {theirs:.6f}, |Δ| {abs(ours - theirs):.1e}",
                                           "ok": abs(ours - theirs) < LOSS_TOLERANCE})
            note("losses against TRL checked")
        for section, what, run, estimate_s in (
                ("layouts", "layouts", lambda: isolated_on_gpu("gpu_check.sections.correctness:layouts", [str(model_dir), device],
                                                               180.0, lambda: correctness.layouts(model_dir, device)),
                 startup),
                ("paths", "single-GPU paths", lambda: correctness.paths(model_dir, work, device),
                 (1 + len(correctness.PATHS)) * startup)):
            if section in sections:
                for row in guarded(what, run, estimate_s) or []:
                    report.add("correctness", row)
                note(f"{what} checked")
        if "resume" in sections:
            resumed = guarded("resume and checkpoint cost", lambda: correctness.resume_and_checkpoints(
                model_dir, work, device, RESUME_STEPS[device]), 3 * startup)
            if resumed:
                report.add("correctness", resumed[0])
                report.add("checkpoint", resumed[1])
                note(f"resume: {resumed[0]['value']}; a checkpoint costs {resumed[1]['share']:.2%} of training")
        if "kernels" in sections:
            # in a process of its own on the CPU too (the rehearsal runs the isolated path once)
            for row in guarded("output layer kernels", lambda: isolated.call(
                    "gpu_check.sections.kernels:output_layer_kernels", [device], min(150.0, bench.timeout_s() or 150.0)),
                    15.0) or []:
                report.add("kernels", row)
            note("output layer kernels timed")
        if "speed" in sections:
            speed_section(plan, profiled if "profile" in sections else None, args.rounds, report, budget, model, work,
                          device, out, pool, preflight_rows)
        if "levers" in sections:
            levers_section(levers, args.rounds, report, budget, model, work, device, pool, preflight_rows)
        if "memory" in sections:
            memory_section(report, budget, models, work, device)
    report.data["header"]["elapsed_s"] = budget.elapsed()
    report.save()
    text = page(report.data)
    path = out / f"{header['date']}-{slug(device_name)}-{args.part}.md"
    path.write_text(text)
    print(text)
    print(summary(report.data))
    print("\n" + device_commands())
    failed = [c["check"] for c in report.data["correctness"] if c["ok"] is False]
    if failed:
        print(f"correctness FAILED: {failed}", file=sys.stderr)
        return 1
    print(f"written {path} and {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
