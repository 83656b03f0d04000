"""Where a step's time goes: ``train.profile_steps=N`` runs torch.profiler over N optimizer steps of a run.

The profiled steps start after the first log window (``train.log_every_steps``), past the first steps'
allocations and the compiler's first graphs. The first process writes, in the run folder:

- ``profile.txt``: the wall-clock milliseconds per profiled step, then torch's table of operators by self time
  (device time on a GPU, CPU time on a CPU), top :data:`ROWS`;
- ``profile_trace.json``: the whole timeline, for ``chrome://tracing`` or https://ui.perfetto.dev.

With ``train.profile_memory=true`` (a GPU only) the CUDA allocator's history is recorded over the same steps too:

- ``memory_snapshot.pickle``: every allocation and free with its Python stack, for https://pytorch.org/memory_viz;
- ``memory.txt``: torch's peak allocated bytes so far in the run, and at the peak of what the profiled steps
  allocated the live blocks grouped by the first frame outside torch (the model's line, or ours, that asked for the memory),
  largest first (:func:`memory_at_peak`).

The profiler slows the steps it records (the table's times include its own overhead); ``perf/*`` of the log
window that holds them says so by being slower. ``benchmarks/bench.py --profile`` profiles both sides of a case.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from rlhf.core.errors import UserError

log = logging.getLogger(__name__)

ROWS = 40  # operators in profile.txt's table
TABLE, TRACE = "profile.txt", "profile_trace.json"
SNAPSHOT, MEMORY = "memory_snapshot.pickle", "memory.txt"
MEMORY_ROWS = 20  # places in memory.txt's table
MEMORY_EVENTS = 200_000  # allocator events kept (the newest): torch's max_entries


class StepProfiler:
    """Profile optimizer steps ``first_step .. first_step + steps - 1`` (1-based, as the loop counts them).

    Call :meth:`before` with the number of the step about to run and :meth:`after` with the step just done (and
    the run's last step, where a short run ends the recording early). With ``steps=0`` both do nothing."""

    def __init__(self, steps: int, first_step: int, out_dir: Path, device: torch.device, writes: bool,
                 memory: bool = False) -> None:
        if memory and device.type != "cuda":
            raise UserError("train.profile_memory=true records the CUDA allocator's history: it needs a GPU. Fix: "
                            "train.profile_memory=false here (perf/peak_mem_mb and the memory preflight remain)")
        self.steps, self.first, self.last = steps, first_step, first_step + steps - 1
        self.out_dir, self.device, self.writes, self.memory = Path(out_dir), device, writes, memory
        self._profiler: torch.profiler.profile | None = None
        self._started_s = 0.0

    def before(self, step: int) -> None:
        if self.steps and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._synchronize()
            if self.memory:  # Python stacks only: symbolizing C++ frames makes a snapshot take minutes
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS, stacks="python")
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
        snapshot = None
        if self.memory:
            peak = torch.cuda.max_memory_allocated(self.device)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        if not self.writes:
            return
        write_profile(profiler, self.out_dir, self.device, f"steps {self.first}-{step}", per_step_ms)
        if snapshot is not None:
            write_memory(snapshot, peak, self.out_dir, f"steps {self.first}-{step}", self.device.index or 0)

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


def memory_at_peak(snapshot: dict, device_index: int = 0) -> tuple[int, list[tuple[int, int, str]]]:
    """Replay a CUDA allocator snapshot's trace (``torch.cuda.memory._snapshot()``): the most bytes its allocations
    held at once (allocations made before the recording began are not in it), and what was live then, as
    ``(bytes, blocks, place)`` per place, largest first; a place is the first frame of an allocation's stack that is
    not torch's own (``file:line function``)."""
    live: dict[int, tuple[int, str]] = {}
    held = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    traces = snapshot.get("device_traces") or [[]]
    for event in traces[device_index] if device_index < len(traces) else []:
        action, address = event.get("action"), event.get("addr")
        if action == "alloc":
            live[address] = (event["size"], _place(event.get("frames") or []))
            held += event["size"]
            if held > peak:
                peak, at_peak = held, dict(live)
        elif action in ("free_requested", "free_completed") and address in live:
            held -= live.pop(address)[0]
    places: dict[str, list[int]] = {}
    for size, place in at_peak.values():
        entry = places.setdefault(place, [0, 0])
        entry[0] += size
        entry[1] += 1
    table = sorted(((size, count, place) for place, (size, count) in places.items()), reverse=True)
    return peak, table


def _place(frames: list[dict]) -> str:
    for frame in frames:  # innermost first; C++ frames (a snapshot with C++ stacks) are skipped like torch's own
        name = frame.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{'/'.join(Path(name).parts[-3:])}:{frame.get('line')} {frame.get('name')}"
    return "(torch only)"


def write_memory(snapshot: dict, peak_bytes: int, out_dir: Path, what: str, device_index: int = 0) -> Path:
    """``memory_snapshot.pickle`` and ``memory.txt`` (see the module's docstring) in ``out_dir``."""
    import pickle

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / SNAPSHOT, "wb") as file:
        pickle.dump(snapshot, file)
    traced, table = memory_at_peak(snapshot, device_index)
    lines = [f"{what}: the run's peak allocated so far {peak_bytes / 2**20:,.1f} MB (torch.cuda.max_memory_allocated);"
             f" the allocations made in these steps held at most {traced / 2**20:,.1f} MB at once (what was allocated "
             f"before them is not in the trace). Live then, by the first Python frame outside torch (top "
             f"{MEMORY_ROWS}):", "", f"{'MB':>10} {'blocks':>7}  place"]
    lines += [f"{size / 2**20:>10,.1f} {count:>7}  {place}" for size, count, place in table[:MEMORY_ROWS]]
    path = out_dir / MEMORY
    path.write_text("\n".join(lines) + "\n")
    log.info("memory of %s: peak %.1f MB; %s and %s in %s", what, peak_bytes / 2**20, MEMORY, SNAPSHOT, out_dir)
    return path
