"""The memory preflight: what one process will hold while training, predicted before the first step, and the peak
measured after it (``perf/peak_mem_mb``).

Per process, in bytes: the policy's weights, its gradients (trainable parameters only), the optimizer's state (bytes
per trainable parameter measured by stepping the configured optimizer once on probes shaped like the model's
tensors, part by part of its partition: :mod:`rlhf.telemetry.optimizer_state`; so 8-bit states, SOAP's eigenbases
and a momentum-free SGD count what they are), the frozen models (the reference: what the
reference strategy left in ``algo.frozen``, counted after the hardware strategy placed it) and an activation
estimate. A sharding strategy divides what it shards by the number of processes (``strategy.sharded_state()``).
Everything here also works on a model built on the meta device, so that ``scripts/memory.py`` predicts for models
that do not fit this machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rlhf.hardware.holding import StoredPrecision, global_numel, local_numel
from rlhf.models.quantize import quantized_bytes
from rlhf.ops.linear_logps_torch import row_block, tile_shape
from rlhf.ops.output_layer import answers
from rlhf.telemetry import cgroups

MB = 2**20
AS_LOADED = StoredPrecision()  # the state stored as the model was loaded (data parallel)


@dataclass
class MemoryPlan:
    """Predicted bytes one process holds at its peak, by part."""

    weights: int
    gradients: int
    optimizer: int
    frozen: int
    activations: int
    held: tuple[str, ...] = ()  # what the frozen part holds, by name ("reference", "eval_reference", ...)
    master: int = 0  # of ``optimizer``: a float32 master copy of the weights (DeepSpeed's bf16), not the state
    state_known: bool = True  # False: the optimizer could not step on a probe, its state is not in ``optimizer``

    @property
    def optimizer_state(self) -> int | None:
        """The optimizer's own state (moments, preconditioners), without a master copy of the weights; None where
        it could not be predicted."""
        return self.optimizer - self.master if self.state_known else None

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in PARTS)

    def megabytes(self) -> dict[str, float]:
        """Each part in MB (``summary.json``'s ``memory_predicted_mb``)."""
        return {name: getattr(self, name) / 2**20 for name in PARTS}

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / MB:,.1f}" for name in PARTS)
        held = ", ".join(FROZEN_NAMES.get(name, name) for name in self.held)
        return f"memory per process, predicted: {self.total / MB:,.1f} MB = {parts} MB" + (
            f" (frozen: {held})" if held else "")


PARTS = ("weights", "gradients", "optimizer", "frozen", "activations")  # the byte counts of a MemoryPlan
FROZEN_NAMES = {"reference": "the reference", "eval_reference": "eval=generate's copy of the initial policy"}


def unique_tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """Parameters and buffers of ``module``, each once (tied weights are one parameter)."""
    yield from module.parameters()
    yield from module.buffers()


def held_bytes(tensors: Iterable[torch.Tensor], skip: set[int] | None = None) -> int:
    """Bytes this process stores of ``tensors`` (its shard of a sharded one); tensors whose id is in ``skip`` (e.g.
    layers a reference shares with the policy) are not counted."""
    return sum(local_numel(t) * t.element_size() for t in tensors if skip is None or id(t) not in skip)


def _config_value(config, names: tuple[str, ...], default):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return default


