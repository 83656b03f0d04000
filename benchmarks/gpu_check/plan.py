"""What the GPU check runs, in which order, and how long each pair is expected to take.

A plan entry is ``(size, batch, case, shape)``: a model size and a case of ``benchmarks/bench.py``, the samples a
step, and a data shape (``bench.SHAPES``: ``real`` is prompts up to 256 and completions up to 384 tokens, GRPO
sampling 128; ``short`` is 32 + 32). A pair runs in the call's long-lived workers (:mod:`gpu_check.workers.turns`):
each side built and warmed up (:data:`WARMUP_STEPS`), then ``rounds`` timed windows of :func:`steps_for` steps each by turns:
ours, TRL, TRL with its own best options (``bench.TRL_BEST``), ours, ...; a pair starts only while
:func:`pair_seconds` says it fits the budget, its estimate corrected by how far the pairs before it were off
(:func:`calibrated`).

The estimate (:func:`plan_seconds`): the preflight (the workers start meanwhile), the first compiles and TRL's
imports once a call, a recompile at each change of size between pairs, GRPO's decoding compiled and captured; per
pair each side's build and warm-up (BUILD_S: not measured on a GPU yet), and its windows, of the padded tokens of a step at a rate measured on an H200 at 32 + 32
tokens, batch 64, bf16 (docs/gpu/2026-11-27-nvidia-h200-second-run.md: DPO 1,188 pairs/s at 100m and 263 at ~1B;
SFT's and GRPO's training from DPO's by FLOPs per token, 6 against 8 x parameters: SFT's measured 1,295 rows/s at
100m was launch-bound at 49 tokens a row), scaled by tokens (lengths bring the GPU closer to its peak, so the
estimate errs long); GRPO adds its sampling, one forward pass a new token (100m: 12 ms a token, from GRPO fp32's 168
completions/s at 32 new tokens; ~1B: the same per layer).
"""

from __future__ import annotations

import bench  # benchmarks/bench.py: sizes, cases, shapes, the command of one of our runs

ROOT = bench.ROOT

# ---- the plan ------------------------------------------------------------------------------------------------------
# The headline (its own device call, --part headline): real lengths, what the goals read first; then, while the
# budget lasts, the rest. The first entry is profiled (PROFILE_CASE).
# Grouped by size (a change of size resets our worker's compiled graphs: SIZE_SWITCH_S). What the goals read: DPO's
# and SFT's ratios and the 1B MFU, GRPO's ratio.
HEADLINE = [("1b", 16, "dpo_bf16", "real"), ("1b", 16, "sft_bf16", "real"), ("100m", 32, "dpo_bf16", "real"),
            ("100m", 32, "sft_bf16", "real"), ("100m", 16, "grpo_bf16", "real")]
# GRPO last: TRL's side of it has stopped with a device-side assert in bf16 before, which ends its worker.
# The real-length pairs the headline's estimate leaves out (with every cost charged it would pass its budget):
# a later call names them (--part headline --pairs 1b/32/sft_bf16,...).
LATER = [("100m", 16, "dpo_bf16", "real"), ("100m", 16, "sft_bf16", "real"), ("1b", 32, "sft_bf16", "real"),
         ("1b", 32, "dpo_bf16", "real")]
# Pairs whose three sides do not fit on the device together (TRL ~116 GB alone at 1b, batch 32 real rows; 1b batch 16
# DPO ~160 GB with three sides resident): each side runs its rounds (and its profile) and drops its run before the
# next is built, on a GPU of at least MIN_MEMORY_GB (else skipped). A pair run by turns whose side runs out of memory
# is run again this way (gpu_check.sections.speed.speed_pair).
BLOCKS = {pair for pair in HEADLINE + LATER if pair[0] == "1b"}
MIN_MEMORY_GB = {("1b", 32, "dpo_bf16", "real"): 120}
# Short rows (32 + 32 tokens): a step there is mostly kernel launches; the launch-overhead rows (--part rest).
SHORT = [("100m", 64, "dpo_bf16", "short"), ("100m", 8, "dpo_shipped", "short"), ("100m", 64, "sft_bf16", "short"),
         ("100m", 64, "grpo_bf16", "short")]
