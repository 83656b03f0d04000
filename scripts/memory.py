"""Memory by reference strategy, PEFT and optimizer: measured on this CPU, and predicted for real models.

    python scripts/memory.py measure            # a hidden-512 embedded model: preflight vs measured peak, per option
    python scripts/memory.py predict            # predicted tables for a 0.5B and a 7B model (no download)
    python scripts/memory.py fits               # which setups fit a 2.7B model on two 24 GB GPUs
    python scripts/memory.py all                # the three, as the README shows them

`measure` runs `train.py` once per reference strategy x optimizer (a fresh process each, 3 steps) and prints the
preflight's prediction (`summary.json`'s `memory_predicted_mb`) beside the measured peak (`perf/peak_mem_mb`).
`predict` and `fits` use the same preflight code (rlhf/telemetry/memory_preflight.py) on models built on the meta device from their
published architectures, with the real configs of this repository for optimizer, reference, PEFT and hardware:
they are predictions, labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.seeds import cpu_name, versions  # noqa: E402

# The embedded model made larger: ~17M parameters, so that the model's state is not lost in the runtime's own.
LARGER = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=2048", "model.tiny.num_heads=8",
          "model.tiny.num_layers=4", "model.tiny.warm_start_steps=0"]
SHORT = ["hardware=cpu", "train.max_steps=3", "train.per_device_batch_size=8", "train.eval_batch_size=8",
         "train.eval_at_start=false", "train.eval_every_steps=0", "train.save_every_steps=0",
         "train.save_final=false", "data.task.num_train=256", "data.task.num_eval=16", "train.log_every_steps=1"]
REFERENCES = {
    "copy": ["algo/reference=copy"],
    "shared_layers": ["algo/reference=shared_layers", "algo.reference.num_shared_layers=2"],
    "int8": ["algo/reference=int8"],
    "adapter": ["peft=lora", "algo/reference=adapter"],
    "precomputed": ["algo/reference=precomputed"],
}
OPTIMIZERS = ["adamw", "adam8bit", "lion"]


def measure_one(overrides: list[str], folder: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: the same on a busy or an idle machine
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        return {"error": tail}
    summary = json.loads((folder / "summary.json").read_text())
    return {"predicted": summary["memory_predicted_mb"], "peak": summary["final"]["perf/peak_mem_mb"],
            "seconds": time.perf_counter() - start}


def measure() -> None:
    print(f"Measured on {cpu_name()}, {os.cpu_count()} CPU(s), one thread; {versions()}. The embedded model at "
          f"hidden size 512 ({' '.join(LARGER[:4])}), DPO, 8 pairs per micro-batch, 3 steps, `hardware=cpu`. "
          "MB per process; measured: peak resident set above the process's size before the run was built.\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, reference in REFERENCES.items():
            for optimizer in OPTIMIZERS:
                result = measure_one([*LARGER, *SHORT, *reference, f"optimizer={optimizer}"],
                                     Path(tmp) / f"{name}-{optimizer}")
                rows.append((name, optimizer, result))
                print(f"  {name} {optimizer}: {result.get('peak', result.get('error'))}", file=sys.stderr)
    header = ["reference", "optimizer", "weights", "gradients", "optimizer state", "frozen", "activations",
              "predicted", "measured peak", "measured - predicted"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * 2 + "---:|" * (len(header) - 2))
    for name, optimizer, result in rows:
        if "error" in result:
            print(f"| `{name}` | `{optimizer}` | failed: {result['error'].splitlines()[-1]} |")
            continue
        parts = result["predicted"]
        total = sum(parts.values())
        cells = [f"{parts[k]:.1f}" for k in ("weights", "gradients", "optimizer", "frozen", "activations")]
        print(f"| `{name}` | `{optimizer}` | " + " | ".join(cells)
              + f" | {total:.1f} | {result['peak']:.1f} | {result['peak'] - total:+.1f} |")


# Published architectures (each model's config.json on the Hub), built on the meta device: nothing is downloaded.
ARCHITECTURES = {
    "Qwen2.5-0.5B": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   tie_word_embeddings=True)),
    "Phi-2 (2.7B)": ("phi", dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
                                 intermediate_size=10240, vocab_size=51200, partial_rotary_factor=0.4,
                                 tie_word_embeddings=False)),
    "Llama-2-7B": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                 tie_word_embeddings=False)),
}
GPU_SEQUENCES, GPU_TOKENS = 2, 1024  # one preference pair of 1024 tokens per micro-batch, as two sequences (algo.shared_prompt counts its prompt once: fewer)
GPU_GB, GPU_RESERVED_GB = 24, 1.5  # an A10/A5000/RTX 4090; the CUDA context, NCCL buffers and fragmentation
HEADROOM = 0.9  # a setup "fits" when its prediction is under 90% of what is usable: predictions are estimates


def meta_model(architecture: str, dtype):
    """The architecture's model on the meta device (shapes only, no memory), in ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = ARCHITECTURES[architecture]
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=dtype)


