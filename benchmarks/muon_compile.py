"""Muon's step (``optimizer=muon``, rlhf/optim/rules.py) eager against compiled, per dtype of its Newton-Schulz
iteration, each as a ratio to AdamW's step (``optimizer=adamw``) on the same model.

    python benchmarks/muon_compile.py                              # the embedded default's model, float32 and bfloat16
    python benchmarks/muon_compile.py --ns-dtype float32 --out muon.md   # float32 only; the table to a file too

For each ``--ns-dtype`` (``optimizer.ns_dtype``: ``float32`` is what ``auto`` takes on a CPU without bf16 matrix
units, this project's own loop ``rlhf.optim.rules.orthogonalize``; ``bfloat16`` is torch's own step, whose iteration
is ``torch.optim._muon._zeropower_via_newtonschulz``), three variants: eager; the iteration compiled (the module
function replaced by ``torch.compile`` of it: both steps call it by its module name once per matrix); and the whole
``optimizer.step`` compiled (https://pytorch.org/docs/stable/generated/torch.compile.html; inductor's C++ backend
on a CPU). Each: the median of ``--steps`` timed steps after warm-up, and the first step's seconds (with the
compile). Optimizers are built and gradients set as ``benchmarks/optimizer_costs.py`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from optimizer_costs import build_model, build_optimizer, fixed_gradients, machine, timed_steps

# where each dtype's Newton-Schulz iteration lives: (module, function name) that the step calls per matrix
ITERATIONS = {"float32": ("rlhf.optim.rules", "orthogonalize"),
              "bfloat16": ("torch.optim._muon", "_zeropower_via_newtonschulz")}
VARIANTS = ("eager", "iteration_compiled", "step_compiled")


@contextlib.contextmanager
def compiled_iteration(ns_dtype: str):
    """Muon's Newton-Schulz iteration for ``ns_dtype`` compiled where the step looks it up; eager back on exit."""
    import importlib

    module_name, function = ITERATIONS[ns_dtype]
    module = importlib.import_module(module_name)
    eager = getattr(module, function)
    setattr(module, function, torch.compile(eager))
    try:
        yield
    finally:
        setattr(module, function, eager)


def time_variant(option: str, overrides: tuple[str, ...], variant: str, ns_dtype: str | None, model, model_option,
                 gradients, initial, args) -> dict[str, Any]:
    """One variant's median step ms, timed steps and first step's seconds (or the error it raised)."""
    torch._dynamo.reset()
    model.load_state_dict(initial)
    try:
        _, optimizer = build_optimizer(option, model, model_option, overrides)
        step = torch.compile(optimizer.step) if variant == "step_compiled" else optimizer.step
        context = compiled_iteration(ns_dtype) if variant == "iteration_compiled" else contextlib.nullcontext()
        with context:
            times, first = timed_steps(model, gradients, step, max(args.warmup, 2), args.steps, args.budget_s)
        return {"step_ms": 1000 * statistics.median(times), "first_step_s": first, "timed_steps": len(times)}
    except Exception as error:  # e.g. no C++ compiler for inductor: said, not fatal
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        for p in model.parameters():
            p.grad = None


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table: one row per dtype and variant."""
    adamw_ms = report["adamw_step_ms"]
    lines = [f"Measured {report['date']} on {report['machine']} ({os.cpu_count()} CPUs; load average "
             f"{', '.join(f'{v:.2f}' for v in report['load_average'])}), torch {report['torch']}, {report['threads']} "
             f"thread(s); model: {report['model']}; AdamW's step {adamw_ms:.2f} ms; `{report['command']}`", "",
             "| ns_dtype | variant | step ms | vs eager | vs adamw | first step (with the compile), s |",
             "|---|---|---|---|---|---|"]
    for ns_dtype, variants in report["muon"].items():
        eager_ms = variants["eager"].get("step_ms")
        for variant in VARIANTS:
            figures = variants[variant]
            if "error" in figures:
                lines.append(f"| {ns_dtype} | {variant} | {figures['error'][:160]} | - | - | - |")
                continue
            vs_eager = f"{figures['step_ms'] / eager_ms:.2f}" if eager_ms else "-"
            lines.append(f"| {ns_dtype} | {variant} | {figures['step_ms']:.1f} ({figures['timed_steps']} steps) | "
                         f"{vs_eager} | {figures['step_ms'] / adamw_ms:.0f} | {figures['first_step_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default=None, help="a conf/model option (default: the embedded default's model)")
    parser.add_argument("--ns-dtype", nargs="+", default=list(ITERATIONS), choices=list(ITERATIONS),
                        help="optimizer.ns_dtype values to time (default: float32 bfloat16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every step (default 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (2 at least: the "
                        "first compiles)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (their median is reported)")
    parser.add_argument("--budget-s", type=float, default=30.0, help="seconds of steps per variant past which its "
                        "warm-up and timed steps stop (one timed step at least)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fixed random gradients")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    gradients = fixed_gradients(model, args.seed)
    adamw = time_variant("adamw", (), "eager", None, model, args.model, gradients, initial,
                         argparse.Namespace(warmup=3, steps=20, budget_s=args.budget_s))
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
        "model": args.model or "embedded default (tiny)", "adamw_step_ms": adamw["step_ms"],
        "command": " ".join(["python benchmarks/muon_compile.py", *(argv if argv is not None else sys.argv[1:])]),
        "muon": {ns_dtype: {variant: time_variant("muon", (f"optimizer.ns_dtype={ns_dtype}",), variant, ns_dtype,
                                                   model, args.model, gradients, initial, args)
                            for variant in VARIANTS}
                 for ns_dtype in args.ns_dtype}}
    text = markdown(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return report


if __name__ == "__main__":
    main()
