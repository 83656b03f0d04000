"""Time a frozen model's forward under bf16 autocast with its linear weights in float32 (autocast casts them on
every call) and stored in bf16 (``rlhf.hardware.holding.linear_weights_to_bf16``, what ``prepare_frozen`` does
under ``hardware.mixed_precision=bf16``), at bench.py's model sizes.

    python benchmarks/frozen_bf16.py                       # 3m, 25m, 100m; 16 sequences of 64 tokens (a DPO batch of 8 pairs)
    python benchmarks/frozen_bf16.py --sizes 100m --repeats 20

The two copies run interleaved, call after call, so a slow moment of a shared machine falls on both; printed per
size: the median seconds per forward of each, the ratio, the bytes of parameters each holds, and whether their
logits are equal bit for bit (they must be: the products are the same).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SIZES  # noqa: E402  (the benchmark's model sizes)

from rlhf.hardware.holding import linear_weights_to_bf16  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=16, help="sequences per forward")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards of each copy (after 2 untimed)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 autocast, {args.batch} x "
          f"{args.tokens} tokens per forward, median of {args.repeats}")
    print("| size | float32 weights, s | bf16 weights, s | ratio | parameter MB (f32 / bf16) | logits equal |")
    print("|---|---:|---:|---:|---:|---|")
    for size in args.sizes:
        torch.manual_seed(0)
        f32 = LlamaForCausalLM(LlamaConfig(**SIZES[size], tie_word_embeddings=False)).eval().requires_grad_(False)
        b16 = copy.deepcopy(f32)
        linear_weights_to_bf16(b16)
        ids = torch.randint(0, SIZES[size]["vocab_size"], (args.batch, args.tokens))
        times: dict[str, list[float]] = {"f32": [], "b16": []}
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            equal = torch.equal(f32(input_ids=ids).logits, b16(input_ids=ids).logits)
            for i in range(args.repeats + 2):
                for name, model in (("f32", f32), ("b16", b16)):
                    start = time.perf_counter()
                    model(input_ids=ids)
                    if i >= 2:
                        times[name].append(time.perf_counter() - start)
        mb = [sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20 for m in (f32, b16)]
        a, b = statistics.median(times["f32"]), statistics.median(times["b16"])
        print(f"| {size} | {a:.4f} | {b:.4f} | {a / b:.2f}x | {mb[0]:.0f} / {mb[1]:.0f} | {equal} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
