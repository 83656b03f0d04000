"""The GPU check: everything that needs a GPU, in one process tree that fits one device call, written as a dated
page (``docs/gpu/<date>-<device>.md``) and a summary table of the goals on stdout.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (installs the carried wheels first)
    python benchmarks/gpu_check.py --device cuda --out /tmp/gpu-check [--budget-s 420]
    python benchmarks/gpu_check.py --device cpu --out /tmp/rehearsal   # the rehearsal: tiny sizes, the same code
    bash benchmarks/gpu_check.sh --skip layouts,kernels   # a later call: the budget goes to what an earlier one missed

Sections, in order (each result is written to ``<out>/gpu_check.json`` as soon as it exists, so a run stopped at
its limit still leaves what it measured):

1. **Correctness** (float32, one batch): the first-step DPO, SFT and GRPO losses of ours and TRL's on the same batch
   (``benchmarks/bench.py``'s checks: a reference that differs from the policy; GRPO at temperature 0.7 with a KL term),
   |Δ| < 1e-4; the tiled output layer (``algo.fused_output_layer=true``) and the shared-prompt layout
   (``algo.shared_prompt=true``; on a GPU also under flex attention's block mask) and padding-free pairs
   (``algo.padding_free=true``) against two plain sequences a pair: DPO's loss and every parameter's gradient;
   a resume: a DPO run as shipped writes checkpoints at steps N and 2N, a second run resumes from the first's
   step-N checkpoint (the state a run killed after it leaves on disk) into a folder of its own, and both final
   models are compared (bit for bit, else the largest difference is reported).
2. **Checkpoint cost**: that first run's checkpoint seconds as a share of training at the default interval
   (``train.save_every_minutes``), and against its step seconds at one checkpoint every 100 steps, batch 8.
3. **The output layer's kernels** (:func:`output_layer_kernels`): SFT's loss from the last hidden states, the
   logits whole, our tiles, and Liger-Kernel's fused linear cross entropy where it is installed.
4. **Speed and memory** against TRL at equal settings (``benchmarks/bench.py``'s cases: bf16 autocast, live reference,
   no gradient checkpointing, the same batch, lengths and AdamW; GRPO with HF generate on both sides, 8 completions
   a prompt), in the order of :data:`PLAN`, each pair started only while the budget (``--budget-s``) leaves room for
   it: samples/s of both, the ratio, peak GPU memory (torch's allocator) of both, MFU.
5. **Levers** (:data:`LEVERS`): our side of a case again with one option changed (the shared prompt, the fused output
   layer, padding-free batches with sdpa or flex attention, generation with a static cache), speed and peak memory
   against the defaults.
6. **Memory at the peak** (:func:`memory_records`, a GPU only): both sides of the case where ours was above TRL's,
   the allocator's history over a profiled step, and what was live at the peak by the line that allocated it.

Then the goals (:data:`GOALS`) are judged from what was measured ("not measured" where a case did not run).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LOSS_TOLERANCE = 1e-4  # |Δ| of a first-step loss, ours against TRL's (and a layout's against the plain one)
GRADIENT_TOLERANCE = 1e-3  # the largest gradient difference over the largest gradient
CHECKPOINT_STEPS = 100  # a step interval reported beside the default (a time interval)
GRACE_S = 90  # seconds past --budget-s after which a run still going is stopped (the device call's limit is 600)


SECTIONS = ("losses", "layouts", "resume", "kernels", "speed", "levers", "memory")


def skipped_sections(text: str) -> frozenset[str]:
    """``--skip``'s value: section names, comma-separated, each one of :data:`SECTIONS`."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; the sections are "
                                         f"{', '.join(SECTIONS)}")
    return names


def default_save_minutes() -> float:
    """``train.save_every_minutes``' default, read from ``conf/config.yaml``."""
    import yaml

    return float(yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["train"]["save_every_minutes"])

# (size, batch, case) in the order they run: what the goals need first, the rest while the budget lasts.
PLAN = [("100m", 64, "dpo_bf16"), ("100m", 64, "sft_bf16"), ("100m", 64, "grpo_bf16"), ("1b", 64, "dpo_bf16"),
        ("100m", 8, "dpo_shipped"), ("100m", 8, "dpo_bf16"), ("100m", 8, "sft_bf16"), ("1b", 64, "sft_bf16"),
        ("100m", 8, "grpo_bf16"), ("100m", 64, "dpo_shipped"), ("1b", 8, "dpo_bf16"), ("1b", 8, "sft_bf16"),
        ("1b", 64, "grpo_bf16"), ("1b", 8, "dpo_shipped")]
