"""Time torch's scaled-dot-product-attention kernels on this machine: the flash kernel against the math kernel (a
matrix product, a softmax, a matrix product), forward and backward, in float32 and bf16, over key lengths, at the
head shapes of bench.py's model sizes. ``rlhf.models.attention`` chooses between them from these measurements.

    python benchmarks/attention_kernels.py                      # 16 sequences (a DPO batch of 8 pairs), lengths 32..1024
    python benchmarks/attention_kernels.py --sizes 100m --lengths 128 192 256 320 --repeats 20

The kernels run interleaved, call after call, so that a slow moment of a shared machine falls on both; printed per
shape: the median milliseconds of each and flash / math (above 1: the math kernel is faster). A causal boolean mask
that pads the last eighth of every sequence, as a right-padded batch has, goes to both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SIZES  # noqa: E402  (the benchmark's model sizes)

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def time_kernels(batch: int, heads: int, head_dim: int, length: int, dtype: torch.dtype, backward: bool,
                 repeats: int) -> dict[str, float]:
    """Median milliseconds of one attention call (and its backward) with each kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, dtype=dtype, requires_grad=backward) for _ in range(3))
    mask = torch.ones(length, length, dtype=torch.bool).tril().expand(batch, 1, length, length).clone()
    mask[:, :, :, length - length // 8:] = False
    mask[:, :, :, 0] = True  # every row sees one key at least
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for i in range(repeats + 2):
        for name, kernel in KERNELS.items():
            start = time.perf_counter()
            with sdpa_kernel(kernel), torch.set_grad_enabled(backward):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                if backward:
                    out.sum().backward()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["3m", "100m"], choices=list(SIZES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[32, 64, 128, 192, 256, 384, 512, 1024])
    parser.add_argument("--batch", type=int, default=16, help="sequences per call")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each kernel (after 2 untimed)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.batch} sequences, median of "
          f"{args.repeats}; ms per call")
    print("| size | heads x dim | dtype | keys | forward flash | forward math | flash / math | forward+backward flash "
          "| forward+backward math | flash / math |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        heads = SIZES[size]["num_attention_heads"]
        head_dim = SIZES[size]["hidden_size"] // heads
        for dtype in args.dtypes:
            for length in args.lengths:
                fwd = time_kernels(args.batch, heads, head_dim, length, DTYPES[dtype], False, args.repeats)
                both = time_kernels(args.batch, heads, head_dim, length, DTYPES[dtype], True, args.repeats)
                print(f"| {size} | {heads} x {head_dim} | {dtype} | {length} | {fwd['flash']:.2f} | {fwd['math']:.2f} "
                      f"| {fwd['flash'] / fwd['math']:.2f} | {both['flash']:.2f} | {both['math']:.2f} "
                      f"| {both['flash'] / both['math']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