def predict_one(architecture: str, overrides: list[str], checkpointing: bool, cache: dict):
    """The preflight's prediction (rlhf.telemetry.memory_preflight.plan) for one process of the setup ``overrides`` describes (the
    repository's own config groups: hardware, optimizer, peft, algo/reference, model.dtype)."""
    import torch
    from hydra import compose, initialize_config_dir

    from rlhf.core.instantiate import build
    from rlhf.hardware.holding import StoredPrecision
    from rlhf.models.loading import DTYPES
    from rlhf.optim import partition as partitions
    from rlhf.telemetry.memory_preflight import activation_bytes, plan
    from rlhf.telemetry.optimizer_state import bytes_per_parameter

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "output_dir=unused"])
    dtype = DTYPES[cfg.model.dtype]
    adapter, reference, strategy = build(cfg.peft), build(cfg.algo.reference), build(cfg.hardware)
    key = (architecture, cfg.model.dtype)
    if key not in cache:
        cache[key] = meta_model(architecture, dtype)
    model = cache[key]
    trainable = adapter.trainable_parameters(model)
    width = 4 if adapter.adapts else torch.finfo(dtype).bits // 8  # adapters are kept in float32
    precision = strategy.stored_precision()
    if adapter.quantizes:  # a 4-bit base stays 4-bit: only the master copy and the states' dtype apply
        precision = StoredPrecision(master_bytes=precision.master_bytes, optimizer_dtype=precision.optimizer_dtype)
    state_dtype = precision.optimizer_dtype or (torch.float32 if adapter.adapts else dtype)
    state_key = ("optimizer", architecture, cfg.model.dtype, str(cfg.optimizer), state_dtype, adapter.adapts)
    if state_key not in cache:  # the probes of a 7B model's shapes take seconds: once per optimizer and model
        partition, make_optimizer = partitions.from_config(cfg.optimizer)
        # the partition's parts of the whole model (an adapter's tensors: one probe matrix, as their shapes vary less)
        cache[state_key] = bytes_per_parameter(make_optimizer, state_dtype, None if adapter.adapts else partition(model))
    optimizer_bytes = cache[state_key]
    value_bytes = 2 if cfg.hardware.mixed_precision == "bf16" or dtype != torch.float32 else 4
    frozen = reference.memory_bytes(model) * strategy.frozen_share(quantized=reference.quantized)
    target = (cfg.get("eval") or {}).get("_target_")
    if target:  # eval=generate's own copy of the initial policy, where it holds one
        from hydra.utils import get_class

        from rlhf.evaluation.generated import GenerationEval, needs_own_copy

        if issubclass(get_class(target), GenerationEval) and needs_own_copy(reference,
                                                                            reference.memory_bytes(model) > 0):
            frozen += adapter.memory_bytes(model) * strategy.frozen_share(quantized=adapter.quantizes)
    return plan(weights=adapter.memory_bytes(model), trainable=trainable, gradient_width=width, frozen=int(frozen),
                optimizer_bytes=optimizer_bytes, sharded=strategy.sharded_state(), processes=strategy.processes(),
                activations=activation_bytes(model.config, GPU_SEQUENCES, GPU_TOKENS, value_bytes, checkpointing),
                precision=precision, parameters=sum(p.numel() for p in model.parameters()))


GPU = ["hardware.device=cuda", "hardware.num_processes=2", "hardware.mixed_precision=bf16"]
HARDWARE = ["ddp", "zero2", "zero3", "fsdp"]
# (peft, reference, their extra overrides): the combinations the config check accepts. QLoRA stores its 4-bit
# weights and computes in bf16 (what ZeRO-3 and FSDP need, per PEFT's docs); int8 keeps its unquantized layers
# (embeddings, norms, head) in the policy's dtype.
QLORA = ["peft.quant_storage=bfloat16", "peft.compute_dtype=bfloat16"]
INT8 = ["algo.reference.dtype=${model.dtype}"]
SETUPS = [
    ("none", "copy", []), ("none", "int8", INT8), ("none", "precomputed", []),
    ("lora", "copy", []), ("lora", "adapter", []), ("lora", "precomputed", []),
    ("qlora", "adapter", QLORA), ("qlora", "precomputed", QLORA),
]
ALL_OPTIMIZERS = ["adamw", "adam8bit", "lion", "sgd"]


