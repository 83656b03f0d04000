"""Milliseconds of one AdamW step with torch's three kernels, and how far their results drift apart.

    python benchmarks/adamw_kernels.py            # parameter sets the shape of bench.py's 3m and 100m models

The kernels: ``foreach=False`` (a loop over the parameters, torch's default on a CPU), ``foreach=True`` and
``fused=True`` (what ``optimizer.fused: true`` in conf/optimizer/adamw.yaml picks; TRL's default optimizer too).
Each is timed over 10 steps after 3 untimed ones, on random gradients, with the threads torch has. Then the same
20 steps of random gradients are taken with each kernel from the same start, and the largest difference of the
parameters from the loop's is printed.
"""

from __future__ import annotations

import time

import torch

KERNELS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# (rows, columns) of the matrices: about bench.py's 3m (4.2M) and 100m (110M) models.
SHAPES = {"3m": [(256, 1024)] * 12 + [(4096, 256)], "100m": [(768, 3072)] * 36 + [(32000, 768)]}


def step_ms(shapes: list[tuple[int, int]], kernel: dict) -> float:
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, **kernel)
    for _ in range(3):
        optimizer.step()
    start = time.perf_counter()
    for _ in range(10):
        optimizer.step()
    return (time.perf_counter() - start) / 10 * 1000


def drift(kernel: dict, steps: int = 20) -> float:
    torch.manual_seed(0)
    start = [torch.randn(64, 64) for _ in range(3)]
    grads = [[torch.randn(64, 64) for _ in range(3)] for _ in range(steps)]
    results = {}
    for name, settings in (("loop", KERNELS["loop"]), ("other", kernel)):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-3,
                                      weight_decay=0.01, **settings)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        results[name] = params
    return max((a - b).abs().max().item() for a, b in zip(results["loop"], results["other"]))


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for size, shapes in SHAPES.items():
        count = sum(r * c for r, c in shapes)
        times = ", ".join(f"{name} {step_ms(shapes, kernel):.1f} ms" for name, kernel in KERNELS.items())
        print(f"{size} ({count / 1e6:.1f}M parameters): {times}")
    print(", ".join(f"{name}: {drift(KERNELS[name]):.1e}" for name in ("foreach", "fused")),
          "largest difference from the loop's parameters after 20 steps")


if __name__ == "__main__":
    main()
