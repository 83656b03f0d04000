"""The GPU check's preflight: each GPU path of the package tried once on a small input at the start of every call,
against a reference (:mod:`gpu_check.sections.probes`), in seconds, before a pair is timed with it.

A probe is ``(name, run, path)``: ``run(device)`` returns a summary of what it compared, or raises where the path
gives other numbers than its reference; ``path`` is the ``key=value`` override that turns the path on. A path that
fails is not measured in this call: the levers that ask for it are skipped (:func:`lever_blocked`), and where
``auto`` chooses it on a GPU (``rlhf.core.auto_choices.CHOICES``) it is turned off for every run of ours by its
named override (:data:`TURN_OFF`: :func:`fallback_overrides`), and the page says so: our side then runs without it
rather than failing in every pair.

The real probes run side by side, each in a process of its own (:mod:`gpu_check.workers.isolated`), on a GPU and in
the CPU's rehearsal alike (there at sizes a CPU runs in seconds, the Triton kernel under Triton's interpreter where
``triton`` imports); a probe during which torch's compiler hit its recompile limit fails
(:mod:`gpu_check.recompiles`).
"""

from __future__ import annotations

import time
import traceback

import bench  # benchmarks/bench.py
import yaml

from gpu_check.recompiles import RecompileWatch
from gpu_check.sections import probes as checks
from gpu_check.state import last_line
from gpu_check.workers import isolated

PROBES = [  # (name, run, the path it checks as the override that turns it on)
    ("the output layer's Triton kernel = float64 (values, gradients)", checks.triton_output_layer,
     "algo.fused_output_layer=triton"),
    ("compiled decoder layers = eager (loss, gradients)", checks.compiled_layers, "hardware.compile=layers"),
    ("pairs packed under flex attention with layout_masks' block mask = sdpa with its dense mask",
     checks.flex_layout, "model.attn_implementation=flex_attention"),
    ("static decoding = transformers' generate, token for token (greedy; sampled, one seed)",
     checks.static_decoding, "algo.generation=static"),
]
# The override that turns an auto option's GPU choice off, should the preflight fail that choice's path
TURN_OFF = {"algo.fused_output_layer": "algo.fused_output_layer=true", "hardware.compile": "hardware.compile=false",
            "algo.generation": "algo.generation=transformers"}
FLEX_OVERRIDES = ("flex_attention", "padding_free=true")  # a lever asking for flex attention
# Where scripts/setup.sh installs triton for the CPU's tests (outside the environment: a CPU build of torch imports a
# triton it finds in every process): the Triton probe's process on a CPU runs the kernel under Triton's interpreter
TRITON_SITE = bench.ROOT / ".venv" / "triton"
PROBE_TIMEOUT_S = 150.0  # all the probes together (they run side by side, each in its own process)

CALL_ROWS: list[dict] = []  # this call's rows (set by gpu_check.main): their fallbacks reach every run of ours


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def chosen_by_auto(path: str) -> str | None:
    """The override that turns ``path`` (``key=value``) off where it is what ``auto`` picks on a GPU, else ``None``."""
    from rlhf.core.auto_choices import CHOICES

    key, value = path.split("=", 1)
    choice = CHOICES.get(key)
    return TURN_OFF.get(key) if choice is not None and _shown(choice.gpu) == value else None


def _cpu_env(run) -> dict[str, str]:
    """What a probe's process needs on a CPU: Triton's interpreter for the Triton kernel."""
    if run is not checks.triton_output_layer:
        return {}
    import os

    path = os.environ.get("PYTHONPATH")
    return {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(TRITON_SITE), *([path] if path else [])])}


def preflight(device: str, probes: list | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """Each probe of ``probes`` (default :data:`PROBES`) on ``device``: ``{"check", "value", "ok", "path",
    "override"}`` rows, ``"failed": True`` on those that raised (``ok`` None where a probe's package does not import
    on a CPU: not run there).

    :data:`PROBES` run side by side, each in a process of its own, all stopped ``timeout_s`` after the start: a probe
    that breaks the CUDA context, crashes its compiler or hangs fails its own row and leaves this process's device
    untouched. Other ``probes`` (the tests' fakes) run here, one by one, torch's recompile limit watched."""
    started = time.perf_counter()
    calls = {name: isolated.Call(f"gpu_check.sections.probes:{run.__name__}", [device],
                                 env=_cpu_env(run) if device != "cuda" else None)
             for name, run, _ in PROBES} if probes is None else {}
    rows = []
    for name, run, path in PROBES if probes is None else probes:
        check = f"preflight: {name}"
        began = calls[name].started if name in calls else time.perf_counter()
        try:
            if name in calls:
                said = calls[name].result(started + timeout_s - time.perf_counter())
            else:
                with RecompileWatch(name):
                    said = run(device)
        except Exception as error:  # noqa: BLE001  (the finding is the row; the check goes on without it)
            traceback.print_exc()
            if device != "cuda" and (isinstance(error, checks.Unavailable) or "Unavailable: " in str(error)):
                rows.append({"check": check, "value": f"not run on this CPU: {last_line(error)}", "ok": None,
                             "path": path, "override": None})
                continue
            override = chosen_by_auto(path)
            then = f"turned off for this call: {override}" if override else f"levers asking for {path} skipped"
            rows.append({"check": check, "value": f"raised {last_line(error)}; {then}", "ok": False, "path": path,
                         "override": override, "failed": True})
            continue
        rows.append({"check": check, "value": f"ran ({time.perf_counter() - began:.1f} s): {said}", "ok": True,
                     "path": path, "override": None})
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
    """Why a lever cannot run after this preflight (it asks for a path that failed: its override, or flex attention
    by another option), or ``None``."""
    for row in rows:
        path = row.get("path")
        if not row.get("failed") or path is None:
            continue
        flex = path.endswith("=flex_attention")
        if path in overrides or (flex and any(marker in o for o in overrides for marker in FLEX_OVERRIDES)):
            return f"{path} failed the preflight"
    return None


def fallbacks(algo: str) -> list[str]:
    """This call's preflight fallbacks for a run of ``algo`` (:data:`CALL_ROWS`, :func:`fallback_overrides`)."""
    return fallback_overrides(CALL_ROWS, algo)


def algo_options(algo: str) -> dict:
    """The fallbacks of ``algo`` that are its own options (``algo.<key>=<value>``), as keyword arguments."""
    return {o.split("=", 1)[0][len("algo."):]: yaml.safe_load(o.split("=", 1)[1])
            for o in fallbacks(algo) if o.startswith("algo.")}