def activation_bytes(config, sequences: int, tokens: int, bytes_per_value: int, checkpointing: bool,
                     attention_bytes: int | None = None, output_layer: int | None = None) -> int:
    """An estimate of what the backward pass keeps for one micro-batch of ``sequences`` x ``tokens``.

    Per token and decoder layer, autograd keeps about ``12 h + 4 i`` values (h: hidden size, i: MLP width): the
    inputs of the two norms and of the projections, query/key/value, the attention output, and the four MLP
    intermediates of a gated MLP; eager attention adds the softmax's ``heads x tokens``. ``attention_bytes``, where
    given, replaces that term: what the attention keeps beyond it, in bytes per token and layer
    (:func:`rlhf.models.attention.kept_bytes`: torch's math kernel under bf16 keeps float32 scores and float32
    copies of query, key and value). This follows the accounting of Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1) without its dropout masks
    (dropout is off in preference training). Gradient checkpointing keeps one ``h`` per layer and recomputes one layer at a time.
    The logits add ``3 V`` float32 values per token (logits, their log-softmax, and its gradient); ``output_layer``,
    where given, replaces that term: what an output layer that answers with log-probabilities a tile at a time
    (:mod:`rlhf.ops.output_layer`) holds, in bytes (:func:`output_layer_bytes`)."""
    hidden = _config_value(config, ("hidden_size", "n_embd", "d_model"), 0)
    layers = _config_value(config, ("num_hidden_layers", "n_layer", "num_layers"), 0)
    heads = _config_value(config, ("num_attention_heads", "n_head"), 1)
    inner = _config_value(config, ("intermediate_size", "n_inner", "ffn_dim"), 4 * hidden)
    vocab = _config_value(config, ("vocab_size",), 0)
    per_layer = (12 * hidden + 4 * inner) * bytes_per_value
    if attention_bytes is not None:
        per_layer += attention_bytes
    elif getattr(config, "_attn_implementation", None) == "eager":
        per_layer += heads * tokens * bytes_per_value
    kept = (layers * hidden * bytes_per_value + per_layer) if checkpointing else layers * per_layer
    if output_layer is not None:
        return sequences * tokens * kept + output_layer
    return sequences * tokens * (kept + 3 * vocab * 4)


def output_layer_held(rows: int, vocab: int, width: int, device: torch.device, product_bytes: int, weight_bytes: int,
                      hidden_bytes: int, trains: bool, triton: bool) -> int:
    """Bytes an output layer that answers with token log-probabilities (:mod:`rlhf.ops.output_layer`) holds at its
    peak for ``rows`` positions of a ``[vocab, width]`` weight stored in ``weight_bytes`` per value, the hidden states
    in ``hidden_bytes``, the products in ``product_bytes`` (autocast's dtype, else the weight's). Both passes hold
    the weight in the products' dtype where that is not the weight's (autocast's copy); beyond it, the larger of

    - the forward pass: the logits of one block, with the Triton kernel (``triton``,
      :mod:`rlhf.ops.linear_logps_triton`) :func:`~rlhf.ops.linear_logps_torch.row_block` rows over the whole
      vocabulary in the products' dtype, with torch operations (:mod:`rlhf.ops.linear_logps_torch`) three float32
      tiles of :func:`~rlhf.ops.linear_logps_torch.tile_shape` (the logits, their exponentials, a product);
    - the backward pass: the logits of one block again (torch operations: two float32 tiles, the logits and their
      gradient, and in 16-bit products each tile's share of the weight's gradient, ``chunk x width``, before it is
      added), the hidden states' gradient (float32 with torch operations, the products' dtype with the kernel, then
      cast to the hidden states' dtype where that differs), and where the weight trains (``trains``) the float32
      accumulator of its gradient, all of it: with a float32 weight that accumulator becomes the weight's gradient,
      which the plan counts as well, on a step's first micro-batch, and is added into it on the others."""
    weight = vocab * width * product_bytes if product_bytes != weight_bytes else 0
    accumulator = vocab * width * 4 if trains else 0
    if triton:
        block = row_block(rows, vocab, device) * vocab * product_bytes
        hidden = rows * width * (product_bytes + (hidden_bytes if hidden_bytes != product_bytes else 0))
        return weight + block + hidden + accumulator
    tile_rows, chunk = tile_shape(rows, vocab, device)
    tile = tile_rows * chunk * 4
    shares = (chunk + tile_rows) * width * product_bytes if product_bytes != 4 else 0  # added into float32 sums
    hidden = rows * width * (4 + (hidden_bytes if hidden_bytes != 4 else 0))
    return weight + max(3 * tile, 2 * tile + shares + hidden + accumulator)


