"""What each ``auto`` speed option picks on a GPU and on a CPU, and the measurement behind each GPU choice.

An option left at ``auto`` (the output layer, the shared prompt, compilation, the decoding loop) takes its value
from :data:`CHOICES` for the device the run is on: the component that reads the option calls
:func:`pick`. Each GPU choice names what decided it (``evidence``): a dated page of the GPU check
(``benchmarks/gpu_check.py``, whose levers time each option against the defaults and whose page says which choice
each lever supports), or ``NOT_MEASURED`` where no GPU run has compared the option yet; the start-up lines print it
(:func:`describe`), so a run says on what grounds it is configured the way it is. Changing a GPU default is a
one-line change here, with the page that measured it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NOT_MEASURED = "not measured on a GPU yet"


@dataclass(frozen=True)
class AutoChoice:
    """``key`` (the config key, e.g. ``algo.fused_output_layer``) set to ``auto`` means ``gpu`` on a CUDA device
    and ``cpu`` elsewhere; ``evidence``: the measurement behind the GPU choice (:data:`NOT_MEASURED` where none)."""

    key: str
    gpu: Any
    cpu: Any
    evidence: str = NOT_MEASURED


CHOICES: dict[str, AutoChoice] = {c.key: c for c in (
    # Levers of docs/gpu/2026-11-27-nvidia-h200-second-run.md (100m, batch 64, 32 + 32 tokens, one round each; the
    # page finds single rounds of that pair not reproducible, within about 50%).
    AutoChoice("algo.fused_output_layer", gpu=True, cpu=False,
               evidence="its Triton kernel not measured on a GPU yet; against the torch tiles it replaced, the plain "
                        "layer ran 0.66x the speed at 1.18x the memory (docs/gpu/2026-11-27-nvidia-h200-second-run.md, "
                        "one round at 32 + 32 tokens)"),
    AutoChoice("algo.shared_prompt", gpu=True, cpu=True,
               evidence="two sequences a pair ran 0.79x the speed at 1.18x the memory "
                        "(docs/gpu/2026-11-27-nvidia-h200-second-run.md, one round at 32 + 32 tokens; the pairs packed "
                        "under flex attention not measured on a GPU yet)"),
    AutoChoice("hardware.compile", gpu="layers", cpu=False),  # CPU: compiling measured slower to start than it saves
    AutoChoice("algo.generation", gpu="static", cpu="transformers"),
)}


def pick(key: str, device_type: str) -> Any:
    """What ``key=auto`` means on a device of ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    choice = CHOICES[key]
    return choice.gpu if device_type == "cuda" else choice.cpu


def describe(keys: list[str], device_type: str) -> str:
    """One start-up line: what each of ``keys`` (options set to ``auto``) picked on this device, and why."""
    parts = []
    for key in keys:
        choice = CHOICES[key]
        value = pick(key, device_type)
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        why = choice.evidence if device_type == "cuda" else "the CPU's choice"
        parts.append(f"{key}={shown} ({why})")
    return "auto options on this device: " + "; ".join(parts)