# The rehearsal on a CPU: a GRPO pair at the smallest size, in float32 (bf16 is emulated on a CPU without
# bf16 units, ~15x slower: the bf16 twins differ by one override, checked by check_plan). DPO's and SFT's runners:
# tests/test_bench.py.
TINY_PLAN = [("3m", 8, "grpo_fp32")]
# Levers, our side only, each against the same case's run in the speed section (which runs first): (size, batch, case,
# name, overrides). What an option's default should be on a GPU is read off these.
LEVERS = [("100m", 64, "dpo_bf16", "two sequences a pair", ["algo.shared_prompt=false"]),
          ("100m", 64, "dpo_bf16", "plain output layer", ["algo.fused_output_layer=false"]),
          ("100m", 64, "dpo_bf16", "shared prompt under flex attention", ["model.attn_implementation=flex_attention"]),
          ("100m", 64, "sft_bf16", "padding-free (sdpa)", ["algo.padding_free=true"]),
          ("100m", 64, "sft_bf16", "padding-free (flex attention)",
           ["algo.padding_free=true", "model.attn_implementation=flex_attention"]),
          ("100m", 64, "grpo_bf16", "static cache (compiled decoding)", ["algo.cache_implementation=static"]),
          ("100m", 64, "dpo_bf16", "padding-free pairs (sdpa)", ["algo.padding_free=true"]),
          ("100m", 64, "dpo_bf16", "padding-free pairs (flex attention)",
           ["algo.padding_free=true", "model.attn_implementation=flex_attention"]),
          ("1b", 64, "dpo_bf16", "plain output layer", ["algo.fused_output_layer=false"])]
TINY_LEVERS = [("3m", 8, "grpo_fp32", "plain output layer", ["algo.fused_output_layer=false"])]
STEPS = {"100m": 30, "1b": 15, "3m": 2}  # timed steps (as many untimed first); GRPO: GRPO_STEPS
GRPO_STEPS = {"100m": 5, "1b": 3, "3m": 1}  # a GRPO step generates 32 tokens one at a time
CORRECTNESS_SIZE = {"cuda": "100m", "cpu": "3m"}
RESUME_STEPS = {"cuda": 20, "cpu": 1}  # N: checkpoints at N and 2N

# goal name -> (what it reads, the test); rows of the summary table.
GOALS = [
    ("DPO bf16 ≥ 1.3× TRL's samples/s", "dpo_bf16", lambda r: r["ratio"] >= 1.3),
    ("SFT bf16 ≥ 1.3×", "sft_bf16", lambda r: r["ratio"] >= 1.3),
    ("GRPO (HF generate), 8 completions a prompt ≥ 1.5×", "grpo_bf16", lambda r: r["ratio"] >= 1.5),
    ("DPO as shipped ≥ 2× TRL's as shipped", "dpo_shipped", lambda r: r["ratio"] >= 2.0),
    ("peak GPU memory ≤ TRL's", "*", lambda r: r["ours"]["peak_mem_mb"] <= r["trl"]["peak_mem_mb"]),
]


def check_plan(plan: list[tuple[str, int, str]]) -> None:
    """Every entry names a size and a case of ``benchmarks/bench.py``, has its step counts, and its overrides build
    (GRPO's batch a multiple of its group): what the rehearsal does not run is checked here, before any minute
    of a GPU is spent."""
    for size, batch, case in plan:
        if size not in bench.SIZES or case not in bench.CASES or size not in STEPS or size not in GRPO_STEPS:
            raise ValueError(f"plan entry {(size, batch, case)}: unknown size or case, or no step count")
        bench._our_command(case, ROOT, ROOT, ROOT, batch, STEPS[size], 1, ROOT, [], "cuda")


def last_line(error: BaseException) -> str:
    """An error's last line, for a table cell (its type where it has no message)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1][:200]}" if lines else type(error).__name__


def check_levers(levers: list, plan: list) -> None:
    """Every lever's case is one the plan runs (its baseline)."""
    for size, batch, case, name, _ in levers:
        if (size, batch, case) not in plan:
            raise ValueError(f"lever {name!r}: {(size, batch, case)} is not in the plan, so it has no baseline")


class Report:
    """What the check found, kept in ``<out>/gpu_check.json`` after every addition."""

    def __init__(self, out: Path, header: dict) -> None:
        self.out, self.data = out, {"header": header, "correctness": [], "checkpoint": None, "speed": [],
                                    "levers": [], "kernels": [], "skipped": []}
        self.save()

    def add(self, section: str, item) -> None:
        if isinstance(self.data[section], list):
            self.data[section].append(item)
        else:
            self.data[section] = item
        self.save()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1))


