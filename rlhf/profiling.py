"""Where a step's time goes: ``train.profile_steps=N`` runs torch.profiler over N optimizer steps of a run.

The profiled steps start after the first log window (``train.log_every_steps``), past the first steps'
allocations and the compiler's first graphs. The first process writes, in the run folder:

- ``profile.txt``: the wall-clock milliseconds per profiled step, then torch's table of operators by self time
  (device time on a GPU, CPU time on a CPU), top :data:`ROWS`;
- ``profile_trace.json``: the whole timeline, for ``chrome://tracing`` or https://ui.perfetto.dev.

The profiler slows the steps it records (the table's times include its own overhead); ``perf/*`` of the log
window that holds them says so by being slower. ``scripts/bench.py --profile`` profiles both sides of a case.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ROWS = 40  # operators in profile.txt's table
TABLE, TRACE = "profile.txt", "profile_trace.json"


class StepProfiler:
    """Profile optimizer steps ``first_step .. first_step + steps - 1`` (1-based, as the loop counts them).

    Call :meth:`before` with the number of the step about to run and :meth:`after` with the step just done (and
    the run's last step, where a short run ends the recording early). With ``steps=0`` both do nothing."""

    def __init__(self, steps: int, first_step: int, out_dir: Path, device: torch.device, writes: bool) -> None:
        self.steps, self.first, self.last = steps, first_step, first_step + steps - 1
        self.out_dir, self.device, self.writes = Path(out_dir), device, writes
        self._profiler: torch.profiler.profile | None = None
        self._started_s = 0.0

    def before(self, step: int) -> None:
        if self.steps and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._synchronize()
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self._profiler.__enter__()
            self._started_s = time.perf_counter()

    def after(self, step: int, final_step: int | None = None) -> None:
        if self._profiler is None or step not in (self.last, final_step):
            return
        self._synchronize()
        per_step_ms = 1000 * (time.perf_counter() - self._started_s) / (step - self.first + 1)
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        if not self.writes:
            return
        write_profile(profiler, self.out_dir, self.device, f"steps {self.first}-{step}", per_step_ms)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def write_profile(profiler: torch.profiler.profile, out_dir: Path, device: torch.device, what: str,
                  per_step_ms: float) -> Path:
    """``profile.txt`` and ``profile_trace.json`` of a finished ``profiler`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = profiler.key_averages()
    header = (f"{what}: {per_step_ms:.1f} ms per step (wall clock, profiler on); operators by {sort.replace('_', ' ')}"
              f", top {ROWS}\n\n")
    table = out_dir / TABLE
    table.write_text(header + averages.table(sort_by=sort, row_limit=ROWS) + "\n")
    profiler.export_chrome_trace(str(out_dir / TRACE))
    log.info("profiled %s: %.1f ms per step; %s and %s in %s", what, per_step_ms, TABLE, TRACE, out_dir)
    return table
