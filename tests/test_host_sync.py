"""The hot loop waits for the device once per optimizer step: the metrics, token counts and gradient norm stay on
the device through the log window. Counted on the CPU as the calls that would wait for a GPU (``item``,
``float()``/``int()``/``bool()`` of a tensor, ``tolist``, ``cpu``, ``numpy``) made by the package's own code inside
:func:`rlhf.run.loop.train_step`, outside the batch source (which builds batches on the host)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import rlhf
from rlhf import train
from rlhf.run import loop

PACKAGE = str(Path(rlhf.__file__).parent)
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
ALLOWED_PER_STEP = 1  # whether the step is finite: skip or step, the one decision the host makes


def _count_reads(monkeypatch) -> tuple[Counter, list[int]]:
    """Patch the reading methods to count calls from the package's code while ``counting[0]`` is set."""
    counts: Counter = Counter()
    counting = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __original=original, __name=name, **kwargs):
            caller = sys._getframe(1)
            if counting[0] and caller.f_code.co_filename.startswith(PACKAGE):
                counts[f"{__name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts, counting


@pytest.mark.parametrize("overrides", [["algo=dpo"], ["algo=dpo", "train.grad_accumulation_steps=2"],
                                       ["algo=sft"], ["algo=dpo", "algo.shared_prompt=false"]])
def test_a_step_reads_the_device_once(overrides, fast_config, monkeypatch):
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
    assert steps == [1, 2, 3, 4]
    assert sum(counts.values()) <= ALLOWED_PER_STEP * len(steps), dict(counts)
