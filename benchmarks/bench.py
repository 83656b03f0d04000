"""Speed against TRL, side by side in one run: our loop and TRL's DPOTrainer / SFTTrainer on the same model, data,
batch, lengths, precision and threads.

    pip install -e ".[bench]"            # TRL, only for this script (scripts/setup.sh installs it)
    python benchmarks/bench.py              # the README's table: docs/bench.md and docs/bench.png
    python benchmarks/bench.py --sizes 3m --shapes short --cases dpo_fp32,sft_fp32 --steps 3 --out /tmp/bench
    python benchmarks/bench.py --device cuda --sizes 100m --shapes short --out /tmp/bench-gpu   # on one GPU

For each model size (a Llama of random weights built from a config, saved once: ``SIZES``) and each data shape
(random lowercase strings for prompt and completions, each row's lengths drawn between half and all of the shape's:
``SHAPES``), every case (``CASES``) trains ``2 x --steps`` optimizer steps (by default ``STEPS[size]``; ``STEPS_GPU[size]`` on a GPU) with each
implementation, in a process of its own, and times the second half (steady state: start-up, tokenizing, the first steps' allocations and the
final evaluation are left out). Both use AdamW at a constant lr, weight decay 0, gradient clipping at 1.0, the
byte-level tokenizer of the embedded default (prompt + completion + EOS, as TRL 1.16 tokenizes plain text:
rlhf/data/encoding.py), ``--threads`` torch threads, one process, on ``--device`` (``cpu``, or ``cuda``: one GPU, our side with
``hardware=gpu``). Reported per case and implementation:

- ``samples/s``: pairs (DPO) or rows (SFT) per second; the ratio rlhf / TRL is the headline;
- ``tokens/s``: samples/s times the mean tokens of a sample in the data (prompt and completion, both sides of a
  pair), the same factor for both;
- ``MFU``: model FLOP/s (``rlhf.telemetry.mfu.flops_per_token``: 6 x parameters per trained token, plus 2 x parameters of a
  live reference) over the peak that a matrix-product probe measures in this run (float32, or bfloat16 for the bf16
  cases; ``rlhf.telemetry.mfu.probe``), for the tokens each side runs through the model: the data's for TRL, ours as its
  ``perf/tokens_per_s`` counts them (a pair's prompt once where it shares it, ``algo.shared_prompt``: fewer than the
  data's, so its MFU is not inflated by the work it skips);
- ``peak MB``: the process's peak resident memory above its size before the model was loaded (both measured the
  same way, ``rlhf.telemetry.memory_preflight.PeakMemory``).

And per size, what a checkpoint costs our DPO run: one more run writes one at steps N and 2N
(``perf/checkpoint_time_s``), reported as a share of training at one checkpoint every ``CHECKPOINT_INTERVAL`` steps.

Before timing anything it checks, per size, that both compute the same thing: the first-step DPO loss on the same
batch with a reference model that differs from the policy (the policy's weights plus seeded noise), and the SFT
loss on the same batch, in float32. The run fails (exit 1) when either differs by 1e-4 or more: a benchmark of two
different computations means nothing.

Cases (``--cases``): ``dpo_fp32`` and ``dpo_bf16`` (equal settings: live reference, no gradient checkpointing,
float32 or bf16 autocast), ``dpo_fp32_gc`` (both with gradient checkpointing), ``dpo_precomputed`` (both with
reference log-probabilities computed before training), ``dpo_shipped`` (each as it ships: our defaults, bf16
autocast where the CPU or GPU has bf16 matrix units, else float32 (``hardware.mixed_precision: auto``), against
TRL's, which are bf16 autocast and gradient checkpointing), ``dpo_precomputed_shipped`` (ours with the precomputed
reference against TRL as shipped), ``sft_fp32`` and ``sft_bf16``. A bf16 case on a CPU without bf16 matrix
instructions is skipped (noted in the table).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Llama architecture, random init. The vocabulary is the model's (the byte tokenizer uses ids 0-258 of it): the
# output layer costs what a real vocabulary of that size costs.
SIZES = {
    "3m": {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 688},
    "25m": {"vocab_size": 16384, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
            "intermediate_size": 1376},
    "100m": {"vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12,
             "intermediate_size": 2048},
    # ~1.1B: TinyLlama-1.1B's shape (22 layers, grouped-query attention with 4 key/value heads); for GPUs
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 4, "intermediate_size": 5632},
}
# Timed steps per size when --steps is not given: a few seconds of steady state or more on 2 CPU cores. On a GPU a
# step of these sizes takes 30-150 ms, and a 10-step window there moved by a factor of 2 between two runs (H200).
STEPS = {"3m": 32, "25m": 12, "100m": 6, "1b": 2}
STEPS_GPU = {"3m": 100, "25m": 100, "100m": 60, "1b": 30}
CHECKPOINT_INTERVAL = 100  # steps: the interval whose cost is reported (train.save_every_steps=100)
# (prompt tokens, completion tokens) at most; each row draws its lengths from [half, all] of them: uniformly, or for
# the shapes in SKEWED as chat data spreads, most rows short and a tail up to the maximum (make_rows).
SHAPES = {"short": (32, 32), "long": (128, 128), "real": (256, 384)}
SKEWED = {"real"}
# GRPO's new tokens per completion where they are not the shape's completion length: the real shape samples 128.
GRPO_NEW_TOKENS = {"real": 128}
# TRL with its own best options on one GPU (TRL 1.16's DPOConfig / SFTConfig / GRPOConfig fields): use_liger_kernel,
# Liger-Kernel's Triton kernels for RMSNorm, RoPE and SwiGLU; TRL 1.16 turns Liger's fused linear cross entropy off
# and computes the loss through its own chunked output layer (DPO, GRPO: its chunked log-probabilities; SFT: Liger's
# patched model forward). SFT's padding_free is left out: TRL 1.16 refuses it without packing unless max_length is
# None, and documents it for FlashAttention only (under sdpa it would be a handicap, not a best option); DPO's
# padding_free "warns and falls back to standard padding" (its DPOConfig docstring).
TRL_BEST = {"dpo": {"use_liger_kernel": True}, "sft": {"use_liger_kernel": True}, "grpo": {"use_liger_kernel": True}}

# case -> (algorithm, our overrides, TRL config fields). Both sides get the shared settings of _our_command and
# _trl_args on top.
EQUAL = {"gradient_checkpointing": False, "bf16": False}
CASES = {
    "dpo_fp32": ("dpo", [], EQUAL),
    "dpo_bf16": ("dpo", ["hardware.mixed_precision=bf16"], {**EQUAL, "bf16": True}),
    "dpo_fp32_gc": ("dpo", ["model.gradient_checkpointing=true"], {**EQUAL, "gradient_checkpointing": True}),
    "dpo_precomputed": ("dpo", ["algo/reference=precomputed"], {**EQUAL, "precompute_ref_log_probs": True}),
    "dpo_shipped": ("dpo", [], {}),
    "dpo_precomputed_shipped": ("dpo", ["algo/reference=precomputed"], {}),
    "sft_fp32": ("sft", [], EQUAL),
    "sft_bf16": ("sft", ["hardware.mixed_precision=bf16"], {**EQUAL, "bf16": True}),
    "grpo_fp32": ("grpo", [], EQUAL),
    "grpo_bf16": ("grpo", ["hardware.mixed_precision=bf16"], {**EQUAL, "bf16": True}),
}
BF16 = {"dpo_bf16", "sft_bf16", "grpo_bf16"}  # cases in bf16 on both sides (MFU against the bf16 peak)
SHIPPED_TRL_BF16 = {"dpo_shipped", "dpo_precomputed_shipped"}  # TRL's side runs in its default bf16
DEFAULT_CASES = list(CASES)
LR, BETA, LOSS_TOLERANCE = 1e-4, 0.1, 1e-4
# GRPO on both sides: completions per prompt (a step's batch counts completions, so --batch is a multiple of it);
# sampling at temperature 1 over the whole vocabulary, no KL (both sides' default beta 0), TRL's loss_type "grpo"
# (ours by default); the reward is rlhf.algos.reward_funcs.char_similarity on the reverse task's prompts.
GROUP = 8
DEADLINE: float | None = None  # time.perf_counter() at which a run of its own (ours or TRL's) is stopped; None: never


def timeout_s() -> float | None:
    """Seconds a run started now may take: until :data:`DEADLINE` (5 at least), or ``None`` (no limit)."""
    return None if DEADLINE is None else max(5.0, DEADLINE - time.perf_counter())
PROFILED_STEPS = 3  # --profile: steps recorded by torch.profiler on each side, from the timed window's first


# ---- data and models ----------------------------------------------------------------------------------------------
def new_tokens(shape: str) -> int:
    """Tokens a GRPO completion may have at ``shape``: :data:`GRPO_NEW_TOKENS`, else the shape's completion length."""
    return GRPO_NEW_TOKENS.get(shape, SHAPES[shape][1])


