"""When bf16 hides a run's updates from its forward pass: steps until a typical weight's bf16 value changes.

A run that computes in bf16 (:func:`rlhf.hardware.precision.computes_in_bf16`) keeps float32 weights and rounds each
to bf16 for the forward pass. bf16 has 8 significant bits: a weight ``w`` with ``2^e <= |w| < 2^(e+1)`` lies on a grid
of spacing ``2^(e-7)``, and an update smaller than half of it (:func:`half_bf16_step`, about ``|w| * 2^-9``) leaves
the forward pass unchanged until updates add up past it. At DPO's usual lr 5e-7 (Adam: a step of about lr per weight)
a weight of 0.02 (half a step: 2^-14) needs some 120 steps before the forward pass sees it move, and learning rates compared inside that
regime compare little. :class:`Bf16Watch` measures it on the run's own first step (:func:`typical`), logs it, and
warns where the run is too short for it.

Here, not in ``rlhf.hardware``: a figure the run reports about itself (logged, in ``metrics.jsonl`` and
``summary.json``), measured after a step like the peak memory; the precision it reads is the hardware strategy's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlhf.hardware.precision import computes_in_bf16

log = logging.getLogger(__name__)

METRIC = "train/bf16_steps_to_visible"  # in metrics.jsonl and summary.json's final metrics (rlhf.sweeps.bf16_note reads it)
SAMPLE_PER_TENSOR = 4096  # elements sampled of each tensor: a few MB and milliseconds for a model of any size
WARN_FACTOR = 4  # a run shorter than this many times the estimate is warned of (a typical weight's bf16 value
# changes fewer than this many times over the whole run, even at the peak learning rate)
MAX_TRIES = 10  # steps with a learning rate above 0 that changed none of the sampled weights (skipped): then give up
FIX = "hardware.mixed_precision=no"
# DeepSpeed's float32 master partitions (ZeRO stages 1-2, stage 3, its bf16 optimizer), as rlhf.hardware.zero reads them
DEEPSPEED_MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def half_bf16_step(weights: torch.Tensor) -> torch.Tensor:
    """Half the spacing of the bf16 numbers at each weight's magnitude: ``2^(e-8)`` for ``2^e <= |w| < 2^(e+1)``
    (1.0 -> 2^-8, 0.02 -> 2^-14), from the exponent exactly; at 0 and below bf16's smallest normal number (2^-126),
    half its subnormal spacing, 2^-134. Float32."""
    magnitude = weights.detach().float().abs().clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.frexp(magnitude).exponent  # |w| = m * 2^E with 0.5 <= m < 1: E = e + 1
    return torch.ldexp(torch.ones_like(magnitude), exponent - 9)


def steps_to_visible(before: torch.Tensor, after: torch.Tensor, lr_scale: float = 1.0) -> torch.Tensor:
    """Per element, the steps of this size before the forward pass sees the weight move: half a bf16 step at the
    weight (:func:`half_bf16_step` of ``before``) over the update's size (``|after - before|`` times ``lr_scale``,
    e.g. the peak learning rate over the step's); ``inf`` where the update is 0 (frozen, no gradient), below 1 where
    one step is seen at once."""
    update = (after.detach().float() - before.detach().float()).abs() * lr_scale
    return half_bf16_step(before) / update


class Sample(NamedTuple):
    """Some elements of one tensor, before and after a step; each stands for ``stands_for`` elements of it."""

    before: torch.Tensor
    after: torch.Tensor
    stands_for: float = 1.0
    lr_scale: float = 1.0  # the update's factor (the peak learning rate over the step's)


@dataclass(frozen=True)
class Visibility:
    """What :func:`typical` found."""

    steps: float  # the median over the weights counted (by the elements they stand for) of steps_to_visible
    at_once: float  # the share of them that moved half a bf16 step or more in one step (visible at once)
    sampled: int  # elements sampled and counted: those of every tensor that moved (a still one among them: hidden)
    still: int  # elements sampled of tensors that did not move at all (no gradient yet: a LoRA A at step 1): left out


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> float:
    """The smallest value at which the weights of the values at or below it reach half of all weights (values of
    weight 0 take no part)."""
    order = torch.argsort(values)
    cumulative = weights[order].double().cumsum(0)
    index = int(torch.searchsorted(cumulative, cumulative[-1] / 2))
    return float(values[order[min(index, len(values) - 1)]])


def typical(samples: Iterable[Sample]) -> Visibility | None:
    """The steps until a typical weight's bf16 value changes: :func:`steps_to_visible` of the sampled elements of
    every tensor that moved, their median counted by the elements each stands for. An element that did not move in a
    tensor that did counts as hidden (``inf``: an update below float32's resolution at the weight, or no gradient
    this step); a tensor none of whose sampled elements moved is left out (no gradient yet). None when nothing moved.
    (No boolean indexing: elements left out count 0, which keeps a 135M-parameter model's sample to some 0.2 s.)"""
    ratios, weights = [], []
    for sample in samples:
        steps = steps_to_visible(sample.before, sample.after, sample.lr_scale).reshape(-1).cpu()
        ratios.append(steps)
        moved = bool(torch.isfinite(steps).any())
        weights.append(torch.full_like(steps, float(sample.stands_for) if moved else 0.0, dtype=torch.float64))
    values = torch.cat(ratios) if ratios else torch.empty(0)
    counts = torch.cat(weights) if weights else torch.empty(0, dtype=torch.float64)
    moved = int(torch.count_nonzero(counts))
    if moved == 0:
        return None
    at_once = float(torch.where(values <= 1, counts, 0.0).sum() / counts.sum())
    return Visibility(weighted_median(values, counts), at_once, moved, values.numel() - moved)


def sample_indices(numel: int, size: int, seed: int) -> torch.Tensor | None:
    """``size`` positions of a flat tensor of ``numel`` elements, drawn (with replacement, sorted) from a generator
    of its own (the run's random numbers stay untouched); None: all of them (``numel <= size``)."""
    if numel <= size:
        return None
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(numel, (size,), generator=generator).sort().values


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The elements this process holds: its shard of an FSDP2 parameter (a DTensor), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Bf16Watch:
    """Samples the float32 weights a run rounds to bf16 before a step and measures the update after it, on the
    first step whose learning rate is above 0 (a warmup's first step has none); then logs the figure, records it
    (:data:`METRIC`) and warns where ``max_steps`` is shorter than :data:`WARN_FACTOR` times it. ``tensors``: each
    float32 tensor with its optimizer parameter group (its learning rate). Empty: it does nothing."""

    def __init__(self, tensors: list[tuple[torch.Tensor, dict]], max_steps: int, main: bool = True,
                 per_tensor: int = SAMPLE_PER_TENSOR) -> None:
        self.tensors, self.max_steps, self.main, self.tries = tensors, max_steps, main, 0
        self.indices = [sample_indices(_local(t).numel(), per_tensor, seed) for seed, (t, _) in enumerate(tensors)]
        self.indices = [None if index is None else index.to(_local(t).device)  # once: a copy to a GPU waits for it
                        for index, (t, _) in zip(self.indices, tensors)]
        self.done = not tensors
        if not self.done:
            self._snapshot()

    def _sample(self, number: int) -> torch.Tensor:
        flat = _local(self.tensors[number][0]).detach().reshape(-1)
        index = self.indices[number]
        return flat.float().clone() if index is None else flat.index_select(0, index).float()

    def _snapshot(self) -> None:
        """The samples and learning rates before the coming step."""
        self.before = [self._sample(i) for i in range(len(self.tensors))]
        self.lrs = [float(group["lr"]) for _, group in self.tensors]

    def after_step(self, step: int, record: Callable[[dict[str, float], int], None]) -> Visibility | None:
        """Call after each optimizer step (``step``: its number); measures once, then does nothing: at the first
        step whose learning rate is half its peak or more (a warmup's early steps move the weights so little that
        float32 rounds their updates coarsely), or the run's last step with a learning rate above 0."""
        if self.done:
            return None
        peaks = [float(group.get("initial_lr", lr)) for (_, group), lr in zip(self.tensors, self.lrs)]
        low = any(2 * lr < peak for lr, peak in zip(self.lrs, peaks))
        if not any(self.lrs) or (low and step < self.max_steps):  # e.g. within a warmup: a later step is measured
            self._snapshot()
            return None
        result = typical(Sample(before, self._sample(i), _local(t).numel() / max(1, before.numel()),
                                float(group.get("initial_lr", lr)) / lr)
                         for i, (before, (t, group), lr) in enumerate(zip(self.before, self.tensors, self.lrs)) if lr)
        if result is None:  # a skipped step (not finite): the next one
            self.tries += 1
            self.done = self.tries >= MAX_TRIES
            self._snapshot()
            return None
        self.done, self.before = True, []
        record({METRIC: result.steps}, step)
        if self.main:
            report(result, step, self.max_steps)
        return result


def report(result: Visibility, step: int, max_steps: int) -> None:
    """The info line, and the warning where a run of ``max_steps`` steps is shorter than :data:`WARN_FACTOR` times
    the estimate."""
    how = (f"the median over {result.sampled:,} sampled weights of half a bf16 step at the weight over its update at "
           f"step {step}, scaled to the peak learning rate; {result.at_once:.0%} of them move that far in one step")
    log.info("bf16: a typical weight that trains needs %s optimizer step(s) at the peak learning rate before its bf16 "
             "value, the one the forward pass computes with, changes (%s)", _steps(result.steps), how)
    if max_steps < WARN_FACTOR * result.steps:
        log.warning("bf16 hides this run's updates from its forward pass: a typical weight needs %s optimizer steps "
                    "at the peak learning rate before its bf16 value changes, and the run has %d (a typical weight's "
                    "bf16 value changes about %.2g time(s) over the whole run). The learning rate then barely "
                    "changes what the forward pass sees, and runs that differ only in it compare little. Fix: %s "
                    "(the forward pass in float32)", _steps(result.steps), max_steps, max_steps / result.steps, FIX)


def _steps(value: float) -> str:
    if math.isinf(value):  # most sampled weights did not move at all: updates below float32's resolution there
        return "more than any run's (most of its updates fall below float32's resolution at the weight)"
    return "under 0.01" if value < 0.01 else f"{value:.2g}" if value < 10 else f"{value:,.0f}"


def watch(strategy: Any, model: Any, optimizer: Any, max_steps: int, last: dict | None = None) -> Bf16Watch:
    """The :class:`Bf16Watch` of a run that computes in bf16, over what its optimizer updates (only the trainable
    parameters: a LoRA adapter's; this process's shards under FSDP2; DeepSpeed's float32 master partitions under
    ZeRO) that the forward pass rounds to bf16: the matrices (autocast rounds the weights of matrix products; norms
    and biases stay float32). Weights stored in bf16 (``model.dtype=bfloat16``) are left out: their updates below
    half a step are rounded away, not delayed. One that does nothing where the run computes in float32, or where its
    latest metrics (``last``: a resumed run's, from its checkpoint) hold the figure already."""
    parameters = list(strategy.unwrap(model).parameters())
    dtype = next((str(p.dtype).removeprefix("torch.") for p in parameters if p.requires_grad), "float32")
    main = bool(getattr(strategy.accelerator, "is_main_process", True))
    if METRIC in (last or {}) or not computes_in_bf16(strategy.mixed_precision, dtype):
        return Bf16Watch([], max_steps, main)
    own = {id(p) for p in parameters}
    own -= {id(p) for p in parameters if p.dim() < 2}  # norms and biases: float32 under autocast
    own -= _lookups(strategy.unwrap(model))
    tensors = [(p, group) for group in optimizer.param_groups for p in group["params"]
               if id(p) in own and _local(p).dtype == torch.float32 and _local(p).numel()]
    if not tensors:  # ZeRO-3 empties its optimizer's groups between steps: DeepSpeed's float32 partitions then
        inner = getattr(model, "optimizer", None)  # (the groups differ in weight decay only: one learning rate)
        flat = next((getattr(inner, name) for name in DEEPSPEED_MASTERS if getattr(inner, name, None)), [])
        tensors = [(t, optimizer.param_groups[0]) for t in flat if t.dtype == torch.float32 and t.numel()]
    if not tensors and main:
        log.info("bf16: the weights that train are stored in bf16 (or none is a float32 matrix): not measured how "
                 "many steps bf16 hides their updates from the forward pass")
    return Bf16Watch(tensors, max_steps, main)


def _lookups(model: Any) -> set[int]:
    """The input embedding's weight where it is only looked up (autocast rounds the weights of matrix products, not
    a lookup's rows); where the output layer shares it, it is a matrix product's weight too, and stays."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    try:
        inputs = get_in() if callable(get_in) else None
        outputs = get_out() if callable(get_out) else None
    except (AttributeError, NotImplementedError):
        return set()
    weight = getattr(inputs, "weight", None)
    if weight is None or weight is getattr(outputs, "weight", None):
        return set()
    return {id(weight)}