PLAN = HEADLINE + LATER + SHORT
PROFILE_CASE = HEADLINE[0]  # profiled on both sides (torch.profiler): top kernels, the GPU's idle share
# The rehearsal on a CPU: a DPO pair and an SFT pair at the smallest size on short rows (the real shape's rows:
# tests/test_bench.py), float32 (bf16 is emulated on a CPU without bf16 units, ~15x slower: the bf16 twins differ by
# one override, checked by check_plan), profiled. GRPO's and SFT's runners: tests/test_bench.py, and GRPO and PPO
# through train.py in the paths section.
# SFT second: each worker builds a second side after freeing the first (TRL's worker a second trainer), as a GPU's do.
TINY_PLAN = [("3m", 8, "dpo_fp32", "short"), ("3m", 8, "sft_fp32", "short")]
TINY_PROFILE = TINY_PLAN[0]
BLOCKS.add(TINY_PLAN[1])  # the rehearsal runs blocks with real workers too (one side's run freed before the next)

# Levers, our side only, each against our defaults on the same case in the same call (the speed row when it ran,
# else one more run of the defaults): (size, batch, case, shape, name, overrides). ``None`` overrides: a lever whose
# option is not built yet, listed so that its row says so; fill in the override when it lands. Each ``auto`` option
# of rlhf/core/auto_choices.py has a lever that changes it alone (the page's verdict on its GPU choice:
# gpu_check.page.defaults), and each path built but not chosen there (``untried``) one that turns it on: a path
# becomes auto's GPU choice only with a page where that lever was faster in every round.
LEVERS = [
    ("100m", 32, "dpo_bf16", "real", "two sequences a pair", ["algo.shared_prompt=false"]),
    ("100m", 32, "dpo_bf16", "real", "plain output layer", ["algo.fused_output_layer=false"]),
    ("100m", 32, "dpo_bf16", "real", "the output layer's Triton kernel", ["algo.fused_output_layer=triton"]),
    ("100m", 32, "dpo_bf16", "real", "packed shared prompt (flex block mask)",
     ["model.attn_implementation=flex_attention"]),
    ("100m", 32, "dpo_bf16", "real", "padding-free pairs, no shared prompt (flex attention)",
     ["algo.padding_free=true", "algo.shared_prompt=false"]),
    ("100m", 32, "sft_bf16", "real", "padding-free (flex attention)", ["algo.padding_free=true"]),
    ("100m", 32, "dpo_bf16", "real", "compiled decoder layers (regional compilation)", ["hardware.compile=layers"]),
    ("100m", 32, "dpo_bf16", "real", "the verdict kept on the device (found-inf read at the log window)",
     ["train.nonfinite_on_device=true"]),
    ("100m", 32, "dpo_bf16", "real", "2 workers collating ahead of the step", ["data.num_workers=2"]),
    ("100m", 16, "grpo_bf16", "real", "the static-cache decoder (its step in CUDA graphs)", ["algo.generation=static"]),
    ("100m", 16, "grpo_bf16", "real", "transformers' generate, static cache", ["algo.cache_implementation=static"]),
    ("1b", 16, "dpo_bf16", "real", "plain output layer", ["algo.fused_output_layer=false"]),
    ("1b", 16, "dpo_bf16", "real", "the output layer's Triton kernel", ["algo.fused_output_layer=triton"]),
]
TINY_LEVERS = [("3m", 8, "dpo_fp32", "short", "plain output layer", ["algo.fused_output_layer=false"]),
               ("3m", 8, "dpo_fp32", "short", "an option not built yet", None)]

WINDOW_S = 2.0  # seconds of GPU work a timed window aims at (3 steps at least)
MIN_STEPS, CPU_STEPS = 3, 2  # the fewest steps a window has on a GPU; a window's steps on the CPU rehearsal (3m)
WARMUP_STEPS = {"cuda": 3, "cpu": 1}  # untimed steps of each side after its build (allocations, first compiles)


def steps_for(size: str, batch: int, case: str, shape: str) -> int:
    """Steps of one timed window: about :data:`WINDOW_S` of the estimated step (:func:`step_seconds`), at least
    :data:`MIN_STEPS` (the CPU rehearsal's 3m: :data:`CPU_STEPS`)."""
    if size == "3m":
        return CPU_STEPS
    return max(MIN_STEPS, round(WINDOW_S / step_seconds(size, batch, case, shape)))


