"""What each ``auto`` speed option picks on a GPU and on a CPU, the measurement behind each choice, and the paths
built but not yet chosen.

An option left at ``auto`` (the output layer, the shared prompt, compilation, the decoding loop; for the non-finite
verdict and the loader's workers, left unset) takes its value
from :data:`CHOICES` for the device the run is on: the component that reads the option calls :func:`pick`. A GPU
choice is only ever a path that a GPU run measured: each names its ``evidence``, a dated page of the GPU check
(``benchmarks/gpu_check``, whose levers time each option against the defaults and whose page says which choice each
lever supports). A path built since but not yet measured on a GPU (the Triton output layer, compiled layers, the
compiled static-cache decoder, the verdict kept on the device, collating workers) is ``untried``: available by its override, named on the start-up line, and chosen by
``auto`` only once a page of the GPU check shows it correct and faster in every round; that is a one-line change
here, with the page. :func:`describe` writes the start-up line, so a run says on what grounds it is configured the
way it is and what it could turn on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NOT_MEASURED = "not measured on a GPU yet"
# The GPU page every current GPU choice stands on: its cases ran uncompiled, decoding with transformers' generate,
# the output layer's log-probabilities computed with torch operations (before the Triton kernel, compiled layers and
# the static decoder existed).
H200_PAGE = "docs/gpu/2026-11-27-nvidia-h200-second-run.md"


@dataclass(frozen=True)
class Untried:
    """A path built but not measured on a GPU: ``value`` of the option, and what it is (``what``)."""

    value: Any
    what: str


@dataclass(frozen=True)
class AutoChoice:
    """``key`` (the config key, e.g. ``algo.fused_output_layer``) set to ``auto`` means ``gpu`` on a CUDA device
    and ``cpu`` elsewhere; ``evidence``: the GPU measurement behind ``gpu`` (a page under ``docs/gpu/``);
    ``cpu_evidence``: the one behind ``cpu``; ``untried``: a faster path built for the GPU but not measured there
    (``None``: none); ``auto_value``: the configured value that asks for the table's choice (``auto``, or ``None``
    for an option whose unset value does)."""

    key: str
    gpu: Any
    cpu: Any
    evidence: str
    cpu_evidence: str = "the CPU's choice"
    untried: Untried | None = None
    auto_value: Any = "auto"


CHOICES: dict[str, AutoChoice] = {c.key: c for c in (
    # Levers of the H200 page (100m, batch 64, 32 + 32 tokens, one round each; the page finds single rounds of that
    # pair not reproducible, within about 50%).
    AutoChoice("algo.fused_output_layer", gpu=True, cpu=False,
               evidence=f"computed with torch operations, the plain layer ran 0.66x the speed at 1.18x the memory "
                        f"({H200_PAGE}, one round at 32 + 32 tokens)",
               untried=Untried("triton", "the output layer's Triton kernel")),
    AutoChoice("algo.shared_prompt", gpu=True, cpu=True,
               evidence=f"two sequences a pair ran 0.79x the speed at 1.18x the memory ({H200_PAGE}, one round at "
                        "32 + 32 tokens)"),
    AutoChoice("hardware.compile", gpu=False, cpu=False,
               evidence=f"every case of {H200_PAGE} ran uncompiled",
               cpu_evidence="compiling measured slower to start than it saves",
               untried=Untried("layers", "each decoder layer compiled")),
    AutoChoice("algo.generation", gpu="transformers", cpu="transformers",
               evidence=f"every case of {H200_PAGE} decoded with transformers' generate",
               cpu_evidence="the static decoder compiled by inductor sampled 1.04-1.16x generate's speed after a "
                            "31-35 s compile, 60-step GRPO runs 1.3x longer (benchmarks/cpu_decoding.py, 1 thread)",
               untried=Untried("static", "the static-cache decoder, its step compiled into CUDA graphs")),
    AutoChoice("train.nonfinite_on_device", gpu=False, cpu=False, auto_value=None,
               evidence=f"every case of {H200_PAGE} read the non-finite verdict every step",
               cpu_evidence="read every step",
               untried=Untried(True, "the non-finite verdict kept on the device, read at the log window")),
    AutoChoice("data.num_workers", gpu=0, cpu=0, auto_value=None,
               evidence=f"every case of {H200_PAGE} collated its batches in the main process",
               cpu_evidence="a worker would take a core from the step's threads",
               untried=Untried(2, "2 worker processes collating ahead of the step")),
)}


def pick(key: str, device_type: str) -> Any:
    """What ``key=auto`` means on a device of ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    choice = CHOICES[key]
    return choice.gpu if device_type == "cuda" else choice.cpu


def untried_line(keys: list[str]) -> str:
    """The start-up words on the GPU paths of ``keys`` built but not chosen: what each is and the override that turns
    it on (empty when none)."""
    shown = [f"{CHOICES[k].untried.what} ({k}={_shown(CHOICES[k].untried.value)})" for k in keys
             if CHOICES[k].untried is not None]
    if not shown:
        return ""
    return ("available on a GPU but not chosen by auto until a GPU check measures them (benchmarks/gpu_check.sh): "
            + "; ".join(shown))


def describe(keys: list[str], device_type: str) -> str:
    """One start-up line: what each of ``keys`` (options set to ``auto``) picked on this device and why, and on a
    GPU the paths built but not yet chosen (:func:`untried_line`)."""
    parts = []
    for key in keys:
        choice = CHOICES[key]
        why = choice.evidence if device_type == "cuda" else choice.cpu_evidence
        parts.append(f"{key}={_shown(pick(key, device_type))} ({why})")
    line = "auto options on this device: " + "; ".join(parts)
    untried = untried_line(keys) if device_type == "cuda" else ""
    return f"{line}. {untried[0].upper()}{untried[1:]}" if untried else line


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
