"""A note above a sweep's report (one of :func:`rlhf.sweeps.caveats.notes`): runs that compare learning rates where
bf16 hides their updates from the forward pass.

Each run that computed in bf16 recorded how many optimizer steps a typical weight needs before its bf16 value
changes (``train/bf16_steps_to_visible``, :mod:`rlhf.telemetry.bf16_updates`); where the runs' ``optimizer.lr``
differ and a run is shorter than :data:`~rlhf.telemetry.bf16_updates.WARN_FACTOR` times its figure, the learning
rates compared barely changed what the forward pass saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf.telemetry.bf16_updates import FIX, METRIC, WARN_FACTOR

HEAD = (f"Learning rates compared where bf16 hides updates: these runs compare learning rates (optimizer.lr) in a "
        f"regime where bf16 hides updates from the forward pass: a typical weight's bf16 value, the one the forward "
        f"pass computes with, changes fewer than {WARN_FACTOR} times over the run even at the peak learning rate "
        f"({METRIC}), so the learning rate barely changes what the forward pass sees. Fix: {FIX} (a float32 forward "
        f"pass); the runs")


def _setting(run: Any, block: str, key: str) -> Any:
    """``<block>.<key>`` as the run finished with it (summary.json), else as configured (.hydra/config.yaml)."""
    recorded = ((run.summary or {}).get(block) or {}) if block == "train" else {}
    return recorded.get(key, ((run.config or {}).get(block) or {}).get(key))


def bf16_note(runs: Sequence[tuple[str, Any]]) -> tuple[str, list[str]]:
    """(head, lines) where ``runs`` (``(name, run)`` pairs) differ in ``optimizer.lr`` and some recorded a
    :data:`~rlhf.telemetry.bf16_updates.METRIC` above their length over ``WARN_FACTOR``: ``run 0 (optimizer.lr=5e-07):
    a typical weight needs 126 steps before its bf16 value changes; the run has 300``; ``("", [])`` otherwise."""
    if len({repr(_setting(run, "optimizer", "lr")) for _, run in runs if run.config}) < 2:
        return "", []
    lines = []
    for name, run in runs:
        steps = run.last(METRIC)
        steps = steps if steps is not None else (run.final or {}).get(METRIC)
        length = _setting(run, "train", "max_steps")
        if steps is not None and isinstance(length, int) and length < WARN_FACTOR * steps:
            lines.append(f"run {name} (optimizer.lr={_setting(run, 'optimizer', 'lr')}): a typical weight needs "
                         f"{f'{steps:,.0f}' if steps >= 10 else f'{steps:.2g}'} steps before its bf16 value changes; "
                         f"the run has {length}")
    return (HEAD, lines) if lines else ("", [])