def row_length(rng: random.Random, most: int, skewed: bool) -> int:
    """A length in ``[most // 2, most]``: uniform, or ``skewed``: half the maximum plus an exponential tail of mean
    0.35 x that half, capped at the maximum (mean ~0.67 x most; ~6% of rows at the cap, as truncated chat rows are)."""
    low = max(1, most // 2)
    if not skewed:
        return rng.randint(low, most)
    return min(most, low + round(rng.expovariate(1.0 / (0.35 * low))))


def make_rows(algo: str, shape: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    """Random lowercase strings: prompt, and chosen/rejected (DPO) or completion (SFT); GRPO: the reverse task's
    prompt of a random string (``"<string>="``). Lengths: :func:`row_length`."""
    prompt_max, completion_max = SHAPES[shape]
    rng = random.Random(seed)

    def text(most: int) -> str:
        return "".join(rng.choices(string.ascii_lowercase, k=row_length(rng, most, shape in SKEWED)))

    if algo == "dpo":
        return [{"prompt": text(prompt_max), "chosen": text(completion_max), "rejected": text(completion_max)}
                for _ in range(count)]
    if algo == "grpo":
        from rlhf.data.tasks import ReverseTask

        return [{"prompt": ReverseTask.prompt(text(prompt_max - 1))} for _ in range(count)]
    return [{"prompt": text(prompt_max), "completion": text(completion_max)} for _ in range(count)]


def tokens_per_sample(algo: str, rows: list[dict[str, str]], shape: str = "short") -> float:
    """Mean tokens of a sample with the byte tokenizer (a character is a token; EOS after each completion). GRPO:
    a completion and its prompt, the completion at its most (a random model rarely samples EOS)."""
    if algo == "grpo":
        return sum(len(r["prompt"]) for r in rows) / len(rows) + new_tokens(shape)
    if algo == "dpo":
        return sum(2 * len(r["prompt"]) + len(r["chosen"]) + len(r["rejected"]) + 2 for r in rows) / len(rows)
    return sum(len(r["prompt"]) + len(r["completion"]) + 1 for r in rows) / len(rows)


def build_model(size: str, folder: Path, device: str = "cpu") -> int:
    """Save a seeded random-init Llama of ``size`` with the byte tokenizer to ``folder``; return its parameters.
    Initialized on ``device`` (a GPU initializes a 1B model in a second; its random weights differ from a CPU's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.models.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = LlamaConfig(**SIZES[size], max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- the same computation ---------------------------------------------------------------------------------------
def check_losses(model_dir: Path, shape: str, rows_count: int = 8, device: str = "cpu",
                 options: dict[str, dict] | None = None) -> dict[str, tuple[float, float]]:
    """First-step losses of both on the same batch in float32 on ``device``: DPO with a reference that differs from
    the policy, SFT, and GRPO (:func:`grpo_losses`). ``{"dpo": (rlhf, TRL), "sft": ..., "grpo": ...}``.
    ``options``: keyword arguments of our DPO and SFT by algorithm (e.g. ``{"dpo": {"fused_output_layer": False}}``)."""
    options = options or {}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from rlhf.algos.dpo import DPO
    from rlhf.algos.sft import SFT
    from rlhf.models.reference import FrozenCopy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = perturbed(model)
    model, reference = model.to(device), reference.to(device)
    on = lambda batch: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # noqa: E731
    out: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        common = {"output_dir": tmp, "per_device_eval_batch_size": rows_count, "report_to": [],
                  "use_cpu": device == "cpu", "bf16": False, "max_length": None}
        rows = make_rows("dpo", shape, rows_count, seed=1)
        algo = DPO(beta=BETA, reference=FrozenCopy(), **options.get("dpo", {}))
        algo.setup(model, tokenizer)
        algo.frozen = {"reference": reference}
        with torch.no_grad():
            ours = float(algo.loss(model, on(algo.collate([algo.tokenize(r, tokenizer) for r in rows])))[0])
        trainer = DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(reference),
                             args=DPOConfig(beta=BETA, **common), processing_class=tokenizer,
                             train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows))
        out["dpo"] = (ours, trainer.evaluate()["eval_loss"])
        rows = make_rows("sft", shape, rows_count, seed=1)
        algo = SFT(**options.get("sft", {}))
        algo.setup(model, tokenizer)
        with torch.no_grad():
            ours = float(algo.loss(model, on(algo.collate([algo.tokenize(r, tokenizer) for r in rows])))[0])
        trainer = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**common), processing_class=tokenizer,
                             train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows))
        out["sft"] = (ours, trainer.evaluate()["eval_loss"])
        out["grpo"] = grpo_losses(model, reference, tokenizer, device, tmp)
    return out


def perturbed(model, scale: float = 0.02):
    """A reference that differs from the policy: its weights plus seeded noise."""
    import torch

    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator).to(p.device))
    return reference


def grpo_losses(model, reference, tokenizer, device: str, tmp: str, prompts: int = 2, group: int = 4,
                temperature: float = 0.7, beta: float = 0.5) -> tuple[float, float]:
    """GRPO's loss on the same sampled batch, ours and TRL's ``GRPOTrainer._compute_loss``: ``prompts`` prompts of
    random tokens (the second left-padded by 3) x ``group`` completions of random lengths (EOS-ended or truncated,
    right-padded), rewards in [0, 1] turned into advantages by ours (group-standardized, TRL's ``scale_rewards=
    "group"``), at ``temperature`` 0.7 and with a k3 KL to the perturbed reference at ``beta`` 0.5 (large: at the
    first step the surrogate adds -mean(advantages) = 0, so the KL term is what the value shows; each side computes the
    reference's log-probabilities itself): a temperature or KL term left out on either side moves the loss."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.algos.grpo import GRPO
    from rlhf.algos.online import training_batch
    from rlhf.algos.policy_gradient import completion_logps
    from rlhf.algos.reward_funcs import char_similarity
    from rlhf.models.reference import FrozenCopy

    generator = torch.Generator().manual_seed(2)
    n, prompt_len, completion_len = prompts * group, 12, 10
    prompt_ids = torch.randint(0, 256, (prompts, prompt_len), generator=generator).repeat_interleave(group, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[group:, :3] = 0
    prompt_ids[group:, :3] = tokenizer.pad_token_id
    completion_ids = torch.randint(0, 256, (n, completion_len), generator=generator)
    lengths = torch.randint(3, completion_len + 2, (n,), generator=generator)  # completion_len + 1: truncated
    positions = torch.arange(completion_len)
    completion_ids[positions == (lengths - 1).unsqueeze(1)] = tokenizer.eos_token_id
    completion_mask = (positions < lengths.unsqueeze(1)).long()
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    rewards = torch.rand(n, generator=generator)
    algo = GRPO(num_generations=group, beta=beta, temperature=temperature, reference=FrozenCopy(),
                reward_funcs={"char_similarity": char_similarity})
    algo.setup(model, tokenizer)
    samples = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
               "completion_mask": completion_mask, "truncated": lengths > completion_len, "rewards": rewards}
    samples = {k: v.to(device) for k, v in samples.items()}
    advantages = algo.scale_rewards(samples["rewards"], group)
    batch = training_batch(samples)
    with torch.no_grad():
        batch["ref_logps"] = completion_logps(reference, batch, False, temperature)[0]
        batch["advantages"] = advantages
        ours = float(algo.loss(model, batch)[0])
    args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=n, num_generations=group, beta=beta,
                      temperature=temperature, loss_type="grpo", scale_rewards="group", report_to=[],
                      use_cpu=device == "cpu", bf16=False, max_completion_length=completion_len)
    trainer = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=char_similarity, args=args,
                          processing_class=tokenizer, train_dataset=Dataset.from_list([{"prompt": "a="}] * n))
    trainer.model.eval()
    input_ids = torch.cat([samples["prompt_ids"], samples["completion_ids"]], 1)
    attention = torch.cat([samples["prompt_mask"], samples["completion_mask"]], 1)
    with torch.no_grad():
        trainer.ref_model.load_state_dict(reference.state_dict())  # TRL's own reference (its output layer patched)
        ref_logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids, attention,
                                                               completion_len)[0]
        inputs = {"prompt_ids": samples["prompt_ids"], "prompt_mask": samples["prompt_mask"],
                  "completion_ids": samples["completion_ids"], "completion_mask": samples["completion_mask"],
                  "advantages": advantages, "ref_per_token_logps": ref_logps}
        theirs = float(trainer._compute_loss(trainer.model, inputs))
    return ours, theirs