def output_layer_bytes(model: torch.nn.Module, device: torch.device, rows: int, product_bytes: int) -> int | None:
    """What ``model``'s output layer holds in a training step on ``device`` for ``rows`` positions
    (:func:`output_layer_held`) where it answers with token log-probabilities there, else ``None`` (it computes
    logits: :func:`activation_bytes` counts them). ``product_bytes``: the bytes of a value in the products' dtype
    (2 under bf16 autocast)."""
    if not answers(model, device):
        return None
    layer = model.get_output_embeddings()
    vocab, width = layer.weight.shape
    kernel_on = getattr(layer, "kernel_on", None)  # FusedOutputLayer: whether it runs the Triton kernel there
    return output_layer_held(rows, vocab, width, device, product_bytes, layer.weight.element_size(),
                             layer.weight.element_size(), layer.weight.requires_grad,
                             triton=bool(kernel_on(device)) if callable(kernel_on) else False)


def plan(weights: int, trainable: int, gradient_width: int, frozen: int, optimizer_bytes: float | None,
         sharded: frozenset[str], processes: int, activations: int, precision: StoredPrecision = AS_LOADED,
         parameters: int = 0) -> MemoryPlan:
    """The preflight's prediction for one process, from counts: the policy's ``weights`` in bytes (whole), its
    ``trainable`` parameter elements with gradients of ``gradient_width`` bytes, the ``frozen`` models' bytes on
    this process (already its share), the optimizer's bytes per trainable element, what the strategy splits over
    ``processes`` (``sharded``: of ``weights``, ``gradients``, ``optimizer``), and the activation estimate.
    ``precision``: how the strategy stores the state (e.g. DeepSpeed's bf16 weights of all ``parameters`` and a
    float32 master copy, which counts with the optimizer)."""
    def share(part: str, total: float) -> int:
        return int(total / processes) if part in sharded else int(total)

    if precision.weight_bytes is not None:
        weights, gradient_width = parameters * precision.weight_bytes, precision.weight_bytes
    optimizer = trainable * ((optimizer_bytes or 0.0) + precision.master_bytes)
    return MemoryPlan(weights=share("weights", weights), gradients=share("gradients", trainable * gradient_width),
                      optimizer=share("optimizer", optimizer), frozen=int(frozen),
                      activations=int(activations), master=share("optimizer", trainable * precision.master_bytes),
                      state_known=optimizer_bytes is not None)


def measured_plan(model: torch.nn.Module, frozen: dict[str, torch.nn.Module], optimizer_bytes: float | None,
                  sharded: frozenset[str], processes: int, activations: int,
                  precision: StoredPrecision = AS_LOADED) -> MemoryPlan:
    """:func:`plan` from the objects of a run: ``model`` the policy before the hardware strategy wrapped it,
    ``frozen`` the algorithm's frozen models as the strategy placed them (their local shards count; tensors shared
    with the policy do not)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    policy_ids = {id(t) for t in unique_tensors(model)}
    held = tuple(name for name, m in frozen.items() if m is not None)
    return dataclasses.replace(plan(weights=quantized_bytes(model),
                trainable=sum(global_numel(p) for p in trainable),
                gradient_width=trainable[0].element_size() if trainable else 0,
                frozen=sum(held_bytes(unique_tensors(m), skip=policy_ids) for m in frozen.values() if m is not None),
                optimizer_bytes=optimizer_bytes, sharded=sharded, processes=processes, activations=activations,
                precision=precision, parameters=sum(global_numel(p) for p in model.parameters())), held=held)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set size now."""
    now = _status_kib("VmRSS")
    return now * 1024 if now is not None else peak_resident_bytes()


def release_freed_memory() -> bool:
    """Collect garbage and hand the heap's free memory back to the system (glibc's ``malloc_trim``), so that a run's
    peak above its starting size does not depend on what an earlier run of the process left free in the heap (a
    sweep's in-process points). False where there is no glibc."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


def reset_peak_resident() -> bool:
    """Start the peak resident set size over from now (Linux: ``/proc/self/clear_refs``); False where the system
    does not allow it, and the peak then counts from the process's start."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int:
    """This process's highest resident set size since :func:`reset_peak_resident` (or since it started)."""
    peak = _status_kib("VmHWM")
    if peak is not None:
        return peak * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