# ---- the estimate --------------------------------------------------------------------------------------------------
WORKERS_START_S = 30.0  # the three workers' start, side by side: imports, CUDA (once a call)
PREFLIGHT_S = 60.0  # the preflight's probes side by side, each a process: imports, cold compiles (the workers start meanwhile)
FIRST_COMPILE_S = 60.0  # the first cold compiles of a call: our decoder layers, Liger's Triton kernels
TRL_IMPORT_S = 15.0  # TRL's and Liger-Kernel's imports at the TRL workers' first build
SIZE_SWITCH_S = 20.0  # a pair of another size than the one before: our worker's graphs reset, compiled again
GRPO_COMPILE_S = 40.0  # a GRPO pair: our decoding step compiled and captured in CUDA graphs
OVERHEAD_S = 40.0  # models built (each in a process of its own), data written, the page
BUILD_S = {"3m": 4.0, "25m": 2.0, "100m": 1.5, "1b": 2.5}  # one side built in its worker (model from page cache)
TURN_S = 0.3  # a turn's messages and synchronizations
STARTUP_S = {"3m": 8.0, "25m": 12.0, "100m": 20.0, "1b": 28.0}  # one process of its own: imports, CUDA, model, data
TOKENS_PER_S = {  # a step's padded tokens per second, H200, bf16 (see the module's docstring); 3m: a CPU's
    ("100m", "dpo"): 1188 * 122, ("100m", "sft"): 1188 * 122 * 8 / 6, ("100m", "grpo"): 1188 * 122 * 8 / 6,
    ("1b", "dpo"): 263 * 122, ("1b", "sft"): 263 * 122 * 8 / 6, ("1b", "grpo"): 263 * 122 * 8 / 6,
    ("3m", "dpo"): 20_000, ("3m", "sft"): 20_000, ("3m", "grpo"): 20_000}
STEP_FLOOR_S = {"3m": 0.02, "100m": 0.055, "1b": 0.13}  # launch-bound: a step never takes less (H200, batch 8)
DECODE_S_PER_TOKEN = {"3m": 0.01, "100m": 0.012, "1b": 0.012 * 22 / 8}  # GRPO's sampling, one token of a batch


def step_seconds(size: str, batch: int, case: str, shape: str) -> float:
    """One optimizer step's expected seconds: the step's padded tokens (each sequence at the shape's longest, as a
    batch pads to its longest row) at :data:`TOKENS_PER_S`, at least :data:`STEP_FLOOR_S`; GRPO adds a forward
    pass per new token."""
    algo = bench.CASES[case][0]
    prompt, completion = bench.SHAPES[shape]
    if algo == "grpo":
        completion = bench.new_tokens(shape)
    sequences = 2 if algo == "dpo" else 1
    tokens = batch * sequences * (prompt + completion + 1)
    seconds = max(STEP_FLOOR_S[size], tokens / TOKENS_PER_S[(size, algo)])
    if algo == "grpo":
        seconds += bench.new_tokens(shape) * DECODE_S_PER_TOKEN[size]
    return seconds


def run_seconds(size: str, batch: int, case: str, shape: str) -> float:
    """One process of its own (the memory section's runs): start-up and ``2 x steps`` steps."""
    return STARTUP_S[size] + 2 * steps_for(size, batch, case, shape) * step_seconds(size, batch, case, shape)


def pair_seconds(size: str, batch: int, case: str, shape: str, rounds: int, sides: int) -> float:
    """A pair's expected seconds in the workers: each of ``sides`` built and warmed up, then ``rounds`` turns of
    each."""
    step = step_seconds(size, batch, case, shape)
    warmup = WARMUP_STEPS["cpu" if size == "3m" else "cuda"]
    decoding = GRPO_COMPILE_S if bench.CASES[case][0] == "grpo" and size != "3m" else 0.0
    return (decoding + sides * (BUILD_S[size] + warmup * step)
            + rounds * sides * (steps_for(size, batch, case, shape) * step + TURN_S))


def profile_seconds(size: str, batch: int, case: str, shape: str) -> float:
    """The profiled steps of both sides, the profiler's start and the trace written."""
    return 2 * (bench.PROFILED_STEPS * step_seconds(size, batch, case, shape) + 5.0)