# ---- one timed run per process ----------------------------------------------------------------------------------
def _hardware(case: str, device: str, threads: int) -> list[str]:
    """Our hardware overrides: ``hardware=cpu`` (as shipped, with ``hardware=auto``'s precision), or
    ``hardware=gpu`` (bf16 autocast unless the case is float32; as shipped, bf16 like ``hardware=auto`` on a GPU
    with bf16)."""
    if device == "cpu":
        shipped = ["hardware.mixed_precision=auto"] if case in SHIPPED_TRL_BF16 else []
        return ["hardware=cpu", f"hardware.threads_per_process={threads}", *shipped]
    fp32 = case not in BF16 and case not in SHIPPED_TRL_BF16
    return ["hardware=gpu", f"hardware.threads_per_process={threads}", *(["hardware.mixed_precision=no"] if fp32 else [])]


def _algo_overrides(algo: str, batch: int, shape: str) -> list[str]:
    """Per algorithm: DPO's beta; GRPO's group, completion length and reward, its batch counted in prompts."""
    if algo == "dpo":
        return [f"train.per_device_batch_size={batch}", f"algo.beta={BETA}"]
    if algo == "grpo":
        if batch % GROUP:
            raise ValueError(f"GRPO's batch counts completions: --batch {batch} is not a multiple of {GROUP}")
        return [f"train.per_device_batch_size={batch // GROUP}", f"algo.num_generations={GROUP}",
                f"algo.max_completion_length={new_tokens(shape)}", "algo/reward_funcs=similarity",
                "algo.log_completions=false"]
    return [f"train.per_device_batch_size={batch}"]


