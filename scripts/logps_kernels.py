"""Milliseconds of the token log-probabilities, forward and backward: autograd's operators against
``rlhf.algos.token_logps``'s one blockwise pass, and whether they agree bit for bit.

    python scripts/logps_kernels.py             # the logits of bench.py's DPO batches (8 pairs, short rows)
    python scripts/logps_kernels.py --step      # and a whole 100m policy step (forward, backward) with each

The shapes: ``[16, 49, V]`` (8 pairs of short rows, positions from the earliest completion token on) at bench.py's
vocabularies (4,096, 16,384, 32,000) and ``[16, 257, 4096]`` (3m's long rows), float32 and bfloat16 logits. Each
way is timed 5 times (the best is printed, on shared cores the others are noise); "equal" means the values, the
greedy tokens and the gradient are the same bit for bit. ``--step`` interleaves 4 whole steps of each way on the
100m model (random weights), float32 and bf16 autocast, and prints the best and the median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlhf.algos.token_logps import selective_log_softmax

SHAPES = [(16, 49, 4096), (16, 49, 16384), (16, 49, 32000), (16, 257, 4096)]


def autograd_way(logits, labels):
    """What ``rlhf.algos.base.completion_stats`` computed before: a float32 copy, gather, logsumexp, argmax."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", action="store_true", help="also time whole 100m policy steps with each way")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            op_times(shape, dtype)
    if args.step:
        step_times()


if __name__ == "__main__":
    main()