# ---- correctness --------------------------------------------------------------------------------------------------
def dpo_gradients(model, reference, tokenizer, rows, device: str, attention: str | None = None,
                  **options) -> tuple[float, dict]:
    """DPO's loss and every parameter's gradient on ``rows`` with ``options`` (``shared_prompt``,
    ``fused_output_layer``), in float32; the reference is ``reference``'s weights in the policy's form (a tapped
    output layer where the policy's is)."""
    import torch

    from rlhf.algos.dpo import DPO
    from rlhf.models.reference import FrozenCopy

    policy = copy.deepcopy(model).train()
    if attention is not None:
        policy.set_attn_implementation(attention)
    algo = DPO(beta=bench.BETA, reference=FrozenCopy(), **options)
    algo.setup(policy, tokenizer)
    frozen = copy.deepcopy(policy).eval()
    frozen.load_state_dict(reference.state_dict())
    algo.frozen = {"reference": frozen}
    batch = algo.collate([algo.tokenize(r, tokenizer) for r in rows])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    loss = algo.loss(policy, batch)[0]
    loss.backward()
    return float(loss), {name: p.grad.detach().float().clone() for name, p in policy.named_parameters()}


def layouts(model_dir: Path, device: str) -> list[dict]:
    """The tiled output layer and the shared-prompt layout against two plain sequences a pair (fused off)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = bench.perturbed(model)
    rows = bench.make_rows("dpo", "short", 8, seed=3)
    plain_loss, plain = dpo_gradients(model, reference, tokenizer, rows, device, shared_prompt=False,
                                      fused_output_layer=False)
    scale = max(float(g.abs().max()) for g in plain.values())
    out = []
    variants = [("tiled output layer", {"shared_prompt": False, "fused_output_layer": True}),
                ("shared-prompt layout", {"shared_prompt": True, "fused_output_layer": False}),
                ("padding-free pairs", {"shared_prompt": False, "fused_output_layer": False, "padding_free": True})]
    if device == "cuda":  # flex attention's backward pass runs on a GPU only
        variants.append(("shared-prompt layout under flex attention",
                         {"shared_prompt": True, "fused_output_layer": False, "attention": "flex_attention"}))
    for name, options in variants:
        check = f"{name} = two plain sequences a pair (DPO loss; gradients)"
        try:  # one variant failing (e.g. a kernel this GPU lacks) leaves the others' rows
            loss, grads = dpo_gradients(model, reference, tokenizer, rows, device, **options)
        except Exception as error:  # noqa: BLE001
            out.append({"check": check, "value": f"raised {last_line(error)}", "ok": False})
            continue
        worst = max(float((grads[k] - plain[k]).abs().max()) for k in plain) / scale
        out.append({"check": check,
                    "value": f"|Δloss| {abs(loss - plain_loss):.1e}; max |Δgrad| / max |grad| {worst:.1e}",
                    "ok": abs(loss - plain_loss) < LOSS_TOLERANCE and worst < GRADIENT_TOLERANCE})
    return out


def train(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=bench._env(_threads()))
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stderr[-3000:]}")


def resume_and_checkpoints(model_dir: Path, work: Path, device: str, steps: int, batch: int = 8) -> tuple[dict, dict]:
    """The resume check and the checkpoint cost, from two runs of DPO as shipped (``hardware=gpu``'s bf16, or the
    CPU's float32): see the module's docstring."""
    import torch
    from safetensors.torch import load_file

    data = work / "resume.jsonl"
    bench.write_jsonl(bench.make_rows("dpo", "short", 8 * batch * steps), data)
    whole, resumed = work / "resume-whole", work / "resume-resumed"
    base = bench._our_command("dpo_shipped", model_dir, data, whole, batch, steps, _threads(), work / "cache",
                              [f"train.save_every_steps={steps}", "train.save_final=true", "train.keep_last=null"],
                              device)
    train(base, "the uninterrupted run")
    checkpoint = whole / "checkpoints" / f"step_{steps:08d}"
    again = [a for a in base if not a.startswith("hydra.run.dir=")] + [f"resume={checkpoint}",
                                                                       f"hydra.run.dir={resumed}"]
    train(again, "the resumed run")
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (whole, resumed))
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    same = all(torch.equal(a[k], b[k]) for k in a)
    resume = {"check": f"resume from step {steps} of {2 * steps} = the uninterrupted run (final weights)",
              "value": "bit-identical" if same else f"max |Δweight| {worst:.1e}", "ok": same or worst < 1e-3,
              "bit_identical": same, "max_abs_diff": worst}
    lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    saves = [line["perf/checkpoint_time_s"] for line in lines if "perf/checkpoint_time_s" in line]
    step_s = [line["perf/step_time_s"] for line in lines if "perf/step_time_s" in line][-1]
    checkpoint_s = sum(saves) / len(saves)
    minutes = default_save_minutes()
    cost = {"checkpoint_s": checkpoint_s, "step_s": step_s, "batch": batch, "interval_minutes": minutes,
            "share": checkpoint_s / (60.0 * minutes), "share_every_100_steps": checkpoint_s / (CHECKPOINT_STEPS * step_s)}
    return resume, cost


# ---- speed --------------------------------------------------------------------------------------------------------
def speed_pair(size: str, batch: int, case: str, model_dir: Path, params: int, work: Path, device: str,
               peaks: dict, steps: int, rounds: int = 1) -> dict:
    """Ours and TRL's on one case (``benchmarks/bench.py``'s runners), with MFU as the benchmark computes it.

    ``rounds`` > 1 runs the two sides alternately that many times (ours, TRL, ours, TRL, ...), each run a process of
    its own: the row is each side's median run (its samples/s, memory and MFU) and the ratio of the medians, with
    every round's ratio beside it. One pair measured once per call moved by up to 50% between calls on an H200
    (docs/gpu/2026-11-27-nvidia-h200-second-run.md); the rounds show that spread within one call."""
    algo = bench.CASES[case][0]
    rows = bench.make_rows(algo, "short", max(64 if device == "cpu" else 512, 4 * batch))
    data = work / f"{algo}-short.jsonl"
    bench.write_jsonl(rows, data)
    sides: dict[str, list[dict]] = {"ours": [], "trl": []}
    for k in range(rounds):
        case_dir = work / f"{size}-{batch}" / f"round{k}"
        case_dir.mkdir(parents=True, exist_ok=True)
        sides["ours"].append(bench.run_ours(case, model_dir, data, case_dir, batch, steps, _threads(), [], device))
        sides["trl"].append(bench.run_trl(case, model_dir, data, case_dir, batch, steps, _threads(), device))
    per_sample = bench.tokens_per_sample(algo, rows)
    live = algo == "dpo"  # a live reference runs forward each step (no case here precomputes it)
    flops = 6.0 * params + (2.0 * params if live else 0.0)
    for side in sides["ours"] + sides["trl"]:
        side["tokens_per_s"] = side["samples_per_s"] * per_sample
        computed = side.get("computed_tokens_per_s", side["tokens_per_s"])
        side["mfu"] = flops * computed / peaks.get("bfloat16", peaks["float32"])
    ours, theirs = median_run(sides["ours"]), median_run(sides["trl"])
    return {"size": size, "batch": batch, "case": case, "params": params, "steps": steps, "ours": ours,
            "trl": theirs, "ratio": ours["samples_per_s"] / theirs["samples_per_s"], "rounds": rounds,
            "round_ratios": [o["samples_per_s"] / t["samples_per_s"] for o, t in zip(sides["ours"], sides["trl"])],
            "samples_per_s": {name: [s["samples_per_s"] for s in runs] for name, runs in sides.items()}}


def median_run(runs: list[dict]) -> dict:
    """The run whose samples/s is the median of ``runs`` (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda run: run["samples_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def ratio_cell(row: dict) -> str:
    """``**1.05×**``, and with several rounds the range of the rounds' ratios: ``**1.05×** (0.91–1.12, 3 rounds)``."""
    cell = f"**{row['ratio']:.2f}×**"
    ratios = row.get("round_ratios", [])
    if len(ratios) > 1:
        cell += f" ({min(ratios):.2f}–{max(ratios):.2f}, {len(ratios)} rounds)"
    return cell


def lever_run(size: str, batch: int, case: str, name: str, overrides: list[str], model_dir: Path, work: Path,
              device: str, steps: int, baseline: dict) -> dict:
    """Our side of ``case`` with ``overrides``, against ``baseline`` (the speed section's row of the same case)."""
    algo = bench.CASES[case][0]
    data = work / f"{algo}-short.jsonl"  # written by the speed section's run of the case
    run_dir = work / f"lever-{size}-{batch}-{case}-{len(list(work.glob('lever-*')))}"
    ours = bench.run_ours_into(run_dir, case, model_dir, data, work / "cache", batch, steps, _threads(), overrides,
                               device)
    base = baseline["ours"]
    return {"size": size, "batch": batch, "case": case, "lever": name, "overrides": overrides, "ours": ours,
            "speed": ours["samples_per_s"] / base["samples_per_s"],
            "memory": ours["peak_mem_mb"] / base["peak_mem_mb"]}


# ---- the output layer's kernels ------------------------------------------------------------------------------------
# (label, rows = sequences x positions, hidden, vocabulary): the SFT batches of the speed section (64 rows of up to
# 65 tokens) at 100m's and ~1B's widths; the rehearsal's at 3m.
KERNEL_SHAPES = {"cuda": [("100m, 64 rows", 64 * 65, 768, 32000), ("1b, 64 rows", 64 * 65, 2048, 32000)],
                 "cpu": [("3m, 8 rows", 8 * 65, 256, 4096)]}


def output_layer_kernels(device: str, repeats: int = 5) -> list[dict]:
    """SFT's loss from the last hidden states (every position scored, bf16 autocast on a GPU), forward and
    backward, three ways: the logits whole then our one-pass log-softmax (``algo.fused_output_layer=false``), our
    tiles (``rlhf.ops.token_logps.linear_log_softmax``: ``true``), and Liger-Kernel's fused linear cross entropy
    (what TRL's ``use_liger_kernel`` uses; where ``liger-kernel`` is installed): milliseconds (best of ``repeats``),
    peak memory above the inputs (a GPU's), and the loss's distance from the whole logits' in float32 without
    autocast."""
    import torch

    from rlhf.ops.token_logps import linear_log_softmax, selective_log_softmax

    def whole(hidden, weight, labels):
        return -selective_log_softmax(torch.nn.functional.linear(hidden, weight), labels).mean()

    def tiles(hidden, weight, labels):
        return -linear_log_softmax(hidden, weight, None, labels)[0].mean()

    ways = {"logits whole": whole, "our tiles": tiles}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        ways["Liger"] = lambda hidden, weight, labels: liger_fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), reduction="mean")
    except ImportError:
        liger_fused_linear_cross_entropy = None
    cuda = device == "cuda"
    rows_out = []
    for label, rows, hidden_size, vocab in KERNEL_SHAPES[device]:
        torch.manual_seed(0)
        hidden0 = torch.randn(1, rows, hidden_size, device=device)
        weight0 = torch.randn(vocab, hidden_size, device=device) * hidden_size ** -0.5
        labels = torch.randint(vocab, (1, rows), device=device)
        with torch.no_grad():
            reference = float(whole(hidden0.double(), weight0.double(), labels))
        for name, way in ways.items():
            best, peak, value = float("inf"), 0.0, float("nan")
            try:
                for _ in range(repeats):
                    hidden = hidden0.clone().requires_grad_()
                    weight = weight0.clone().requires_grad_()
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                        loss = way(hidden, weight, labels)
                    loss.backward()
                    if cuda:
                        torch.cuda.synchronize()
                        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                    best = min(best, time.perf_counter() - start)
                    value = float(loss.detach())
                rows_out.append({"shape": label, "way": name, "ms": 1e3 * best, "peak_mb": peak,
                                 "loss_error": abs(value - reference)})
            except Exception as error:  # noqa: BLE001  (a kernel that fails on this GPU is a finding)
                rows_out.append({"shape": label, "way": name, "failed": f"{type(error).__name__}: {error}"[:200]})
    if liger_fused_linear_cross_entropy is None:
        rows_out.append({"shape": "-", "way": "Liger", "failed": "liger-kernel is not installed (benchmarks/device_wheels.sh "
                                                               "carries it to the GPU machine)"})
    return rows_out


