"""The GPU check's correctness rows: layouts against two plain sequences a pair, every single-GPU path of the package
run once (:func:`paths`), and a resume against the uninterrupted run. A training run of ours whose output says that
torch's compiler hit its recompile limit fails its row (:mod:`gpu_check.recompiles`)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check.recompiles import hits_in, message
from gpu_check.sections.preflight import fallbacks
from gpu_check.state import last_line, threads

ROOT = bench.ROOT
LOSS_TOLERANCE = 1e-4  # |Δ| of a first-step loss, ours against TRL's (and a layout's against the plain one)
GRADIENT_TOLERANCE = 1e-3  # the largest gradient difference over the largest gradient
CHECKPOINT_STEPS = 100  # a step interval reported beside the default (a time interval)


def default_save_minutes() -> float:
    """``train.save_every_minutes``' default, read from ``conf/config.yaml``."""
    import yaml

    return float(yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["train"]["save_every_minutes"])


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
    flex = ("shared-prompt layout under flex attention",
            {"shared_prompt": True, "fused_output_layer": False, "attention": "flex_attention"})
    if device == "cuda":  # flex attention's backward pass runs on a GPU only
        variants.append(flex)
    else:
        out.append({"check": f"{flex[0]} = two plain sequences a pair (DPO loss; gradients)", "value": "GPU only",
                    "ok": None})
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
    """Run one of our training commands; raise with its error output when it fails, or when torch's compiler hit its
    recompile limit in it."""
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=bench._env(threads()),
                            timeout=bench.timeout_s())
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stderr[-3000:]}")
    hits = hits_in(result.stdout + result.stderr)
    if hits:
        raise RuntimeError(message(what, hits))


