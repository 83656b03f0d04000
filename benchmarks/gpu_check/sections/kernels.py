"""The GPU check's output-layer kernels: SFT's loss from the last hidden states,
forward and backward, each way of :data:`WAYS` on the same batch.

A way is ``(name, make)``: ``make()`` returns ``loss(hidden, weight, labels)`` (hidden ``(1, N, H)``, weight
``(V, H)``, labels ``(1, N)``: the mean negative log-probability of the labels), or raises ``ImportError`` where
what it needs is not installed (its row says so). Adding a kernel to the comparison is one entry in :data:`WAYS`.
"""

from __future__ import annotations

import time


def _whole():
    import torch

    from rlhf.ops.token_logps import selective_log_softmax

    return lambda hidden, weight, labels: -selective_log_softmax(torch.nn.functional.linear(hidden, weight),
                                                                 labels).mean()


def _tiles():
    from rlhf.ops.token_logps import linear_log_softmax

    return lambda hidden, weight, labels: -linear_log_softmax(hidden, weight, None, labels, triton=False)[0].mean()


def _triton():
    import torch
    import triton  # noqa: F401  (ImportError where it is not installed: the row says so)

    from rlhf.ops.token_logps import linear_log_softmax

    if not torch.cuda.is_available():
        raise ImportError("no GPU here")

    return lambda hidden, weight, labels: -linear_log_softmax(hidden, weight, None, labels, triton=True)[0].mean()


def _liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda hidden, weight, labels: liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), reduction="mean")


WAYS = [
    ("logits whole", _whole),  # the logits, then our one-pass log-softmax (algo.fused_output_layer=false)
    ("our torch tiles", _tiles),  # rlhf.ops.token_logps.linear_log_softmax with torch's operations (a CPU's)
    ("our Triton kernel", _triton),  # the same with rlhf.ops.linear_logps_triton (a GPU's, where triton imports)
    # Liger-Kernel's fused linear cross entropy, where installed: the field's kernel for this layer (TRL 1.16's
    # use_liger_kernel does not run it: TRL turns it off and computes its loss through its own chunked output layer)
    ("Liger", _liger),
]
NOT_INSTALLED = {"Liger": "liger-kernel is not installed (benchmarks/device_wheels.sh carries it to the GPU machine)",
                 "our Triton kernel": "a GPU's (tested on a CPU under Triton's interpreter: tests/ops)"}

# (label, rows = sequences x positions, hidden, vocabulary): SFT batches of the speed section at real lengths (16 rows
# of up to 641 tokens), and the short rows' (64 of 65), at 100m's and ~1B's widths; the rehearsal's at 3m.
KERNEL_SHAPES = {"cuda": [("1b, 16 rows of 641", 16 * 641, 2048, 32000), ("100m, 16 rows of 641", 16 * 641, 768, 32000),
                          ("1b, 64 rows of 65", 64 * 65, 2048, 32000)],
                 "cpu": [("3m, 8 rows of 65", 8 * 65, 256, 4096)]}


def output_layer_kernels(device: str, repeats: int = 5) -> list[dict]:
    """Each of :data:`WAYS` at each of :data:`KERNEL_SHAPES` (bf16 autocast on a GPU): milliseconds (best of
    ``repeats``, forward and backward), peak memory above the inputs (a GPU's), and the loss's distance from the
    whole logits' in float64 without autocast."""
    import torch

    ways, rows_out = {}, []
    for name, make in WAYS:
        try:
            ways[name] = make()
        except ImportError as error:
            rows_out.append({"shape": "-", "way": name, "failed": NOT_INSTALLED.get(name, f"not installed: {error}")})
    whole = _whole()
    cuda = device == "cuda"
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
    return rows_out
