"""How fast a run trains, against what the machine can do: ``perf/mfu`` (model FLOPs utilization).

- :func:`flops_per_token`: the model FLOPs of one trained token: ``4 x P + 2 x T + 2 x F`` for a policy of ``P``
  parameters of which ``T`` train, and frozen models (a live reference, a reward model) of ``F`` parameters in
  all. A forward pass is 2 FLOPs per parameter and token (a multiply and an add); the backward pass is as much
  again for the activations' gradients (every layer, trained or not) and as much for the weights' gradients
  (trained parameters only): ``6 x P`` when everything trains, the usual estimate. A frozen model runs forward
  only. Attention's own FLOPs (quadratic in the length) are left out, as they usually are, and so is the
  sampling of an online algorithm's completions; a precomputed reference costs nothing during training.
- :func:`peak_flops`: the FLOP/s of one process on this machine, measured by timing square matrix products in
  float32 and (where the CPU or GPU has it) bfloat16 (:func:`probe`, under 1 s); measured once per machine,
  thread count and torch version, and kept in ``$RLHF_CACHE/peak_flops/`` (default ``~/.cache/rlhf``; delete a
  file to measure again).
- :func:`mfu`: achieved model FLOP/s (``flops_per_token x perf/tokens_per_s``) over the peak of every process
  (the peak of one x the processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from rlhf.core.bf16 import cpu_has_bf16_matmul
from rlhf.hardware.holding import global_numel

PROBE_SECONDS = 0.15  # per precision: matrix products are timed for about this long (the best one counts)


def flops_per_token(policy: torch.nn.Module, frozen: list[torch.nn.Module]) -> float:
    """Model FLOPs per trained token: ``4 x P + 2 x T`` of the policy (``P`` parameters, ``T`` of them trained)
    and ``2 x F`` of the frozen models (``F`` parameters in all; layers a reference shares with the policy run
    again, so they count again). Tied weights count once (``parameters()`` lists each tensor once)."""
    total = sum(global_numel(p) for p in policy.parameters())
    trained = sum(global_numel(p) for p in policy.parameters() if p.requires_grad)
    others = sum(global_numel(p) for module in frozen for p in module.parameters())
    return 4.0 * total + 2.0 * trained + 2.0 * others


def mfu(model_flops_per_token: float, tokens_per_s: float, peak_flops_per_process: float, processes: int) -> float:
    """Model FLOPs utilization: the achieved model FLOP/s over the peak FLOP/s of the run's processes."""
    return model_flops_per_token * tokens_per_s / (peak_flops_per_process * processes)


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware (a CPU with AVX-512 BF16 or AMX, a GPU from
    Ampere on), rather than emulating them."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_has_bf16_matmul()


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: str | os.PathLike | None = None) -> float:
    """The FLOP/s of one process of this machine in ``dtype`` (float32, or bfloat16 where supported: else the
    float32 peak), as a matrix product reaches them: read from the cache, or measured (:func:`probe`) and kept."""
    measured = _cached_probe(device, cache_dir)
    name = str(dtype).removeprefix("torch.")
    return measured.get(name) or measured["float32"]


def machine_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and count: what a peak (and a benchmark) was measured on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor()} ({os.cpu_count()} CPUs)"


def _cached_probe(device: torch.device, cache_dir: str | os.PathLike | None) -> dict[str, float]:
    folder = Path(os.path.expanduser(cache_dir or os.environ.get("RLHF_CACHE", "~/.cache/rlhf"))) / "peak_flops"
    what = {"machine": machine_name(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "torch": torch.__version__}
    path = folder / f"{hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())["flops_per_s"]
    except (OSError, ValueError, KeyError):
        pass
    measured = probe(device)
    try:  # a temporary file renamed into place: a reader never sees half of it
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as file:
            json.dump({**what, "flops_per_s": measured}, file)
        os.replace(file.name, path)
    except OSError:
        pass  # not kept: measured again next time
    return measured


def probe(device: torch.device) -> dict[str, float]:
    """FLOP/s of square matrix products on ``device`` with this process's threads: float32, and bfloat16 where
    :func:`bf16_supported`; the fastest of the products timed for :data:`PROBE_SECONDS` each.

    On a CPU, the larger of that and the threads x one thread's FLOP/s: threads that share their cores with other
    work wait for each other at every product (measured on 2 busy cores: 17 GFLOP/s with 2 threads, 105 with 1),
    which would make a peak measured on a busy machine far too low, and every later MFU of that machine too high."""
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and not bf16_supported(device):
            continue
        rate = _matmul_flops(device, dtype)
        threads = torch.get_num_threads()
        if device.type == "cpu" and threads > 1:
            try:
                torch.set_num_threads(1)
                rate = max(rate, threads * _matmul_flops(device, dtype))
            finally:
                torch.set_num_threads(threads)
        result[str(dtype).removeprefix("torch.")] = rate
    return result


def _matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    size = 4096 if device.type == "cuda" else 512
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2))
    best = float("inf")
    with torch.no_grad():
        torch.mm(a, b)  # warm up (kernels chosen, memory allocated)
        end = time.perf_counter() + PROBE_SECONDS
        while time.perf_counter() < end or best == float("inf"):
            _synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _synchronize(device)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