def _our_command(case: str, model_dir: Path, data: Path, run_dir: Path, batch: int, steps: int, threads: int,
                 cache: Path, extra: list[str], device: str = "cpu", shape: str = "short") -> list[str]:
    algo, overrides, _ = CASES[case]
    if device != "cpu":  # hardware=gpu is bf16 already
        overrides = [o for o in overrides if not o.startswith("hardware.mixed_precision=")]
    return [sys.executable, str(ROOT / "train.py"), f"algo={algo}", *_hardware(case, device, threads),
            f"model.name_or_path={model_dir}", f"data.path={data}", "data.eval_size=8", f"data.cache_dir={cache}",
            *_algo_overrides(algo, batch, shape), f"train.max_steps={2 * steps}", f"train.log_every_steps={steps}",
            "train.eval_at_start=false", "train.eval_every_steps=0", "train.save_every_steps=0", "train.save_every_minutes=0",
            "train.save_final=false", "train.max_grad_norm=1.0", "optimizer=adamw", f"optimizer.lr={LR}",
            "optimizer.weight_decay=0.0", "scheduler=constant", *overrides, *extra, f"hydra.run.dir={run_dir}"]


def run_ours(case: str, model_dir: Path, data: Path, work: Path, batch: int, steps: int, threads: int,
             extra: list[str], device: str = "cpu", shape: str = "short") -> dict:
    return run_ours_into(work / f"ours-{case}", case, model_dir, data, work / "cache", batch, steps, threads, extra,
                         device, shape)


