"""GRPO's sampling on a CPU, one decoder against another: transformers' ``generate`` (``algo.generation=transformers``,
what a CPU run uses), the static-cache decoder eager (``static``) and compiled by inductor (``static_compiled``), at the
settings of ``python train.py algo=grpo`` (the embedded default: the warm-started tiny model, 32 prompts of the reverse
task x 8 completions, at most 16 new tokens, temperature 1), 1 thread.

    python benchmarks/cpu_decoding.py                  # 5 rounds, each way in turn within a round
    python benchmarks/cpu_decoding.py --fixed-shapes   # and the compiled decoder with dynamic=False
    python benchmarks/cpu_decoding.py algo.num_generations=4 train.per_device_batch_size=16   # other settings

Each way samples the first training batch of prompts through the run's own path (``GRPO.sample``, as a training
rollout does, with the same seed each time), and its completions are compared with ``generate``'s, token for token.
The compiled decoder's first call includes inductor's compile, from a fresh inductor cache (``--warm-cache`` keeps
torch's own, so that a second run shows the compile with its cached code); its later calls are the steady state.
``--fixed-shapes`` adds the compiled decoder with ``dynamic=False`` (a graph per bucket and batch size, as before the
shapes were made symbolic), in a phase of its own after the others (torch would serve either kind's calls with the
other's graph). Printed: each way's first call, the median and best of the later ones in wall-clock seconds and in
the CPU seconds of this process (one thread: on a shared machine the wall clock also counts the time other
processes held the core; the CPU seconds do not), and each median over ``generate``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.seeds import cpu_name  # noqa: E402

WAYS = ("transformers", "static", "static_compiled")
FIXED = "static_compiled (fixed shapes)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="calls of each way after its first (interleaved)")
    parser.add_argument("--fixed-shapes", action="store_true", help="also the compiled decoder with dynamic=False")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: a fresh one)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides on top of algo=grpo hardware=cpu")
    args = parser.parse_args()
    if not args.warm_cache:  # before torch reads it: the first compiled call pays the whole compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from hydra import compose, initialize_config_dir

    from rlhf.core.instantiate import build
    from rlhf.models import decoding
    from rlhf.run.components import build_run

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["algo=grpo", "hardware=cpu", *args.overrides, "output_dir=unused"])
    strategy = build(cfg.hardware)
    strategy.start(seed=cfg.seed)
    torch.set_num_threads(args.threads)
    run = build_run(cfg, strategy, Path(tempfile.mkdtemp(prefix="cpu-decoding-")))
    algo, model = run.algo, run.model
    prompts = next(iter(run.train_loader))
    groups = algo.num_generations
    print(f"{cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); {len(prompts['input_ids'])} prompts x {groups} completions, "
          f"at most {algo.max_completion_length} new tokens, prompts of {prompts['input_ids'].shape[1]} positions",
          flush=True)

    shipped, fixed = decoding.CPU_COMPILE, {**decoding.CPU_COMPILE, "dynamic": False}

    def sample(way: str) -> tuple[float, float, torch.Tensor]:
        algo.generation = way.split(" ")[0]
        decoding.CPU_COMPILE = fixed if way == FIXED else shipped  # what sample() compiles with
        wall, cpu = time.perf_counter(), time.process_time()
        out = algo.sample(model, prompts, groups, seed=1234)
        return time.perf_counter() - wall, time.process_time() - cpu, out["completion_ids"]

    ways = [*WAYS, FIXED] if args.fixed_shapes else list(WAYS)
    first: dict[str, float] = {}
    later: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    reference = None
    for phase in [WAYS, (FIXED,)] if args.fixed_shapes else [WAYS]:
        torch._dynamo.reset()
        for round_ in range(args.rounds + 1):
            for way in phase:
                wall, cpu, completions = sample(way)
                if reference is None:
                    reference = completions
                same = completions.shape == reference.shape and bool(torch.equal(completions, reference))
                if round_:
                    later[way].append((wall, cpu))
                else:
                    first[way] = wall
                print(f"  round {round_} {way}: {wall:.3f} s, {cpu:.3f} CPU s"
                      f"{'' if same else '; its completions differ from generate'}", flush=True)
    medians = {way: [statistics.median(t[i] for t in later[way]) for i in (0, 1)] for way in ways}
    print(f"\n{'way':31} {'first call':>10} {'median':>8} {'best':>7} {'CPU median':>10} {'CPU best':>8} "
          f"{'generate / this':>16} {'(CPU)':>6}")
    for way in ways:
        (wall, cpu), base = medians[way], medians["transformers"]
        print(f"{way:31} {first[way]:>9.2f}s {wall:>7.3f}s {min(t[0] for t in later[way]):>6.3f}s {cpu:>9.3f}s "
              f"{min(t[1] for t in later[way]):>7.3f}s {base[0] / wall:>15.2f}x {base[1] / cpu:>5.2f}x")
    print("(generate / this: generate's median seconds over this way's; above 1, this way is faster)")


if __name__ == "__main__":
    sys.exit(main())
