"""An optimizer's state in bytes: counted on a running optimizer, and predicted before the run by stepping the
configured optimizer once on probes shaped like the model's trainable tensors.

Optimizers differ in what they keep per parameter, and for several the amount depends on the tensor's shape and
role, not only on its size: SOAP keeps two eigenbases per matrix (rows² + columns², capped by its largest
preconditioned dimension), Adam-mini one second moment per block (a row, a head, a neuron), GaLore and APOLLO their
moments in rank r, 8-bit optimizers uint8 states with float32 block maxima and a 256-entry code book per tensor, Muon a
momentum for the hidden matrices and AdamW's two moments for the rest. The prediction therefore steps the optimizer
once on one tensor per distinct shape in each part of the run's partition (:class:`rlhf.optim.partition.Split`),
with that part's group settings, and multiplies each probe's state by the number of tensors of its shape: the same
count as the run's optimizer holds after its first step, without a second copy of the model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from rlhf.optim import set_run_length

log = logging.getLogger(__name__)

PROBE_SHAPE = (256, 256)  # a matrix above bitsandbytes' min_8bit_size (4096), so 8-bit states are 8-bit
MAX_PROBE_NUMEL = 2**25  # a probe above this (128 MiB in float32) is scaled down, keeping its aspect


def tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor of more than zero dimensions in ``value`` (dicts, lists and tuples walked; a tensor met
    twice counted once; a view counts its own elements, not the storage it views). Scalars (step counts,
    learning-rate estimates) are left out: a few bytes per tensor."""
    seen = set() if seen is None else seen
    if torch.is_tensor(value):
        if callable(getattr(value, "to_local", None)):  # a DTensor (FSDP2): the shard this process holds
            value = value.to_local()
        if value.dim() == 0 or value.device.type == "meta":
            return 0
        key = (value.data_ptr(), value.numel(), value.dtype)
        if key in seen:
            return 0
        seen.add(key)
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes an optimizer holds in its state (``optimizer.state``, every nested tensor once), below any wrapper
    (Accelerate's, DeepSpeed's) that keeps it in an ``optimizer`` attribute."""
    seen_wrappers = {id(optimizer)}
    while (inner := getattr(optimizer, "optimizer", None)) is not None and id(inner) not in seen_wrappers:
        seen_wrappers.add(id(inner))
        optimizer = inner
    return tensor_bytes(dict(optimizer.state))


def held_against_predicted(optimizer: torch.optim.Optimizer, predicted: int | None) -> tuple[dict, str]:
    """The state ``optimizer`` holds now beside the preflight's ``predicted`` bytes (None: not predicted), in MB, as
    ``summary.json``'s ``memory_held_mb`` and as the run's last memory line says it."""
    held = state_bytes(optimizer) / 2**20
    expected = None if predicted is None else predicted / 2**20
    said = "none" if expected is None else f"{expected:.1f} MB"
    return ({"optimizer_state": held, "optimizer_state_predicted": expected},
            f"optimizer state {held:.1f} MB held against {said} predicted")


def _probe_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape``, or, above :data:`MAX_PROBE_NUMEL` elements, a smaller one (so that a model built on the meta device
    is predicted without allocating its largest tensor): fewer rows, a divisor of the rows (so that rows made of
    heads stay whole heads, as Adam-mini reads them), or, where one row alone is too large, every dimension scaled
    by the same factor."""
    numel = math.prod(shape)
    if numel <= MAX_PROBE_NUMEL:
        return shape
    row = numel // shape[0]
    most = MAX_PROBE_NUMEL // row
    for rows in range(most, max(most // 64, most - 10_000, 0), -1):  # a divisor near the most rows that fit
        if len(shape) > 1 and shape[0] % rows == 0:
            return (rows, *shape[1:])
    scale = (MAX_PROBE_NUMEL / numel) ** (1 / len(shape))
    return tuple(max(1, int(d * scale)) for d in shape)


def _step(optimizer: torch.optim.Optimizer, probes: list[torch.Tensor]) -> None:
    set_run_length(optimizer, 1)  # a field that is the run's length (AdEMAMix's warmups): any length, for one step
    for probe in probes:
        probe.grad = torch.full_like(probe, 1e-3)
    optimizer.step()


def _one_matrix(make_optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype) -> float:
    probe = torch.nn.Parameter(torch.full(PROBE_SHAPE, 1e-2, dtype=dtype))
    optimizer = make_optimizer([probe])
    _step(optimizer, [probe])
    return state_bytes(optimizer) / probe.numel()


def _by_shape(make_optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype, split: Any) -> float:
    groups, weights, total = [], [], 0
    for part in split.parts:
        shapes: dict[tuple[int, ...], list[int]] = {}  # shape -> indices of the part's tensors of that shape
        for i, param in enumerate(part.params):
            shapes.setdefault(tuple(param.shape), []).append(i)
            total += param.numel()
        group = part.group()
        probes = []
        for shape, indices in shapes.items():  # not zero: Prodigy keeps its copy of all-zero initial weights as a scalar
            probe = torch.nn.Parameter(torch.full(_probe_shape(shape), 1e-2, dtype=dtype))
            probes.append(probe)
            weights.append((probe, sum(part.params[i].numel() for i in indices) / probe.numel()))
        group["params"] = probes
        groups.append(group)
    optimizer = make_optimizer(groups, **split.options)
    _step(optimizer, [probe for probe, _ in weights])
    inner = optimizer
    while getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer
    held = sum(tensor_bytes(inner.state.get(probe, {})) * weight for probe, weight in weights)
    shared = tensor_bytes({k: v for k, v in inner.state.items() if not isinstance(k, torch.Tensor)})
    return (held + shared) / max(1, total)


def bytes_per_parameter(make_optimizer: Callable[..., torch.optim.Optimizer], dtype: torch.dtype = torch.float32,
                        split: Any = None) -> float | None:
    """State bytes per trainable parameter element of the optimizer ``make_optimizer`` builds (a
    ``conf/optimizer`` partial), measured by one step on probes: with ``split`` (the run's partition of the model),
    one tensor per distinct shape in each part, built with the part's group settings and the split's ``options``
    and weighted by how many tensors have that shape; without, one :data:`PROBE_SHAPE` matrix. A probe that fails
    is said at start-up: shaped probes fall back to the one matrix, and an optimizer that cannot step on CPU
    tensors of ``dtype`` at all (CUDA-only kernels) gives ``None``: its state is not counted."""
    name = getattr(make_optimizer, "func", make_optimizer)
    name = f"{getattr(name, '__module__', '')}.{getattr(name, '__qualname__', name)}"
    if split is not None and any(part.params for part in split.parts):
        try:
            return _by_shape(make_optimizer, dtype, split)
        except Exception as error:
            log.warning("memory preflight: %s could not step on probes shaped like the model's tensors (%s: %s); "
                        "its state is estimated from one %dx%d matrix instead", name, type(error).__name__, error,
                        *PROBE_SHAPE)
    try:
        return _one_matrix(make_optimizer, dtype)
    except Exception as error:  # e.g. an optimizer with CUDA-only kernels
        log.warning("memory preflight: %s cannot step on a CPU tensor of %s (%s: %s); its state is not counted in "
                    "the prediction", name, dtype, type(error).__name__, error)
        return None
