"""The GPU check's preflight (``benchmarks/gpu_check.py``): each of our GPU defaults tried once on a small input at
the start of every CUDA part, in seconds, before a pair is timed with it. A default that fails here is turned off
for the rest of the call by its named override (:data:`PROBES`), and the page says so: our side then runs without
it rather than failing in every pair.

A probe is ``(name, run, override)``: ``run(device)`` raises where the default fails (its result is not timed);
``override`` is the ``key=value`` that turns it off, given to every run of ours whose algorithm's config has the
key (``conf/algo/<algo>.yaml``; ``hardware.*`` and ``model.*`` to every run), or ``None`` where no default of the
speed pairs uses it (its failure only skips the levers that ask for it: :func:`lever_blocked`).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/bench.py)
import gpu_check_isolated as isolated  # noqa: E402
from gpu_check_correctness import last_line  # noqa: E402


def _triton_output_layer(device: str) -> None:
    """rlhf.ops' Triton output layer against its torch twin: forward and backward on a small bf16 input."""
    import torch

    from rlhf.ops.token_logps import linear_log_softmax

    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 64, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(1000, 64, device=device) * 0.125).to(torch.bfloat16)
    index = torch.randint(1000, (2, 32), device=device)
    results = []
    for triton in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logps = linear_log_softmax(h, w, None, index, start=4, triton=triton)[0]
        logps.sum().backward()
        results.append((logps.detach().float(), h.grad.float(), w.grad.float()))
    for got, want in zip(*results):
        if not torch.allclose(got, want, rtol=3e-2, atol=3e-2):
            raise AssertionError(f"the Triton output layer differs from torch's by {float((got - want).abs().max()):.3g}")


def _compiled_layer(device: str) -> None:
    """One decoder layer of the smallest benchmark model compiled as ``hardware.compile=layers`` compiles it:
    forward and backward in bf16 autocast."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.hardware.compiling import LAYER_OPTIONS

    config = LlamaConfig(**bench.SIZES["3m"], max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(device)
    model.config.use_cache = False
    layer = model.model.layers[0]
    layer.compile(**LAYER_OPTIONS)
    ids = torch.randint(config.vocab_size, (2, 64), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()


def _flex_attention(device: str) -> None:
    """flex_attention forward and backward under a causal block mask."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 256, 256, device=device)
    q, k, v = (torch.randn(1, 4, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.compile(flex_attention)(q, k, v, block_mask=mask).sum().backward()


def _static_decoding(device: str) -> None:
    """Four tokens of our static-cache decoding loop with the decode step compiled as on a GPU (CUDA graphs), from a
    bf16 policy whose decoder layers are compiled as ``hardware.compile=layers`` compiles them (as GRPO's is)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.hardware.compiling import LAYER_OPTIONS
    from rlhf.models.decoding import GPU_COMPILE, decode

    config = LlamaConfig(**bench.SIZES["3m"], max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    for layer in model.model.layers:
        layer.compile(**LAYER_OPTIONS)
    ids = torch.randint(4, config.vocab_size, (2, 8), device=device)
    out = decode(model, ids, torch.ones_like(ids), 4, pad_id=0, eos_ids=[1], sampled=True,
                 compile_options=GPU_COMPILE)
    if out.shape[0] != 2 or out.shape[1] > 12:
        raise AssertionError(f"static decoding returned {list(out.shape)} for 2 rows of 8 + 4 new tokens")


PROBES = [  # (name, run, the override that turns the default off)
    ("Triton output layer", _triton_output_layer, "algo.fused_output_layer=false"),
    ("compiled decoder layers (hardware.compile=auto)", _compiled_layer, "hardware.compile=false"),
    ("flex attention block mask", _flex_attention, None),
    ("static-cache decoding in CUDA graphs", _static_decoding, "algo.generation=transformers"),
]
FLEX_OVERRIDES = ("flex_attention", "padding_free=true")  # a lever asking for flex attention


PROBE_TIMEOUT_S = 150.0  # all the probes together (they run side by side, each in its own process)


def preflight(device: str, probes: list | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """Each probe of ``probes`` (default :data:`PROBES`, which run on a GPU only: on a CPU each row says so) on
    ``device``: ``{"check", "value", "ok", "override"}`` rows, ``"failed": True`` on those that raised.

    :data:`PROBES` run side by side, each in a process of its own (:mod:`gpu_check_isolated`), all stopped
    ``timeout_s`` after the start: a probe that breaks the CUDA context, crashes its compiler or hangs fails its own
    row and leaves this process's device untouched. Other ``probes`` (the tests' fakes) run here, one by one."""
    if probes is None and device != "cuda":
        return [{"check": f"preflight: {name}", "value": "a GPU's (not run on a CPU)", "ok": None, "override": None}
                for name, _, _ in PROBES]
    started = time.perf_counter()
    calls = {name: isolated.Call(f"gpu_check_preflight:{run.__name__}", [device]) for name, run, _ in PROBES} \
        if probes is None else {}
    rows = []
    for name, run, override in PROBES if probes is None else probes:
        check = f"preflight: {name}"
        began = calls[name].started if name in calls else time.perf_counter()
        try:
            if name in calls:
                calls[name].result(started + timeout_s - time.perf_counter())
            else:
                run(device)
        except Exception as error:  # noqa: BLE001  (the finding is the row; the check goes on without it)
            traceback.print_exc()
            turned_off = f"; turned off for this call: {override}" if override else ""
            rows.append({"check": check, "value": f"raised {last_line(error)}{turned_off}", "ok": False,
                         "override": override, "failed": True})
            continue
        rows.append({"check": check, "value": f"ran ({time.perf_counter() - began:.1f} s)", "ok": True,
                     "override": None})
    return rows


def _algo_keys(algo: str) -> set[str]:
    return set(yaml.safe_load((bench.ROOT / "conf" / "algo" / f"{algo}.yaml").read_text()) or {})


def fallback_overrides(rows: list[dict], algo: str) -> list[str]:
    """The overrides of the failed probes that apply to ``algo``'s runs (an ``algo.*`` key its config has; every
    other key)."""
    out = []
    for row in rows:
        override = row.get("override")
        if not row.get("failed") or override is None:
            continue
        key = override.split("=", 1)[0]
        if not key.startswith("algo.") or key.split(".", 1)[1] in _algo_keys(algo):
            out.append(override)
    return out


def lever_blocked(rows: list[dict], overrides: list[str]) -> str | None:
    """Why a lever cannot run after this preflight (it asks for flex attention, which failed), or ``None``."""
    flex_failed = any(row.get("failed") and "flex" in row["check"] for row in rows)
    if flex_failed and any(marker in o for o in overrides for marker in FLEX_OVERRIDES):
        return "flex attention failed the preflight"
    return None