def run_ours_into(run_dir: Path, case: str, model_dir: Path, data: Path, cache: Path, batch: int, steps: int,
                  threads: int, extra: list[str], device: str = "cpu", shape: str = "short") -> dict:
    """One of our runs into ``run_dir``: its steady-state samples/s and the tokens/s it ran through the model (the
    last logged window), and its peak memory."""
    command = _our_command(case, model_dir, data, run_dir, batch, steps, threads, cache, extra, device, shape)
    result = subprocess.run(command, capture_output=True, text=True, env=_env(threads), cwd=ROOT, timeout=timeout_s())
    if result.returncode != 0:
        raise RuntimeError(f"rlhf ({case} {' '.join(extra)}) failed:\n{result.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [line for line in lines if "perf/samples_per_s" in line]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": windows[-1]["perf/samples_per_s"], "computed_tokens_per_s": windows[-1]["perf/tokens_per_s"],
            "peak_mem_mb": summary["final"]["perf/peak_mem_mb"]}


def checkpoint_cost(model_dir: Path, work: Path, shape: str, batch: int, steps: int, threads: int,
                    extra: list[str], device: str = "cpu") -> dict:
    """What a checkpoint of our DPO run costs: its seconds (``perf/checkpoint_time_s``, the mean of the two written
    at steps N and 2N) against the steady state's step, as a share of training at :data:`CHECKPOINT_INTERVAL`."""
    data = work / f"checkpoint-{shape}.jsonl"
    write_jsonl(make_rows("dpo", shape, 256), data)
    run_dir = work / f"checkpoint-{model_dir.name}"
    command = _our_command("dpo_fp32", model_dir, data, run_dir, batch, steps, threads, work / "cache",
                           [*extra, f"train.save_every_steps={steps}"], device)
    result = subprocess.run(command, capture_output=True, text=True, env=_env(threads), cwd=ROOT, timeout=timeout_s())
    if result.returncode != 0:
        raise RuntimeError(f"rlhf (checkpoints) failed:\n{result.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [line["perf/checkpoint_time_s"] for line in lines if "perf/checkpoint_time_s" in line]
    step_s = [line["perf/step_time_s"] for line in lines if "perf/step_time_s" in line][-1]
    checkpoint_s = sum(saves) / len(saves)
    return {"checkpoint_s": checkpoint_s, "step_s": step_s, "share": checkpoint_s / (CHECKPOINT_INTERVAL * step_s)}


def run_trl(case: str, model_dir: Path, data: Path, work: Path, batch: int, steps: int, threads: int,
            device: str = "cpu", profile_to: Path | None = None, shape: str = "short",
            profile_memory: bool = False, fields: dict | None = None) -> dict:
    """One TRL run in a process of its own (:func:`trl_worker`); ``fields``: TRL config fields over the case's
    (e.g. :data:`TRL_BEST`'s)."""
    spec = {"case": case, "model_dir": str(model_dir), "data": str(data), "batch": batch, "steps": steps,
            "threads": threads, "out": str(work / f"trl-{case}"), "device": device, "shape": shape,
            "profile_memory": profile_memory, "fields": fields or {},
            "profile_to": str(profile_to) if profile_to else None}
    result = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(spec)], capture_output=True,
                            timeout=timeout_s(),
                            text=True, env=_env(threads), cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"TRL ({case}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def trl_trainer(spec: dict, max_steps: int, device):
    """TRL's trainer of ``spec``'s case (``model_dir``, ``data``, ``batch``, ``out``, ``shape``, and ``fields``: TRL
    config fields over the case's) for ``max_steps`` steps, logging every ``spec["steps"]``: the shared settings
    of :func:`_our_command` in TRL's names."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    algo, _, fields = CASES[spec["case"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    rows = load_dataset("json", data_files=spec["data"], split="train")
    common = {"output_dir": spec["out"], "per_device_train_batch_size": spec["batch"], "learning_rate": LR,
              "max_steps": max_steps, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
              "max_grad_norm": 1.0, "report_to": [], "use_cpu": device.type == "cpu", "logging_steps": spec["steps"],
              "save_strategy": "no", "eval_strategy": "no", "disable_tqdm": True, "seed": 0, **fields,
              **spec.get("fields", {})}
    if algo == "dpo":
        return DPOTrainer(model=model, args=DPOConfig(beta=BETA, **common), processing_class=tokenizer,
                          train_dataset=rows)
    if algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        from rlhf.algos.reward_funcs import char_similarity

        args = GRPOConfig(num_generations=GROUP, max_completion_length=new_tokens(spec.get("shape", "short")),
                          temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="grpo", scale_rewards="group",
                          log_completions=False, disable_dropout=True, **common)
        return GRPOTrainer(model=model, reward_funcs=char_similarity, args=args, processing_class=tokenizer,
                           train_dataset=rows)
    return SFTTrainer(model=model, args=SFTConfig(**common), processing_class=tokenizer, train_dataset=rows)


def trl_worker(spec: dict) -> None:
    """In its own process: train TRL's trainer for ``2 x steps`` steps and print the second half's samples/s and
    the peak memory as one JSON line."""
    import torch

    torch.set_num_threads(spec["threads"])
    from rlhf.telemetry.memory_preflight import PeakMemory

    device = torch.device(spec.get("device", "cpu"))
    peak = PeakMemory(device)  # before the model: the figure our loop reports
    from transformers import TrainerCallback

    from rlhf.telemetry.profiling import StepProfiler

    # --profile: the same steps as ours (after the first window of `steps`), the same files (rlhf.telemetry.profiling)
    profiler = StepProfiler(PROFILED_STEPS if spec.get("profile_to") else 0, spec["steps"] + 1,
                            Path(spec["profile_to"] or "."), device, writes=True,
                            memory=bool(spec.get("profile_memory")))

    class Clock(TrainerCallback):
        times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            profiler.before(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda" and state.global_step in (steps, 2 * steps):
                torch.cuda.synchronize()  # the window's two ends wait for the GPU (ours: its logged windows do)
            self.times.append(time.perf_counter())
            profiler.after(state.global_step, 2 * steps)  # a short run ends the recording early

    steps = spec["steps"]
    trainer = trl_trainer(spec, 2 * steps, device)
    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    seconds = clock.times[2 * steps - 1] - clock.times[steps - 1]
    print(json.dumps({"samples_per_s": spec["batch"] * steps / seconds, "peak_mem_mb": peak.mb()}))


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}


# ---- the table and the chart ------------------------------------------------------------------------------------
def machine(device: str = "cpu") -> str:
    import torch

    from rlhf.telemetry.mfu import machine_name

    return f"{machine_name(torch.device(device))}, {platform.system()}"


def versions() -> str:
    import accelerate
    import torch
    import transformers
    import trl

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
            f"TRL {trl.__version__}")


def markdown(results: list[dict], losses: dict, checkpoints: dict, header: dict) -> str:
    lines = [f"Measured {header['date']} on {header['machine']}, {header['threads']} torch thread(s), one process; "
             f"{header['versions']}. `python benchmarks/bench.py {header['args']}`: per size, N steps timed after N untimed "
             f"({', '.join(f'{k} N={v}' for k, v in header['steps'].items())}), {header['batch']} samples per step; "
             "rlhf with its defaults"
             + (f" and {', '.join(f'`{o}`' for o in header['ours'])}" if header["ours"] else "") + ".", "",
             "Same computation first (float32, same batch; DPO with a reference that differs from the policy; GRPO "
             "at temperature 0.7 with a KL term to it):", "",
             "| size | loss | rlhf | TRL | abs diff |", "|---|---|---:|---:|---:|"]
    for size, pairs in losses.items():
        for algo, (a, b) in pairs.items():
            lines.append(f"| {size} | {algo.upper()} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")
    lines += ["", "| size | shape | case | rlhf samples/s | TRL samples/s | rlhf / TRL | rlhf tokens/s | "
              "MFU rlhf | MFU TRL | peak MB rlhf | peak MB TRL |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['size']} | {r['shape']} | {r['case']} | {r['skipped']} | | | | | | | |")
            continue
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['shape']} | {r['case']} | "
                     f"{r['ours']['samples_per_s']:.1f} | {r['trl']['samples_per_s']:.1f} | **{r['ratio']:.2f}x** | "
                     f"{r['ours']['tokens_per_s']:.0f} | {r['ours']['mfu']:.1%} | {r['trl']['mfu']:.1%} | "
                     f"{r['ours']['peak_mem_mb']:.0f} | {r['trl']['peak_mem_mb']:.0f} |")
    lines += ["", f"Checkpoints (rlhf, DPO, float32): a checkpoint's seconds against a step's, as a share of training at "
              f"one every {CHECKPOINT_INTERVAL} steps (`train.save_every_steps={CHECKPOINT_INTERVAL}`; the default interval is "
              "`train.save_every_minutes`' 30):", "",
              "| size | checkpoint s | step s | share |", "|---|---:|---:|---:|"]
    for size, cost in checkpoints.items():
        lines.append(f"| {size} | {cost['checkpoint_s']:.2f} | {cost['step_s']:.3f} | {cost['share']:.2%} |")
    return "\n".join(lines) + "\n"


def chart(results: list[dict], header: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if not r.get("skipped")]
    labels = [f"{r['case']}\n{r['size']} {r['shape']}" for r in shown]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.55 * len(shown) + 2), 4.2))
    bars = axis.bar(range(len(shown)), [r["ratio"] for r in shown],
                    color=["tab:blue" if r["case"].startswith("dpo") else "tab:green" for r in shown])
    axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(shown)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("rlhf samples/s over TRL's")
    axis.set_title(f"rlhf vs TRL, {header['threads']} thread(s): {header['machine']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---- main -------------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="3m,25m,100m", help=f"model sizes, comma-separated ({', '.join(SIZES)})")
    parser.add_argument("--shapes", default="short,long", help=f"data shapes ({', '.join(SHAPES)}); 'long' runs at "
                        "the smallest size only unless --long-everywhere")
    parser.add_argument("--long-everywhere", action="store_true", help="every shape at every size")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"cases ({', '.join(CASES)})")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (as many run untimed first; "
                        f"default by size: {', '.join(f'{k} {v}' for k, v in STEPS.items())}; on a GPU "
                        f"{', '.join(f'{k} {v}' for k, v in STEPS_GPU.items())})")
    parser.add_argument("--batch", type=int, default=8, help="samples (pairs, rows) per optimizer step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each side (default: the CPUs)")
    parser.add_argument("--rows", type=int, default=512, help="training rows written per shape")
    parser.add_argument("--ours", action="append", default=[], metavar="OVERRIDE",
                        help="an override added to every rlhf run, e.g. --ours algo.completion_logits_only=true "
                             "(repeatable; shown in the table's header): how a lever is measured")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where both train: the CPU, or one GPU (ours with hardware=gpu)")
    parser.add_argument("--profile", action="store_true",
                        help=f"also profile {PROFILED_STEPS} steps of each side (torch.profiler; the timed window "
                             "holds them, so its figures are slower): <out>/profile/<size>-<shape>-<case>-<side>/"
                             "profile.txt and profile_trace.json")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="where bench.md, bench.png and bench.json go")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return 0
    import rlhf  # noqa: F401  (before TRL: it quiets bitsandbytes' notice of a Hub kernel, which TRL's import prints)

    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed. Fix: pip install -e \".[bench]\" (or bash scripts/setup.sh)", file=sys.stderr)
        return 2
    import torch

    from rlhf.hardware.base import cpus_available
    from rlhf.telemetry.mfu import bf16_supported, probe

    sizes, shapes, cases = (args.sizes.split(","), args.shapes.split(","), args.cases.split(","))
    for name, chosen, known in (("size", sizes, SIZES), ("shape", shapes, SHAPES), ("case", cases, CASES)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}: choose from {list(known)}")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    threads = args.threads or cpus_available()
    torch.set_num_threads(threads)
    device = args.device
    default_steps = STEPS_GPU if device == "cuda" else STEPS  # timed steps per size where --steps is not given
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    peaks = probe(torch.device(device))
    has_bf16 = bf16_supported(torch.device(device))
    print(f"peak: {', '.join(f'{k} {v / 1e9:.0f} GFLOP/s' for k, v in peaks.items())} ({device}, {threads} threads)",
          flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, losses, checkpoints = [], {}, {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in sizes:
            model_dir = work / f"model-{size}"
            params = build_model(size, model_dir)
            steps = args.steps or default_steps[size]
            losses[size] = check_losses(model_dir, "short")
            print(f"{size}: {params / 1e6:.1f}M parameters; first-step losses (rlhf, TRL): {losses[size]}", flush=True)
            checkpoints[size] = checkpoint_cost(model_dir, work, shapes[0], args.batch, steps, threads, args.ours,
                                                device)
            print(f"{size}: a checkpoint takes {checkpoints[size]['checkpoint_s']:.2f} s, a step "
                  f"{checkpoints[size]['step_s']:.3f} s: {checkpoints[size]['share']:.2%} of training at one every "
                  f"{CHECKPOINT_INTERVAL} steps", flush=True)
            for shape in shapes:
                if shape != shapes[0] and size != sizes[0] and not args.long_everywhere:
                    continue
                for algo in ("dpo", "sft", "grpo"):
                    rows = make_rows(algo, shape, args.rows)
                    write_jsonl(rows, work / f"{algo}-{shape}.jsonl")
                for case in cases:
                    algo = CASES[case][0]
                    row = {"size": size, "shape": shape, "case": case, "params": params, "steps": steps}
                    needs_bf16 = case in BF16 or case in SHIPPED_TRL_BF16
                    if needs_bf16 and not has_bf16:
                        results.append({**row, "skipped": f"skipped: no bf16 matrix instructions on this {device}"})
                        continue
                    data = work / f"{algo}-{shape}.jsonl"
                    case_dir = work / f"{size}-{shape}"
                    case_dir.mkdir(exist_ok=True)
                    per_sample = tokens_per_sample(algo, make_rows(algo, shape, args.rows), shape)
                    profiles = out / "profile" / f"{size}-{shape}-{case}"
                    ours = run_ours(case, model_dir, data, case_dir, args.batch, steps, threads,
                                    [*args.ours, *([f"train.profile_steps={PROFILED_STEPS}"] if args.profile else [])],
                                    device, shape)
                    theirs = run_trl(case, model_dir, data, case_dir, args.batch, steps, threads, device,
                                     profiles.with_name(profiles.name + "-trl") if args.profile else None, shape)
                    if args.profile:
                        for name in ("profile.txt", "profile_trace.json"):
                            (profiles.with_name(profiles.name + "-rlhf")).mkdir(parents=True, exist_ok=True)
                            shutil.copy(case_dir / f"ours-{case}" / name, profiles.with_name(profiles.name + "-rlhf") / name)
                    live = algo == "dpo" and "precomputed" not in case  # a reference runs forward each step
                    flops = 6.0 * params + (2.0 * params if live else 0.0)  # rlhf.telemetry.mfu.flops_per_token's formula
                    ours_bf16 = case in BF16 or (case in SHIPPED_TRL_BF16 and has_bf16)  # auto: bf16 where it is native
                    for side, bf16 in ((ours, ours_bf16), (theirs, case in BF16 or case in SHIPPED_TRL_BF16)):
                        side["tokens_per_s"] = side["samples_per_s"] * per_sample
                        computed = side.get("computed_tokens_per_s", side["tokens_per_s"])  # ours: its own count
                        side["mfu"] = flops * computed / peaks["bfloat16" if bf16 else "float32"]
                    row.update(ours=ours, trl=theirs, ratio=ours["samples_per_s"] / theirs["samples_per_s"])
                    results.append(row)
                    print(f"{size} {shape} {case}: rlhf {ours['samples_per_s']:.2f} samples/s, TRL "
                          f"{theirs['samples_per_s']:.2f} ({row['ratio']:.2f}x); peak MB {ours['peak_mem_mb']:.0f} "
                          f"vs {theirs['peak_mem_mb']:.0f} [{time.perf_counter() - started:.0f} s]", flush=True)
    header = {"date": time.strftime("%Y-%m-%d"), "machine": machine(device) + (" (profiled: the timings include torch.profiler's overhead)" if args.profile else ""), "threads": threads, "versions": versions(),
              "steps": {size: args.steps or default_steps[size] for size in sizes}, "batch": args.batch, "ours": args.ours, "args": " ".join(sys.argv[1:]) or "(defaults)"}
    (out / "bench.json").write_text(json.dumps({"header": header, "peaks": peaks, "losses": losses,
                                                "checkpoints": checkpoints, "results": results}, indent=1))
    (out / "bench.md").write_text(markdown(results, losses, checkpoints, header))
    chart(results, header, out / "bench.png")
    print((out / "bench.md").read_text())
    worst = max(abs(a - b) for pair in losses.values() for a, b in pair.values())
    if worst >= LOSS_TOLERANCE:
        print(f"losses DIFFER by up to {worst:.2e}: the two implementations do not compute the same thing",
              file=sys.stderr)
        return 1
    print(f"losses agree (worst {worst:.1e}); written {out / 'bench.md'}, {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