def resume_and_checkpoints(model_dir: Path, work: Path, device: str, steps: int, batch: int = 8) -> tuple[dict, dict]:
    """The resume check and the checkpoint cost, from two runs of DPO as shipped (``hardware=gpu``'s bf16, or the
    CPU's float32): see the module's docstring."""
    import torch
    from safetensors.torch import load_file

    data = work / "resume.jsonl"
    bench.write_jsonl(bench.make_rows("dpo", "short", 8 * batch * steps), data)
    whole, resumed = work / "resume-whole", work / "resume-resumed"
    base = bench._our_command("dpo_shipped", model_dir, data, whole, batch, steps, threads(), work / "cache",
                              [*fallbacks("dpo"), f"train.save_every_steps={steps}", "train.save_final=true",
                               "train.keep_last=null"],
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


# ---- every single-GPU path, run once ---------------------------------------------------------------------------------
PATH_STEPS = 3  # optimizer steps of each path's run
PATH_TOLERANCE = 1e-4  # |Δ| / max(1, |value|) of a logged loss or log-probability, a path against the plain run
# (name, overrides, what is compared with the plain run of the same DPO: "steps" every step's loss and first step's
# log-probabilities, "first" the first step's log-probabilities (the policy before any update), None nothing: the
# path is not the same computation (online RL samples; its row says it ran and its loss is finite), algorithm).
PATHS = [
    ("hardware=fsdp, one process", ["hardware=fsdp", "hardware.num_processes=1"], "steps", "dpo"),
    ("hardware=zero3, one process", ["hardware=zero3", "hardware.num_processes=1"], "steps", "dpo"),
    ("peft=lora (the adapters start at zero)", ["peft=lora"], "first", "dpo"),
    ("GRPO, 8 completions a prompt", ["algo/reward_funcs=similarity", "algo.max_completion_length=16"], None, "grpo"),
    ("PPO, 8 completions a prompt", ["algo/reward_funcs=similarity", "algo.max_completion_length=16",
                                     "algo.num_generations=8"], None, "ppo"),
]
COMPARED = ("train/loss", "train/logps/chosen", "train/logps/rejected")


def path_command(model_dir: Path, data: Path, run_dir: Path, cache: Path, device: str, algo: str,
                 overrides: list[str], batch: int = 8) -> list[str]:
    """A few float32 steps of ``algo`` on ``hardware=gpu`` (``cpu`` on a CPU), or on the hardware ``overrides``
    name instead, with bench.py's shared settings; GRPO/PPO count ``batch`` in completions (8 a prompt)."""
    hardware = [] if any(o.startswith("hardware=") for o in overrides) else [
        "hardware=gpu" if device == "cuda" else "hardware=cpu", "hardware.mixed_precision=no"]
    online = algo in ("grpo", "ppo")
    per_device = [f"train.per_device_batch_size={batch // bench.GROUP}", f"algo.num_generations={bench.GROUP}",
                  "algo.log_completions=false"] if online else [f"train.per_device_batch_size={batch}"]
    return [sys.executable, str(ROOT / "train.py"), f"algo={algo}", *hardware, *fallbacks(algo), *overrides,
            f"hardware.threads_per_process={threads()}", f"model.name_or_path={model_dir}", f"data.path={data}",
            "data.eval_size=8", f"data.cache_dir={cache}", *per_device, f"train.max_steps={PATH_STEPS}",
            "train.log_every_steps=1", "train.eval_at_start=false", "train.eval_every_steps=0",
            "train.save_every_steps=0", "train.save_every_minutes=0", "train.save_final=false", "optimizer=adamw",
            f"optimizer.lr={bench.LR}", "optimizer.weight_decay=0.0", "scheduler=constant", f"hydra.run.dir={run_dir}"]


def logged(run_dir: Path) -> list[dict]:
    """The run's training lines of ``metrics.jsonl``, one per step."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "train/loss" in line]


def compare_logs(plain: list[dict], other: list[dict], what: str | None) -> tuple[float, bool]:
    """The largest relative difference (|Δ| / max(1, |value|)) between the two runs' :data:`COMPARED` values that
    ``what`` names (``"steps"``: every step's loss and the first step's log-probabilities; ``"first"``: the first
    step's log-probabilities), and whether it is within :data:`PATH_TOLERANCE`; ``None``: nothing compared, every
    loss finite."""
    finite = all(math.isfinite(line["train/loss"]) for line in other) and len(other) == PATH_STEPS
    if what is None:
        return 0.0, finite
    pairs = [(plain[0][k], other[0][k]) for k in COMPARED[1:]]
    if what == "steps":
        pairs += [(a["train/loss"], b["train/loss"]) for a, b in zip(plain, other)]
    worst = max(abs(a - b) / max(1.0, abs(a)) for a, b in pairs)
    return worst, finite and worst <= PATH_TOLERANCE and len(plain) == len(other)


def refusal(log: str) -> str | None:
    """The package's refusal of an option (a ``UserError``: ``error: ... Fix: ...``), or ``None``: a crash."""
    lines = [line for line in log.splitlines() if "error: " in line and "Fix:" in line]
    return lines[-1].split("error: ", 1)[1][:300] if lines else None


def paths(model_dir: Path, work: Path, device: str) -> list[dict]:
    """Each of :data:`PATHS` trained for :data:`PATH_STEPS` float32 steps on one process, against the plain run of
    the same DPO where the math is the same. A row's ``ok``: True or False, or None where the package refuses the
    option by design (its message is the row) or a dependency is missing here."""
    rows_by_algo = {"dpo": bench.make_rows("dpo", "short", 64), "grpo": bench.make_rows("grpo", "short", 64)}
    data = {algo: work / f"paths-{algo}.jsonl" for algo in rows_by_algo}
    for algo, rows in rows_by_algo.items():
        bench.write_jsonl(rows, data[algo])

    def run(name: str, algo: str, overrides: list[str]) -> tuple[list[dict] | None, str | None, bool]:
        run_dir = work / f"path-{len(list(work.glob('path-*')))}"
        command = path_command(model_dir, data["grpo" if algo in ("grpo", "ppo") else "dpo"], run_dir,
                               work / "cache", device, algo, overrides)
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=bench._env(threads()),
                                timeout=bench.timeout_s())
        hits = hits_in(result.stdout + result.stderr)
        if result.returncode == 0 and hits:
            return None, message(name, hits), False
        if result.returncode == 0:
            return logged(run_dir), None, False
        said = refusal(result.stdout + result.stderr)
        return None, said or (result.stderr.strip().splitlines() or ["(no output)"])[-1][:300], said is not None

    plain, error, _ = run("plain", "dpo", [])
    if plain is None:
        raise RuntimeError(f"the plain DPO run of the paths failed: {error}")
    out = []
    for name, overrides, what, algo in PATHS:
        check = f"{name}: {PATH_STEPS} steps" + (" = hardware=gpu's (DPO, float32)" if what else "")
        if "hardware=zero3" in overrides:
            try:
                import deepspeed  # noqa: F401  (what it imports too: pydantic, ...)
            except Exception as error:  # noqa: BLE001
                out.append({"check": check, "value": f"not run: DeepSpeed does not import here ({last_line(error)})",
                            "ok": None})
                continue
        logs, error, refused = run(name, algo, overrides)
        if logs is None:
            out.append({"check": check, "value": f"{'refused' if refused else 'failed'}: {error}",
                        "ok": None if refused else False})
            continue
        worst, ok = compare_logs(plain, logs, what)
        losses = ", ".join(f"{line['train/loss']:.4f}" for line in logs)
        value = (f"max |Δ| / max(1, |value|) {worst:.1e} (tolerance {PATH_TOLERANCE:g}); losses {losses}" if what
                 else f"losses {losses} (finite)")
        out.append({"check": check, "value": value, "ok": ok})
    return out
