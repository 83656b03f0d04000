"""The hot loop never waits for the device between log windows: the metrics, token counts, gradient norm and (with
an optimizer whose step takes the non-finite flag on the device) the skip-or-step verdict stay on the device.

Counted on the CPU as the calls that would make a GPU's host wait, made by the package's own code inside
:func:`rlhf.run.loop.train_step`, outside the batch source (which builds batches on the host): a read of a value
(``item``, ``float()``/``int()``/``bool()``/``index`` of a tensor, ``tolist``, ``cpu``, ``numpy``), and the
operations whose output size depends on the values, which the host must read to allocate it (``nonzero``,
``argwhere``, ``masked_select``, one-argument ``torch.where``, ``repeat_interleave`` without ``output_size``, and
indexing with a boolean mask: ``x[mask]``, ``x[mask] = tensor``). The fused output layer runs too
(``algo.fused_output_layer=true``: on a GPU it is on by default)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import rlhf
from rlhf import train
from rlhf.run import loop

PACKAGE = str(Path(rlhf.__file__).parent)
READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy", "nonzero", "argwhere",
         "masked_select")
# The steps that keep the skip-or-step verdict on the device (train.nonfinite_on_device, fused AdamW) read nothing;
# the others read it once a step: the one decision the host makes there.
ON_DEVICE, ONCE_A_STEP = 0, 1


def _bool_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _where_one(*args, **kwargs) -> bool:
    return len(args) + len(kwargs) == 1  # torch.where(condition): nonzero's indices


def _repeat_sizes(*args, **kwargs) -> bool:  # repeats a tensor, and no output_size to size the result by
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


def _set_mask(self, index, value) -> bool:  # a scalar value is a masked fill (no read); a tensor's needs nonzero
    return _bool_mask(index) and isinstance(value, torch.Tensor) and value.dim() > 0


def _every(*args, **kwargs) -> bool:
    return True


# (owner, name, whether a call reads): the patched functions and methods
PATCHED: list[tuple[object, str, Callable[..., bool]]] = [
    *((torch.Tensor, name, _every) for name in READS),
    *((torch, name, _every) for name in ("nonzero", "argwhere", "masked_select")),
    (torch.Tensor, "__getitem__", lambda self, index: _bool_mask(index)),
    (torch.Tensor, "__setitem__", _set_mask),
    (torch, "where", _where_one),
    (torch.Tensor, "repeat_interleave", _repeat_sizes),
    (torch, "repeat_interleave", lambda *args, **kwargs: _repeat_sizes(*args, **kwargs)),
]


def _count_reads(monkeypatch) -> tuple[Counter, list[int]]:
    """Patch each of :data:`PATCHED` to count the calls that read, from the package's code, while ``counting[0]``
    is set; each call is counted as ``<name> at <file>:<line>``."""
    counts: Counter = Counter()
    counting = [0]
    for owner, name, reads in PATCHED:
        original = getattr(owner, name)

        def counted(*args, __original=original, __name=name, __reads=reads, **kwargs):
            caller = sys._getframe(1)
            if counting[0] and caller.f_code.co_filename.startswith(PACKAGE) and __reads(*args, **kwargs):
                counts[f"{__name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return __original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return counts, counting


def _reads_per_step(overrides, fast_config, monkeypatch) -> tuple[Counter, list[int]]:
    """The reads of four optimizer steps of a run with ``overrides``, and the steps that ran."""
    counts, counting = _count_reads(monkeypatch)
    steps = []
    real_step = loop.train_step

    def counted_step(run, state, batches, stop, accumulation=None, **options):
        real_next = batches.next

        def next_batch():
            counting[0] -= 1  # the batch source builds batches on the host: not the hot loop's reads
            try:
                return real_next()
            finally:
                counting[0] += 1

        batches.next = next_batch
        counting[0] += 1
        try:
            return real_step(run, state, batches, stop, accumulation, **options)
        finally:
            counting[0] -= 1
            batches.next = real_next
            steps.append(state.step)

    monkeypatch.setattr(loop, "train_step", counted_step)
    train(fast_config(*overrides, "train.max_steps=4", "train.log_every_steps=4", "train.eval_every_steps=0",
                      "train.eval_at_start=false", "train.save_every_steps=0", "train.save_final=false"))
    return counts, steps


FUSED = ["algo.fused_output_layer=true", "train.nonfinite_on_device=true"]  # fused AdamW: conf/optimizer/adamw.yaml


@pytest.mark.parametrize("overrides", [
    ["algo=dpo", *FUSED],  # the pairs after one shared prompt (algo.shared_prompt=auto takes the tiny model)
    ["algo=dpo", "algo.shared_prompt=false", *FUSED],
    ["algo=dpo", "train.grad_accumulation_steps=2", *FUSED],
    ["algo=sft", *FUSED],
], ids=["dpo-shared-prompt", "dpo", "dpo-accumulation", "sft"])
def test_a_step_on_the_device_path_never_waits(overrides, fast_config, monkeypatch):
    counts, steps = _reads_per_step(overrides, fast_config, monkeypatch)
    assert steps == [1, 2, 3, 4]
    assert sum(counts.values()) <= ON_DEVICE * len(steps), dict(counts)


@pytest.mark.parametrize("overrides", [
    ["algo=dpo", "optimizer=lion", "algo.fused_output_layer=true"],  # no step that takes the flag: read it
    ["algo=dpo", "train.nonfinite_on_device=false", "train.grad_accumulation_steps=2"],
    ["algo=sft", "optimizer=sgd"],
], ids=["dpo-lion", "dpo-read-each-step", "sft-sgd"])
def test_a_step_that_reads_the_verdict_reads_it_once(overrides, fast_config, monkeypatch):
    counts, steps = _reads_per_step(overrides, fast_config, monkeypatch)
    assert steps == [1, 2, 3, 4]
    assert sum(counts.values()) <= ONCE_A_STEP * len(steps), dict(counts)


def test_the_counter_sees_what_a_gpu_waits_for(monkeypatch):
    """Each kind of read counted, from a module of the package's folder (the counter counts only those)."""
    counts, counting = _count_reads(monkeypatch)
    source = ("import torch\n"
              "def reads(x, mask, n):\n"
              "    x[mask]; x[mask] = x[mask] * 2; x[mask] = 0.0; torch.where(mask); torch.where(mask, x, 0)\n"
              "    x.nonzero(); torch.masked_select(x, mask); bool(mask[0]); x.repeat_interleave(n)\n"
              "    x.repeat_interleave(n, output_size=8); x[0]; x[1:]\n")
    scope: dict = {}
    exec(compile(source, str(Path(PACKAGE) / "counted_here.py"), "exec"), scope)
    counting[0] = 1
    scope["reads"](torch.arange(4.0), torch.tensor([True, False, True, False]), torch.full((4,), 2))
    kinds: Counter = Counter()
    for key, count in counts.items():
        kinds[key.split(" at ")[0]] += count
    assert kinds == {"__getitem__": 2, "__setitem__": 1, "where": 1, "nonzero": 1, "masked_select": 1,
                     "__bool__": 1, "repeat_interleave": 1}, dict(counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's synchronizing calls are reported by CUDA only")
@pytest.mark.parametrize("overrides", [["algo=dpo"], ["algo=sft"]], ids=["dpo", "sft"])
def test_on_a_gpu_the_package_makes_no_synchronizing_call_in_a_step(overrides, fast_config, monkeypatch):
    """The same as the CPU's count, told by CUDA itself (``torch.cuda.set_sync_debug_mode``: a warning at the line
    of each call that waits for the GPU), on the GPU's defaults (bf16, fused output layer, the verdict on the
    device). Calls made in other libraries' code (transformers' attention masks) are printed, not failed on."""
    import warnings

    records: list = []
    real_step = loop.train_step

    def watched_step(run, state, batches, stop, accumulation=None, **options):
        real_next = batches.next

        def next_batch():
            torch.cuda.set_sync_debug_mode(0)  # the batch source builds batches on the host
            try:
                return real_next()
            finally:
                torch.cuda.set_sync_debug_mode(1)

        batches.next = next_batch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                return real_step(run, state, batches, stop, accumulation, **options)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                batches.next = real_next
                records.extend(w for w in caught if "synchroniz" in str(w.message))

    monkeypatch.setattr(loop, "train_step", watched_step)
    train(fast_config(*overrides, "hardware=gpu", "hardware.compile=false", "train.max_steps=4",
                      "train.log_every_steps=4", "train.eval_every_steps=0", "train.eval_at_start=false",
                      "train.save_every_steps=0", "train.save_final=false"))
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in records)
    print("synchronizing calls in 4 steps:", dict(where))
    ours = {place: n for place, n in where.items()
            if any(w.filename.startswith(PACKAGE) and f"{Path(w.filename).name}:{w.lineno}" == place for w in records)}
    assert not ours, ours
