"""Measure speed levers of our loop against its defaults: the same run with and without each override.

    python benchmarks/levers.py fused=optimizer.fused=true                       # 3m, short rows, DPO, 3 rounds
    python benchmarks/levers.py --size 100m --rounds 2 logits=algo.completion_logits_only=true \\
        "both=algo.completion_logits_only=true optimizer.fused=true"
    python benchmarks/levers.py --algo sft compile=hardware.compile=true
    python benchmarks/levers.py --size 100m --base hardware.mixed_precision=bf16 sdpa=model.attn_implementation=sdpa

Each lever is ``NAME=OVERRIDES`` (space-separated overrides in one argument). The runs are bench.py's (the same
random-init Llama sizes, random rows, batch, threads and shared settings; float32 unless an override says
otherwise; ``--base`` adds overrides to every variant, the defaults included), without TRL. The variants run
interleaved, round after round (defaults, lever 1, lever 2, defaults, ...), so that a slow minute of a shared
machine falls on all of them alike; each run's samples/s is its steady state (the second half of ``2 x steps``
optimizer steps). The table gives every round's value, the best, and the best against the defaults' best: the
least disturbed run of each is the fairest comparison on a busy machine.
Written to ``--out`` as ``levers-<size>-<shape>-<algo>.md`` and printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/bench.py: sizes, rows, the command of one of our runs)

ROOT = bench.ROOT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("levers", nargs="+", metavar="NAME=OVERRIDES", help="a lever: a name, '=', its overrides")
    parser.add_argument("--size", default="3m", choices=list(bench.SIZES))
    parser.add_argument("--shape", default="short", choices=list(bench.SHAPES))
    parser.add_argument("--algo", default="dpo", choices=["dpo", "sft"])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, interleaved")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default: bench.py's by size)")
    parser.add_argument("--batch", type=int, default=8, help="samples (pairs, rows) per optimizer step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPUs)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "levers"), help="where the table goes")
    parser.add_argument("--base", action="append", default=[], metavar="OVERRIDE",
                        help="an override of every variant, the defaults' too (repeatable), e.g. --base "
                             "hardware.mixed_precision=bf16: levers measured on top of it")
    args = parser.parse_args()
    variants = {"defaults": []}
    for lever in args.levers:
        name, sep, overrides = lever.partition("=")
        if not sep or not overrides.strip() or name in variants:
            parser.error(f"{lever!r}: write a lever as NAME=OVERRIDES, with a new name (e.g. fused=optimizer.fused=true)")
        variants[name] = overrides.split()

    from rlhf.hardware.base import cpus_available

    threads = args.threads or cpus_available()
    steps = args.steps or bench.STEPS[args.size]
    case = f"{args.algo}_fp32"
    results: dict[str, list[dict]] = {name: [] for name in variants}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = bench.build_model(args.size, work / "model")
        data = work / f"{args.algo}.jsonl"
        bench.write_jsonl(bench.make_rows(args.algo, args.shape, 512), data)
        for round_ in range(args.rounds):
            for name, overrides in variants.items():
                results[name].append(bench.run_ours_into(work / f"{name}-{round_}", case, work / "model", data,
                                                         work / "cache", args.batch, steps, threads,
                                                         [*args.base, *overrides]))
                print(f"round {round_ + 1} {name}: {results[name][-1]['samples_per_s']:.2f} samples/s "
                      f"[{time.perf_counter() - started:.0f} s]", flush=True)
    base = max(r["samples_per_s"] for r in results["defaults"])
    title = (f"{args.size} ({params / 1e6:.1f}M parameters), {args.shape} rows, {args.algo}, batch {args.batch}, "
             f"{steps} timed steps, {threads} threads, {args.rounds} interleaved rounds"
             f"{'; every variant with ' + ' '.join(args.base) if args.base else ''}; {bench.machine()}; "
             f"{time.strftime('%Y-%m-%d')}")
    lines = [f"# Levers: {title}", "", f"`python benchmarks/levers.py {' '.join(sys.argv[1:])}`", "",
             "| variant | overrides | samples/s per round | best | best / defaults' best | peak MB |",
             "|---|---|---|---:|---:|---:|"]
    for name, runs in results.items():
        values = [r["samples_per_s"] for r in runs]
        lines.append(f"| {name} | {' '.join(variants[name]) or '-'} | {', '.join(f'{v:.1f}' for v in values)} | "
                     f"{max(values):.1f} | {max(values) / base:.2f} | {max(r['peak_mem_mb'] for r in runs):.0f} |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"levers-{args.size}-{args.shape}-{args.algo}.md"
    path.write_text(table)
    print(table + f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
