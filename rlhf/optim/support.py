"""What each optimizer library can do here: the extra that installs it, and the strategies it can run under.

A sharded strategy hands the optimizer pieces of each tensor: FSDP2 its row shard (a DTensor), DeepSpeed ZeRO flat
float32 partitions of all of them. An optimizer whose update reads a tensor's shape or statistics over a whole tensor
(factored moments, low-rank projections, Kronecker preconditioners, per-head blocks, 8-bit blocks laid over each
tensor, a step size from sums over every parameter) would apply another rule there without a word (DeepSpeed#8441,
verl fork #91), so the config check refuses it before anything loads (:func:`sharding_refusal`). The refusal is
decided by the class and its bases, not by the name a YAML gives it: ``bitsandbytes.optim.AdamW8bit`` in a user's
own option is refused as ``optimizer=adam8bit`` is. Element-wise optimizers (torch's AdamW and SGD, lion-pytorch's
Lion) run sharded and are compared with DDP by tests/optim/test_strategies.py, which also runs the refused
bitsandbytes and Adafactor options there with the check bypassed: under FSDP2 their kernels raise on DTensor shards,
under ZeRO their parameters differ from DDP's.
"""

from __future__ import annotations

import inspect

# The optimizer libraries of the [optimizers] extra: a top-level module -> the requirement pyproject.toml pins.
EXTRAS: dict[str, str] = {
    "schedulefree": "schedulefree>=1.4",
    "heavyball": "heavyball>=3.2,<3.3",
    "prodigyopt": "prodigyopt>=1.1",
    "adam_mini": "adam-mini>=1.1",
    "apollo_torch": "apollo-torch>=1.0.3",
}

_BNB = ("runs bitsandbytes' kernels on plain tensors (FSDP2's DTensor shards raise inside them) and, in 8 bits, "
        "quantizes its states in blocks laid over each whole tensor (ZeRO's flat partitions move the blocks; its "
        "32-bit classes are refused too, untested there)")
# A class's "module.Qualname", or a module prefix ending in "." (every class defined below it) -> why it is refused
# under hardware=fsdp and zero1-3. This project's own classes say it themselves: a ``whole_matrices`` attribute.
UNSHARDED: dict[str, str] = {
    "bitsandbytes.optim.": _BNB,
    "transformers.optimization.Adafactor": ("factors each matrix's second moment into the means of its whole rows and "
                                            "columns (Shazeer & Stern 2018, arXiv:1804.04235)"),
    "torch.optim.Muon": "orthogonalizes each matrix whole (Newton-Schulz on the full matrix)",
    "heavyball.": "preconditions or reshapes each whole tensor (SOAP's eigenbases, PSGD's Kronecker factors)",
    "prodigyopt.": "estimates its step size from sums over every parameter of the model",
    "adam_mini.": "keeps one second moment per row, head or tensor of each whole matrix, found by its shape",
    "apollo_torch.": "projects each whole matrix's gradient to a low rank (an SVD or a random matrix of its shape)",
}
# The same, refused under zero1-3 only (FSDP2 steps the model's own parameters).
NOT_UNDER_ZERO: dict[str, str] = {
    "schedulefree.": ("keeps training and evaluation weights that it swaps in the model's parameters (schedule-free), "
                      "and ZeRO steps float32 copies of them, which the swap never reaches"),
    "rlhf.run.optimizer_modes.schedule_free_adamw": ("keeps training and evaluation weights that it swaps in the "
                                                     "model's parameters (schedule-free), and ZeRO steps float32 "
                                                     "copies of them, which the swap never reaches"),
}


def _names(target: str, obj: object) -> list[str]:
    """``target`` and, for a class, the "module.Qualname" of it and each of its bases."""
    names = [target]
    if inspect.isclass(obj):
        names += [f"{cls.__module__}.{cls.__qualname__}" for cls in inspect.getmro(obj)]
    return names


def _lookup(table: dict[str, str], names: list[str]) -> str | None:
    for name in names:
        for key, reason in table.items():
            if name == key or (key.endswith(".") and name.startswith(key)):
                return reason
    return None


def sharding_refusal(target: str, obj: object, zero: bool = True) -> str | None:
    """Why the optimizer ``target`` (the object it names, ``obj``) cannot run under a sharded strategy (DeepSpeed
    ZeRO where ``zero``, else FSDP2), or None: the object's ``whole_matrices`` (True or the reason), else the first
    entry of :data:`UNSHARDED` (and, under ZeRO, :data:`NOT_UNDER_ZERO`) that names it or one of its bases."""
    own = getattr(obj, "whole_matrices", False)
    if own:
        return own if isinstance(own, str) else "orthogonalizes each hidden matrix whole (Newton-Schulz on the full matrix)"
    names = _names(target, obj)
    return _lookup(UNSHARDED, names) or (_lookup(NOT_UNDER_ZERO, names) if zero else None)


def missing_library(module: str, what: str) -> str | None:
    """The error for an optimizer library of the ``[optimizers]`` extra that is not installed (``module``: its top-level
    name), naming the option that needs it and the command that installs it; None for other modules."""
    requirement = EXTRAS.get(module)
    if requirement is None:
        return None
    return (f"{what} needs the package {requirement.split('>')[0].split('=')[0]}, which is not installed. Fix: "
            f"pip install 'rlhf[optimizers]'  (or: pip install '{requirement}')")