# ---- memory: what is live at the peak ---------------------------------------------------------------------------------
MEMORY_CASE = ("100m", 64, "dpo_bf16")  # where ours was above TRL's (docs/gpu/bench-h200-b64.md: +1.3 GB)


def memory_records(model_dir: Path, work: Path, device: str, steps: int) -> dict[str, str]:
    """Both sides of :data:`MEMORY_CASE` again with the CUDA allocator's history recorded over a profiled step
    (``train.profile_memory``; TRL's side through the same profiler): each side's ``memory.txt`` (the peak, and
    what was live then by the line that allocated it)."""
    size, batch, case = MEMORY_CASE
    data = work / f"{bench.CASES[case][0]}-short.jsonl"
    ours_dir, trl_dir = work / "memory-ours", work / "memory-trl"
    bench.run_ours_into(ours_dir, case, model_dir, data, work / "cache", batch, steps, _threads(),
                        ["train.profile_steps=1", "train.profile_memory=true"], device)
    bench.run_trl(case, model_dir, data, work, batch, steps, _threads(), device, profile_to=trl_dir,
                  profile_memory=True)
    return {side: (folder / "memory.txt").read_text() for side, folder in (("rlhf", ours_dir), ("TRL", trl_dir))}


# ---- the page -----------------------------------------------------------------------------------------------------
def goals(data: dict) -> list[tuple[str, str, str]]:
    """``(goal, measured, verdict)`` rows: each goal over every speed row it reads."""
    out = []
    for name, case, test in GOALS:
        rows = [r for r in data["speed"] if case == "*" or r["case"] == case]
        if not rows:
            out.append((name, "not measured", "not measured"))
            continue
        if case == "*":
            shown = "; ".join(f"{r['size']} b{r['batch']} {r['case']} {r['ours']['peak_mem_mb']:.0f} vs "
                              f"{r['trl']['peak_mem_mb']:.0f} MB" for r in rows)
        else:
            shown = "; ".join(f"{r['size']} b{r['batch']} {ratio_cell(r).replace('**', '')}" for r in rows)
        out.append((name, shown, "met" if all(test(r) for r in rows) else "NOT met"))
    mfu = [r for r in data["speed"] if r["case"] == "dpo_bf16" and r["size"] == "1b" and r["batch"] == 64]
    out.append(("bf16 MFU, DPO at ~1B, batch 64 ≥ 40%", f"{mfu[0]['ours']['mfu']:.1%}" if mfu else "not measured",
                ("met" if mfu[0]["ours"]["mfu"] >= 0.4 else "NOT met") if mfu else "not measured"))
    cost = data["checkpoint"]
    out.append(("a checkpoint at the default interval, batch 8 ≤ 2% of training",
                f"{cost['share']:.2%}" if cost else "not measured",
                ("met" if cost["share"] <= 0.02 else "NOT met") if cost else "not measured"))
    return out


