"""The log window: what the training steps left on the device since the last line of metrics, read once.

Between two log windows a step reads nothing from the device (where the non-finite verdict is kept there too,
:mod:`rlhf.run.nonfinite`); :func:`window_metrics` reads the window's sums, token counts, gradient norm and
verdicts when the line is written, and :func:`settle` reads the verdicts alone before a checkpoint.
"""

from __future__ import annotations

import math

from rlhf.core.train_state import TrainState
from rlhf.ops.collectives import max_over_processes, sum_over_processes
from rlhf.run.components import BuiltRun
from rlhf.telemetry.load import OTHER, local_share
from rlhf.telemetry.metrics import window_means
from rlhf.telemetry.mfu import mfu


def settle(run: BuiltRun, state: TrainState) -> None:
    """Read the non-finite verdicts kept on the device since the last reading, count them, and stop where
    ``train.on_nonfinite`` says (before any log window is written and any checkpoint saved)."""
    if run.verdicts is not None:
        run.verdicts.settle(state, run.settings)


def window_metrics(run: BuiltRun, state: TrainState, grad_norm: float | None, elapsed_s: float) -> dict[str, float]:
    """The log window's training metrics (means over its steps and every process), speed, the machine's load, lr
    and counters; the verdicts kept on the device are read first (and may stop the run: :meth:`rlhf.run.nonfinite.Verdicts.settle`)."""
    settle(run, state)
    processes = run.accelerator.num_processes
    tokens_per_s = int(state.window_tokens) * processes / elapsed_s
    metrics = {**run.shown(window_means(state, "train/", run.accelerator), "train/"), "train/lr": run.scheduler.get_last_lr()[0],
               "perf/tokens_per_s": tokens_per_s,
               "perf/samples_per_s": state.window_samples * processes / elapsed_s,
               "perf/mfu": mfu(run.flops_per_token, tokens_per_s, run.peak_flops, processes),
               "perf/step_time_s": elapsed_s / max(state.window_steps, 1),
               "perf/peak_mem_mb": max_over_processes(run.peak.mb(), run.accelerator)}
    for phase, seconds in run.algo.timings().items():  # e.g. an online algorithm's sampling, per step
        metrics[f"perf/{phase}_time_s"] = max_over_processes(seconds, run.accelerator) / max(state.window_steps, 1)
    # the machine's load beside the run, for reports that compare speeds (rlhf.telemetry.load); with several
    # processes every one joins the sum, NaN where it measures nothing (then no process logs it)
    if run.load.measures or processes > 1:
        busy, own = run.load.window()
        own = sum_over_processes({"own": own}, run.accelerator, same_keys=True)["own"] * local_share(processes)
        if math.isfinite(busy) and math.isfinite(own):
            metrics[OTHER] = run.load.add(busy, own)
    if grad_norm is not None and math.isfinite(grad_norm):
        metrics["train/grad_norm"] = grad_norm
    if state.nonfinite_steps:
        metrics["train/nonfinite_steps"] = state.nonfinite_steps
    return metrics