def refused(hardware: str, optimizer: str) -> bool:
    """Whether the config check refuses ``optimizer`` under ``hardware`` before anything loads (an optimizer that
    cannot run on the shards of a sharded strategy: rlhf.optim.support.sharding_refusal)."""
    import yaml
    from hydra.utils import get_object

    from rlhf.optim.support import sharding_refusal

    if hardware not in ("fsdp", "zero1", "zero2", "zero3"):
        return False
    target = yaml.safe_load((ROOT / "conf" / "optimizer" / f"{optimizer}.yaml").read_text())["_target_"]
    return sharding_refusal(target, get_object(target), zero=hardware != "fsdp") is not None


def _overrides(hardware: str, peft: str, reference: str, extra: list[str], optimizer: str, dtype: str) -> list[str]:
    return [f"hardware={hardware}", *GPU, f"peft={peft}", f"algo/reference={reference}", *extra,
            f"optimizer={optimizer}", f"model.dtype={dtype}"]


def predict() -> None:
    """Predicted GB per GPU for a 0.5B and a 7B model, 2 GPUs, by hardware x (peft, reference) x optimizer."""
    cache: dict = {}
    for architecture in ("Qwen2.5-0.5B", "Llama-2-7B"):
        print(f"\n**{architecture}: predicted GB per GPU** (2 GPUs, bf16 weights and autocast, one pair of "
              f"{GPU_TOKENS} tokens per micro-batch, gradient checkpointing on; a prediction of "
              "`rlhf/telemetry/memory_preflight.py`, not a measurement)\n")
        print("| hardware | peft | reference | " + " | ".join(ALL_OPTIMIZERS) + " |")
        print("|---|---|---|" + "---:|" * len(ALL_OPTIMIZERS))
        for hardware in HARDWARE:
            for peft, reference, extra in SETUPS:
                cells = ["refused" if refused(hardware, optimizer) else
                         f"{predict_one(architecture, _overrides(hardware, peft, reference, extra, optimizer, 'bfloat16'), True, cache).total / 2**30:.1f}"
                         for optimizer in ALL_OPTIMIZERS]
                print(f"| `{hardware}` | `{peft}` | `{reference}` | " + " | ".join(cells) + " |")


def fits() -> None:
    """For Phi-2 (2.7B) on two 24 GB GPUs: which setups fit, in bf16 and in fp32 weights."""
    cache: dict = {}
    budget = GPU_GB - GPU_RESERVED_GB
    print(f"\n**Phi-2 (2.7B) on two {GPU_GB} GB GPUs: what fits** (predicted; {budget} GB usable per GPU after "
          f"{GPU_RESERVED_GB} GB for the CUDA context and buffers; a setup fits when predicted under {HEADROOM:.0%} of "
          f"that, {HEADROOM * budget:.2f} GB; one pair of {GPU_TOKENS} tokens per micro-batch; the optimizers that "
          "fit and run there (an optimizer refused under a sharded strategy is left out), with AdamW's predicted GB per "
          "GPU)\n")
    print("| hardware | peft | reference | bf16 weights, checkpointing | bf16 weights, no checkpointing | "
          "fp32 weights, checkpointing |")
    print("|---|---|---|---|---|---|")
    for hardware in HARDWARE:
        for peft, reference, extra in SETUPS:
            cells = []
            for dtype, checkpointing in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
                sizes = {optimizer: predict_one("Phi-2 (2.7B)", _overrides(hardware, peft, reference, extra, optimizer,
                                                                          dtype), checkpointing, cache).total / 2**30
                         for optimizer in ALL_OPTIMIZERS}
                fitting = [optimizer for optimizer, size in sizes.items()
                           if size <= HEADROOM * budget and not refused(hardware, optimizer)]
                cells.append(f"{', '.join(fitting) or 'none'} ({sizes['adamw']:.1f})")
            print(f"| `{hardware}` | `{peft}` | `{reference}` | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["measure", "predict", "fits", "all"])
    args = parser.parse_args()
    if args.what in ("measure", "all"):
        measure()
    if args.what in ("predict", "all"):
        predict()
    if args.what in ("fits", "all"):
        fits()


if __name__ == "__main__":
    main()