def page(data: dict) -> str:
    h = data["header"]
    lines = [f"# GPU check, {h['date']}: {h['machine']}", "",
             f"Measured {h['date']} on {h['machine']}; {h['versions']}. Command: `{h['command']}` "
             f"({h['elapsed_s']:.0f} s of a {h['budget_s']} s budget). Peak matrix-product rates measured in the run: "
             + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in data["peaks"].items()) + ".", "",
             "## Goals", "", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in goals(data)]
    lines += ["", "## Correctness", "", "| check | measured | within tolerance |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['value']} | {'yes' if c['ok'] else '**NO**'} |" for c in data["correctness"]]
    lines += ["", "## Speed and memory against TRL (equal settings)", "",
              "| size | batch | case | steps timed | rlhf samples/s | TRL samples/s | rlhf / TRL | MFU rlhf | MFU TRL | "
              "peak MB rlhf | peak MB TRL |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["speed"]:
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['batch']} | {r['case']} | {r['steps']} | "
                     f"{r['ours']['samples_per_s']:.1f} | {r['trl']['samples_per_s']:.1f} | {ratio_cell(r)} | "
                     f"{r['ours']['mfu']:.1%} | {r['trl']['mfu']:.1%} | {r['ours']['peak_mem_mb']:.0f} | "
                     f"{r['trl']['peak_mem_mb']:.0f} |")
    for s in data["skipped"]:
        lines.append(f"| {s['size']} | {s['batch']} | {s['case']}{' ' + s['lever'] if 'lever' in s else ''} | "
                     f"not run: {s['why']} | | | | | | | |")
    if data["levers"]:
        lines += ["", "## Levers (ours only, against the same case with the defaults)", "",
                  "| size | batch | case | lever | overrides | samples/s | × defaults' speed | peak MB | "
                  "× defaults' memory |", "|---|---:|---|---|---|---:|---:|---:|---:|"]
        for r in data["levers"]:
            lines.append(f"| {r['size']} | {r['batch']} | {r['case']} | {r['lever']} | `{' '.join(r['overrides'])}` | "
                         f"{r['ours']['samples_per_s']:.1f} | {r['speed']:.2f} | {r['ours']['peak_mem_mb']:.0f} | "
                         f"{r['memory']:.2f} |")
    if data["kernels"]:
        lines += ["", "## The output layer's log-probabilities (SFT's loss, forward and backward)", "",
                  "| shape | way | ms | peak MB | loss error |", "|---|---|---:|---:|---:|"]
        for k in data["kernels"]:
            lines.append(f"| {k['shape']} | {k['way']} | not run: {k['failed']} | | |" if "failed" in k else
                         f"| {k['shape']} | {k['way']} | {k['ms']:.2f} | {k['peak_mb']:.0f} | {k['loss_error']:.1e} |")
    if data.get("memory"):
        lines += ["", f"## Memory at the peak ({' '.join(str(x) for x in MEMORY_CASE)}, one profiled step)", ""]
        for side, text in data["memory"].items():
            lines += [f"{side}:", "", "```", text.rstrip(), "```", ""]
    cost = data["checkpoint"]
    if cost:
        lines += ["", f"Checkpoint (DPO as shipped, batch {cost['batch']}): {cost['checkpoint_s']:.2f} s against a "
                  f"{cost['step_s']:.3f} s step: {cost['share']:.2%} of training at the default interval (one every "
                  f"{cost['interval_minutes']:g} minutes, `train.save_every_minutes`), "
                  f"{cost['share_every_100_steps']:.2%} at one every {CHECKPOINT_STEPS} steps."]
    lines += ["", "GRPO's samples are completions (8 a prompt); its MFU counts the trained tokens only (6 x parameters "
              "each), not the generation's forward passes. Each case trains twice the timed steps and times the "
              "second half; both sides in processes of their own, one after the other, on the same GPU; with "
              "several rounds the two sides alternate and each side's median run is the row (its samples/s, MFU and "
              "memory), the ratio being the medians' with the range of the rounds' ratios beside it."]
    return "\n".join(lines) + "\n"


