"""Milliseconds of the token log-probabilities, forward and backward: autograd's operators against
``rlhf.ops.token_logps``'s one blockwise pass, and whether they agree bit for bit.

    python benchmarks/logps_kernels.py             # the logits of bench.py's DPO batches (8 pairs, short rows)
    python benchmarks/logps_kernels.py --step      # and a whole 100m policy step (forward, backward) with each
    python benchmarks/logps_kernels.py --fused     # the output layer too: F.linear then one pass, against one op
    python benchmarks/logps_kernels.py --fused --device cuda   # on a GPU: torch row blocks and the Triton kernel

The shapes: ``[16, 49, V]`` (8 pairs of short rows, positions from the earliest completion token on) at bench.py's
vocabularies (4,096, 16,384, 32,000) and ``[16, 257, 4096]`` (3m's long rows), float32 and bfloat16 logits. Each
way is timed 5 times (the best is printed, on shared cores the others are noise); "equal" means the values, the
greedy tokens and the gradient are the same bit for bit. ``--step`` interleaves 4 whole steps of each way on the
100m model (random weights), float32 and bf16 autocast, and prints the best and the median.

``--fused`` times the output layer with it, forward and backward, from the last hidden states ``[16, 49, H]``
(bench.py's 100m, 25m DPO batches) and ``[16, 257, 256]`` (3m's long rows): ``F.linear`` then the one pass,
against ``linear_log_softmax`` (the logits a block at a time, never whole; ``algo.fused_output_layer``) with torch
operations at tiles of 4, 16 and 64 MiB, with every position's log-probability in the loss and with half of them
masked out (as prompt and padding positions are; the fused op is then given the scored positions as ``rows``, as
``completion_stats`` gives them, and computes only those), float32 and bf16 autocast; and whether the values agree
(to the products' rounding). With ``--device cuda``, bf16 autocast at :data:`FUSED_SHAPES_GPU`, and the fused op
both ways: torch operations (row blocks over the whole vocabulary) and the Triton kernel
(``rlhf.ops.linear_logps_triton``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlhf.ops import linear_logps_torch
from rlhf.ops.token_logps import linear_log_softmax, selective_log_softmax

SHAPES = [(16, 49, 4096), (16, 49, 16384), (16, 49, 32000), (16, 257, 4096)]
FUSED_SHAPES = [(16, 49, 768, 32000), (16, 49, 512, 16384), (16, 257, 256, 4096)]  # batch, positions, hidden, vocab
FUSED_TILES_MIB = (4, 16, 64)
# On a GPU: the GPU check's SFT batches at 100m's and ~1B's widths, and Qwen2.5-0.5B's vocabulary at 4k tokens
FUSED_SHAPES_GPU = [(64, 65, 768, 32000), (64, 65, 2048, 32000), (8, 513, 896, 151936)]


def autograd_way(logits, labels):
    """What ``rlhf.ops.completion_logps.completion_stats`` computed before: a float32 copy, gather, logsumexp, argmax."""
    x = logits[:, :-1].float()
    return torch.gather(x, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1), x.argmax(-1)


def one_pass(logits, labels):
    return selective_log_softmax(logits, labels, with_argmax=True)


WAYS = {"autograd": autograd_way, "one pass": one_pass}


def op_times(shape, dtype) -> None:
    torch.manual_seed(0)
    batch, length, vocab = shape
    base = (torch.randn(batch, length, vocab) * 3).to(dtype)
    labels, weight = torch.randint(vocab, (batch, length - 1)), torch.randn(batch, length - 1)
    results, best = {}, {}
    for name, way in WAYS.items():
        times = []
        for _ in range(5):
            logits = base.clone().requires_grad_()
            start = time.perf_counter()
            logps, argmax = way(logits, labels)
            (logps * weight).sum().backward()
            times.append(time.perf_counter() - start)
        results[name], best[name] = (logps.detach(), argmax, logits.grad), min(times) * 1000
    equal = all(torch.equal(a, b) for a, b in zip(*results.values()))
    print(f"{list(shape)} {str(dtype).removeprefix('torch.'):>8}: autograd {best['autograd']:6.1f} ms, one pass "
          f"{best['one pass']:6.1f} ms ({best['autograd'] / best['one pass']:.1f}x), "
          f"{'equal' if equal else 'NOT EQUAL'}", flush=True)


def step_times() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, num_hidden_layers=8,
                                         num_attention_heads=12, intermediate_size=2048))
    batch, length, keep = 16, 64, 49
    ids = torch.randint(32000, (batch, length))
    for bf16 in (False, True):
        times = {name: [] for name in WAYS}
        for round_ in range(5):
            for name, way in WAYS.items():
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(input_ids=ids, logits_to_keep=keep).logits
                logps, _ = way(logits, ids[:, length - keep + 1:])
                logps.sum().backward()
                model.zero_grad(set_to_none=True)
                if round_:  # the first round is untimed
                    times[name].append((time.perf_counter() - start) * 1000)
        print(f"100m step, {'bf16' if bf16 else 'fp32'}: " + ", ".join(
            f"{name} best {min(t):.0f} ms (median {statistics.median(t):.0f})" for name, t in times.items()), flush=True)


def fused_times(shape, bf16: bool, live: float, device: str = "cpu") -> None:
    """Best of 4 interleaved: F.linear + one pass against linear_log_softmax: on a CPU with torch operations at each
    tile size, on a GPU with torch operations and with the Triton kernel. With ``live < 1`` the positions scored are
    passed as ``rows`` (what completion_stats sends: only they are computed)."""
    torch.manual_seed(0)
    batch, length, hidden_size, vocab = shape
    hidden0 = torch.randn(batch, length, hidden_size, device=device)
    weight0 = torch.randn(vocab, hidden_size, device=device) * 0.05
    labels = torch.randint(vocab, (batch, length - 1), device=device)
    grad = torch.randn(batch, length - 1, device=device)
    grad[:, :int((1 - live) * (length - 1))] = 0.0  # masked positions: no gradient
    rows = grad.reshape(-1).nonzero().squeeze(-1) if live < 1 else None
    cuda = device == "cuda"

    def run(way):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            if way is None:
                logps = selective_log_softmax(torch.nn.functional.linear(hidden, weight), labels)
            elif isinstance(way, int):  # torch operations at this tile size (MiB)
                linear_logps_torch.LINEAR_TILE_BYTES_CPU = way * 2**20
                logps = linear_log_softmax(hidden, weight, None, labels, rows=rows, triton=False)[0]
            else:
                logps = linear_log_softmax(hidden, weight, None, labels, rows=rows, triton=way == "triton")[0]
        (logps * grad).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, (logps.detach(), hidden.grad, weight.grad)

    ways = [None, "torch", "triton"] if cuda else [None, *FUSED_TILES_MIB]
    times, values = {way: [] for way in ways}, {}
    saved = linear_logps_torch.LINEAR_TILE_BYTES_CPU
    try:
        for _ in range(4):
            for way in ways:
                seconds, values[way] = run(way)
                times[way].append(seconds)
    finally:
        linear_logps_torch.LINEAR_TILE_BYTES_CPU = saved
    tolerance = 2e-2 if bf16 else 1e-4
    scored = grad != 0  # the values where scored, and the gradients of hidden states and weight, to rounding
    agree = all(torch.allclose(values[way][0][scored], values[None][0][scored], atol=tolerance, rtol=tolerance)
                and all(torch.allclose(mine, theirs, atol=tolerance, rtol=tolerance)
                        for mine, theirs in zip(values[way][1:], values[None][1:])) for way in ways)
    name = lambda way: f"{way} MiB" if isinstance(way, int) else way  # noqa: E731
    print(f"{list(shape)} {'bf16' if bf16 else 'fp32'}, {live:.0%} of positions scored: linear + one pass "
          f"{min(times[None]) * 1000:6.1f} ms; fused " + ", ".join(
              f"{name(way)} {min(times[way]) * 1000:6.1f} ms ({min(times[None]) / min(times[way]):.2f}x)"
              for way in ways[1:]) + (", agree" if agree else ", DISAGREE"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", action="store_true", help="also time whole 100m policy steps with each way")
    parser.add_argument("--fused", action="store_true", help="only the output layer with it: F.linear then one "
                        "pass, against linear_log_softmax at several tile sizes (or, on a GPU, torch and Triton)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where --fused runs (cuda: bf16 "
                        "autocast only, at the GPU's shapes)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    if args.fused:
        cuda = args.device == "cuda"
        for shape in FUSED_SHAPES_GPU if cuda else FUSED_SHAPES:
            for bf16 in (True,) if cuda else (False, True):
                for live in (1.0, 0.5):
                    fused_times(shape, bf16, live, args.device)
        return
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            op_times(shape, dtype)
    if args.step:
        step_times()


if __name__ == "__main__":
    main()