def plan_seconds(plan: list[tuple], rounds: int, sides: int = 3, profiled: tuple | None = None) -> float:
    """The whole plan's expected seconds (what the budget is compared with): the preflight (the workers start
    meanwhile), the first compiles, TRL's imports, a change of size between pairs, the pairs, the profile of
    ``profiled``."""
    profile = profile_seconds(*profiled) if profiled in plan else 0.0
    switches = sum(a[0] != b[0] for a, b in zip(plan, plan[1:]))
    return (max(WORKERS_START_S, PREFLIGHT_S) + FIRST_COMPILE_S + TRL_IMPORT_S + OVERHEAD_S + profile
            + switches * SIZE_SWITCH_S + sum(pair_seconds(*entry, rounds, sides) for entry in plan))


def calibrated(estimate_s: float, measured: list[tuple[float, float]]) -> float:
    """``estimate_s`` corrected by the pairs so far (``(estimated, measured)`` seconds): times their total measured
    over their total estimated, kept within [0.5, 3]."""
    if not measured:
        return estimate_s
    ratio = sum(m for _, m in measured) / max(sum(e for e, _ in measured), 1e-9)
    return estimate_s * min(3.0, max(0.5, ratio))


# ---- checks before a minute of a GPU is spent ----------------------------------------------------------------------
def check_plan(plan: list[tuple]) -> None:
    """Every entry names a size, a case and a shape of ``benchmarks/bench.py``, has its step counts and estimate, and
    its overrides build (GRPO's batch a multiple of its group)."""
    for entry in plan:
        size, batch, case, shape = entry
        algo = bench.CASES.get(case, ("?",))[0]
        if (size not in bench.SIZES or case not in bench.CASES or shape not in bench.SHAPES
                or (size, algo) not in TOKENS_PER_S or size not in STARTUP_S or size not in BUILD_S):
            raise ValueError(f"plan entry {entry}: unknown size, case or shape, or no step count or estimate")
        bench._our_command(case, ROOT, ROOT, ROOT, batch, steps_for(size, batch, case, shape), 1, ROOT, [], "cuda",
                           shape)


def check_levers(levers: list, plan: list) -> None:
    """Every lever's case is one the plan has (the same sizes, data and step counts as its speed row)."""
    for size, batch, case, shape, name, _ in levers:
        if (size, batch, case, shape) not in plan:
            raise ValueError(f"lever {name!r}: {(size, batch, case, shape)} is not in the plan")


def parse_pairs(text: str, plan: list[tuple]) -> list[tuple]:
    """``--pairs``' value: plan entries as ``size/batch/case[/shape]``, comma-separated (shape: the first the plan
    has), in the plan's order; an entry the plan lacks is refused, naming the plan's."""
    chosen = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fields = item.split("/")
        match = [e for e in plan if len(fields) in (3, 4) and (e[0], str(e[1]), e[2]) == tuple(fields[:3])
                 and (len(fields) == 3 or e[3] == fields[3])]
        if not match:
            names = ", ".join("/".join(str(x) for x in e) for e in plan)
            raise ValueError(f"--pairs: {item!r} is not in this part's plan. Fix: one of {names}")
        chosen.append(match[0])
    return [e for e in plan if e in chosen]


# goal name -> (the case it reads, the test); rows of the summary table. Real lengths where the goal says so.
GOALS = [
    ("DPO bf16 ≥ 1.3× TRL's samples/s (real lengths)", ("dpo_bf16", "real"), lambda r: r["ratio"] >= 1.3),
    ("SFT bf16 ≥ 1.3× (real lengths)", ("sft_bf16", "real"), lambda r: r["ratio"] >= 1.3),
    ("GRPO (static-cache decoding), 128 new tokens, 8 completions a prompt ≥ 1.5×", ("grpo_bf16", "real"),
     lambda r: r["ratio"] >= 1.5),
    ("ahead of TRL with its best options (Liger-Kernel)", ("*", "real"),
     lambda r: r.get("ratio_best") is None or r["ratio_best"] > 1.0),
    ("DPO as shipped ≥ 2× TRL's as shipped", ("dpo_shipped", "*"), lambda r: r["ratio"] >= 2.0),
    ("peak GPU memory ≤ TRL's", ("*", "*"), lambda r: r["ours"]["peak_mem_mb"] <= r["trl"]["peak_mem_mb"]),
]