_FIRST_SWEEP_POINT: list[int] = []  # [the size before this process's first sweep point, what that point left]


class PeakMemory:
    """The peak memory a run added, for ``perf/peak_mem_mb``: on a GPU torch's peak allocated bytes; on a CPU the
    peak resident set size of the process above its size when this object was made (before the model was built),
    the figure comparable with :class:`MemoryPlan`. Made again by each run of a process, it measures that run alone
    (the high-water mark starts over, after the heap's free memory went back to the system).

    ``sweep_point``: the run is one point of a sweep run in this process (Hydra's basic launcher), and is measured
    against its own size less what the first point left in the process for good (the second point's size less
    the first's: library code paged in, the tokenized data's cache): a later point then counts that once-only part
    as a point in a process of its own does (submitit, Slurm), and its figure does not depend on its place in the
    sweep; what later points leave behind is not added to the points after them."""

    def __init__(self, device: torch.device, sweep_point: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.start = 0
        else:
            release_freed_memory()
            reset_peak_resident()
            self.start = resident_bytes()
            if sweep_point:  # [size before the first point, what the first point left for good]
                if not _FIRST_SWEEP_POINT:
                    _FIRST_SWEEP_POINT.append(self.start)
                elif len(_FIRST_SWEEP_POINT) == 1:
                    _FIRST_SWEEP_POINT.append(max(0, self.start - _FIRST_SWEEP_POINT[0]))
                if len(_FIRST_SWEEP_POINT) == 2:
                    self.start -= _FIRST_SWEEP_POINT[1]

    def mb(self) -> float:
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else peak_resident_bytes()
        return max(0, peak - self.start) / MB


# Where the system's available memory is read (a module attribute, so that a test can point it at a fake file)
MEMINFO = "/proc/meminfo"


def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """How many more bytes this process can take now, and where the figure comes from: on a GPU the device's free
    memory (``torch.cuda.mem_get_info``); on a CPU the system's available memory (``MemAvailable``), or what the
    tightest memory cgroup's limit leaves (:func:`rlhf.telemetry.cgroups.cgroup_left`) where that is less. ``None`` where neither can be
    read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {torch.cuda.get_device_name(device)}"
    found: list[tuple[int, str]] = []
    try:
        with open(MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "the system's available memory"))
    except OSError:
        pass
    cgroup = cgroups.cgroup_left()
    if cgroup is not None:
        found.append((cgroup.left, cgroup.describe()))
    if not found:
        return None, ""
    return min(found)


def check_fits(memory: MemoryPlan, taken: int, available: int | None, where: str, sharers: int,
               fixes: list[str]) -> str | None:
    """The message when the predicted peak of one process (``memory``) does not fit, else None: ``taken`` bytes of
    it are held already (the model, built), ``available`` more can be had (:func:`available_bytes`, ``where`` it comes
    from; None: unknown, no message), shared by ``sharers`` processes of this machine (a CPU's memory; 1 on a GPU).
    The message names the largest part and ``fixes``, in the order to try them."""
    if available is None:
        return None
    can_have = taken + available // max(1, sharers)
    if memory.total <= can_have:
        return None
    largest = max(PARTS, key=lambda name: getattr(memory, name))
    shared = f", shared by {sharers} processes here" if sharers > 1 else ""
    return (f"memory per process, predicted {memory.total / MB:,.1f} MB, is more than this process can have: "
            f"{can_have / MB:,.1f} MB ({taken / MB:,.1f} MB held now and {available / MB:,.1f} MB more: {where}"
            f"{shared}). The largest part: {largest} {getattr(memory, largest) / MB:,.1f} MB. Fix, in order: "
            + "; ".join(fixes))