def summary(data: dict) -> str:
    rows = goals(data) + [(c["check"], c["value"], "ok" if c["ok"] else "FAILED") for c in data["correctness"]]
    width = max(len(g) for g, _, _ in rows)
    return "\n".join(f"{g:<{width}}  {v:<13}  {m}" for g, m, v in rows)


# ---- main ---------------------------------------------------------------------------------------------------------
_THREADS = [1]


def _threads() -> int:
    return _THREADS[0]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: the check; cpu: its rehearsal at tiny sizes (every code path, no figure)")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"),
                        help="where gpu_check.json and the dated page go")
    parser.add_argument("--budget-s", type=int, default=420,
                        help="seconds the whole check may take: speed pairs start only while they fit")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: the CPUs)")
    parser.add_argument("--skip", default="", type=skipped_sections,
                        help=f"sections to leave out, comma-separated ({', '.join(SECTIONS)}): a later call spends its "
                             "budget on what an earlier one did not reach (the H200's first run spent 230 s of its 420 "
                             "on the correctness rows, so only DPO's speed pairs ran)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each side of a speed pair, alternating (default: 3 on a GPU, where one run per "
                             "side moved by up to 50%% between calls; 1 on the CPU rehearsal): the row is the medians")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.device == "cpu" else 3
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    started = time.perf_counter()
    try:  # what the GPU machine may lack or hold in another version: fail in seconds, naming it
        import importlib

        import rlhf  # noqa: F401  (first: it quiets bitsandbytes' notice of a Hub kernel, which peft's import prints)

        names = ["torch", "transformers", "accelerate", "peft", "datasets", "pyarrow", "huggingface_hub", "hydra",
                 "omegaconf", "trl"]
        print("versions: " + ", ".join(f"{n} {importlib.import_module(n).__version__}" for n in names), flush=True)
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
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here (the rehearsal is --device cpu)")
    _THREADS[0] = args.threads or cpus_available()
    torch.set_num_threads(_threads())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = machine_name(torch.device(device))
    header = {"date": time.strftime("%Y-%m-%d"), "machine": f"{device_name}, {platform.system()}",
              "versions": bench.versions(), "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
              "budget_s": args.budget_s, "elapsed_s": 0.0, "device": device}
    report = Report(out, header)
    report.data["peaks"] = probe(torch.device(device))
    print(f"{device_name}: {header['versions']}", flush=True)

    def elapsed() -> float:
        return time.perf_counter() - started

    def note(message: str) -> None:
        print(f"[{elapsed():4.0f} s] {message}", flush=True)

    check_plan(PLAN + TINY_PLAN)
    check_levers(LEVERS, PLAN)
    check_levers(TINY_LEVERS, TINY_PLAN)
    plan, levers, tiny = (TINY_PLAN, TINY_LEVERS, True) if device == "cpu" else (PLAN, LEVERS, False)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models: dict[str, tuple[Path, int]] = {}

        def model(size: str) -> tuple[Path, int]:
            if size not in models:
                folder = work / f"model-{size}"
                models[size] = (folder, bench.build_model(size, folder, device))
                note(f"built {size}: {models[size][1] / 1e6:.1f}M parameters")
            return models[size]

        def guarded(what: str, section):
            """Run one section; one that raises is a finding (a failed correctness row), not the end of the
            check: the device call goes on to the next section and the page is written."""
            try:
                return section()
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                report.add("correctness", {"check": what, "value": f"raised {last_line(error)}", "ok": False})
                note(f"{what} RAISED {type(error).__name__}")
                return None

        size = CORRECTNESS_SIZE[device]
        model_dir, _ = model(size)
        skip = args.skip
        if skip:
            note(f"left out (--skip): {', '.join(sorted(skip))}")
        losses = None if "losses" in skip else guarded(
            "losses against TRL", lambda: bench.check_losses(model_dir, "short", device=device))
        for algo, (ours, theirs) in (losses or {}).items():
            report.add("correctness", {"check": f"{algo.upper()} first-step loss = TRL's ({size}, float32)",
                                       "value": f"{ours:.6f} vs {theirs:.6f}, |Δ| {abs(ours - theirs):.1e}",
                                       "ok": abs(ours - theirs) < LOSS_TOLERANCE})
        note("losses against TRL checked")
        for row in ([] if "layouts" in skip else guarded("layouts", lambda: layouts(model_dir, device)) or []):
            report.add("correctness", row)
        note("layouts checked")
        resumed = None if "resume" in skip else guarded(
            "resume and checkpoint cost", lambda: resume_and_checkpoints(model_dir, work, device, RESUME_STEPS[device]))
        if resumed:
            resume, cost = resumed
            report.add("correctness", resume)
            report.add("checkpoint", cost)
            note(f"resume: {resume['value']}; a checkpoint costs {cost['share']:.2%} of training")
        for row in ([] if "kernels" in skip else guarded("output layer kernels", lambda: output_layer_kernels(device))
                    or []):
            report.add("kernels", row)
        note("output layer kernels timed")
        durations: dict[str, float] = {}  # seconds the last pair of each size took
        pair_s: dict[tuple, float] = {}  # and each pair
        for size, batch, case in ([] if "speed" in skip else plan):
            steps = (GRPO_STEPS if case.startswith("grpo") else STEPS)[size]
            # a size not timed yet: three times the slowest pair so far (its model is built first, too)
            guess = durations.get(size, 3.0 * max(durations.values(), default=0.0)) * (2.0 if size == "1b" else 1.5)
            bench.TIMEOUT_S = max(60.0, args.budget_s + GRACE_S - elapsed())  # a stuck run ends before the call
            if tiny is False and elapsed() + guess > args.budget_s:
                report.add("skipped", {"size": size, "batch": batch, "case": case, "why": "out of the time budget"})
                note(f"skipped {size} b{batch} {case}: {guess:.0f} s would pass the budget")
                continue
            began = time.perf_counter()
            try:
                model_dir, params = model(size)
                row = speed_pair(size, batch, case, model_dir, params, work, device, report.data["peaks"], steps,
                                 args.rounds)
            except Exception as error:  # noqa: BLE001  (a case that fails on this GPU is a finding)
                traceback.print_exc()
                report.add("skipped", {"size": size, "batch": batch, "case": case,
                                       "why": f"failed: {last_line(error)}"})
                note(f"{size} b{batch} {case} FAILED")
                continue
            durations[size] = pair_s[(size, batch, case)] = time.perf_counter() - began
            report.add("speed", row)
            note(f"{size} b{batch} {case}: {ratio_cell(row).replace('**', '')}; peak MB {row['ours']['peak_mem_mb']:.0f} vs "
                 f"{row['trl']['peak_mem_mb']:.0f} [{durations[size]:.0f} s]")
        for size, batch, case, name, overrides in ([] if "levers" in skip else levers):
            baseline = next((r for r in report.data["speed"] if (r["size"], r["batch"], r["case"]) ==
                             (size, batch, case)), None)
            guess = durations.get(size, 0.0) * 0.75 / args.rounds  # one run of one side of a pair
            if baseline is None or (not tiny and elapsed() + guess > args.budget_s):
                why = "its case did not run" if baseline is None else "out of the time budget"
                report.add("skipped", {"size": size, "batch": batch, "case": case, "lever": name, "why": why})
                note(f"skipped lever {name} on {size} b{batch} {case}: {why}")
                continue
            steps = (GRPO_STEPS if case.startswith("grpo") else STEPS)[size]
            bench.TIMEOUT_S = max(60.0, args.budget_s + GRACE_S - elapsed())
            try:
                row = lever_run(size, batch, case, name, overrides, models[size][0], work, device, steps, baseline)
            except Exception as error:  # noqa: BLE001  (a lever that fails here, e.g. a kernel this GPU lacks)
                report.add("skipped", {"size": size, "batch": batch, "case": case, "lever": name,
                                       "why": f"failed: {last_line(error)}"})
                note(f"lever {name} on {size} b{batch} {case} FAILED")
                continue
            report.add("levers", row)
            note(f"lever {name} on {size} b{batch} {case}: {row['speed']:.2f}x speed, {row['memory']:.2f}x memory")
        size = MEMORY_CASE[0]
        bench.TIMEOUT_S = max(60.0, args.budget_s + GRACE_S - elapsed())
        if "memory" in skip:
            pass
        elif device != "cuda":
            report.add("skipped", {"size": size, "batch": MEMORY_CASE[1], "case": MEMORY_CASE[2],
                                   "why": "the memory record needs a GPU"})
        elif MEMORY_CASE in pair_s and elapsed() + 1.5 * pair_s[MEMORY_CASE] / args.rounds <= args.budget_s:
            try:
                report.data["memory"] = memory_records(models[size][0], work, device, STEPS[size])
                report.save()
                note("memory at the peak recorded, both sides")
            except Exception as error:  # noqa: BLE001
                report.add("skipped", {"size": size, "batch": MEMORY_CASE[1], "case": MEMORY_CASE[2],
                                       "why": f"memory record failed: {last_line(error)}"})
    report.data["header"]["elapsed_s"] = elapsed()
    report.save()
    text = page(report.data)
    path = out / f"{header['date']}-{slug(device_name)}.md"
    path.write_text(text)
    print(text)
    print(summary(report.data))
    failed = [c["check"] for c in report.data["correctness"] if not c["ok"]]
    if failed:
        print(f"correctness FAILED: {failed}", file=sys.stderr)
        return 1
    print(f"written {path} and {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
