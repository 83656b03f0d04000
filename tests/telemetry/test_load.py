"""rlhf/telemetry/load.py and the loop's perf/busy_cpus_other: the machine's load beside a run, at each log window,
summarised in summary.json. About 5 s."""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import sys
import time

import pytest

from rlhf import train
from rlhf.telemetry import load

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_other_work_is_the_busy_cpus_less_the_runs_own(monkeypatch):
    """2 CPUs over 1 s: 150 of 200 ticks busy (1.5 CPUs), 50 of them the run's (0.5 CPU): other work 1.0; a window
    whose files cannot be read is NaN, and the next one spans from the last reading (red with the run's own use not
    subtracted, or with the busy share not scaled by the CPUs)."""
    readings = iter([((1000, 4000), 300, 10.0), ((1150, 4200), 350, 11.0), None, ((1350, 4600), 450, 13.0)])
    monkeypatch.setattr(load, "affinity", lambda: {0, 1})
    monkeypatch.setattr(load.LoadMeter, "_read", lambda self: next(readings))
    monkeypatch.setattr(load, "TICKS_PER_S", 100)
    meter = load.LoadMeter()
    assert meter.measures and meter.cpus == 2
    busy, own = meter.window()
    assert (busy, own) == pytest.approx((1.5, 0.5)) and meter.add(busy, own) == pytest.approx(1.0)
    assert all(math.isnan(x) for x in meter.window())  # unreadable this time
    busy, own = meter.window()  # from 11.0 to 13.0: 200 of 400 ticks busy, 100 the run's over 2 s
    assert (busy, own) == pytest.approx((1.0, 0.5)) and meter.add(busy, own) == pytest.approx(0.5)
    assert meter.add(0.3, 0.5) == 0.0 and meter.add(2.5, 0.0) == 2.0  # ticks round: kept within 0 and the CPUs
    assert meter.summary() == {"busy_cpus_other": {"min": 0.0, "median": 0.75, "max": 2.0}, "windows": 4, "cpus": 2}


def test_without_proc_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(load, "affinity", lambda: None)  # not Linux
    meter = load.LoadMeter()
    assert not meter.measures and meter.cpus is None and meter.summary() is None


def _spin(seconds: float, queue, done) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    queue.put(time.process_time())
    done.wait(60)  # alive until the test has read it


@linux
def test_a_worker_process_counts_as_the_runs_own_work():
    """A data loader's worker is the run's work, not other work: its CPU time is in :func:`own_ticks`, while it
    runs and after it ended (red with only this process's own threads counted)."""
    context = multiprocessing.get_context("fork")
    queue, done = context.Queue(), context.Event()
    before = load.own_ticks()
    worker = context.Process(target=_spin, args=(0.3, queue, done))
    worker.start()
    used = queue.get(timeout=60)
    assert worker.pid in {child.pid for child in multiprocessing.active_children()}
    while_alive = load.own_ticks()
    done.set()
    worker.join()
    after = load.own_ticks()
    assert (while_alive - before) / load.TICKS_PER_S >= used - 0.05
    assert (after - before) / load.TICKS_PER_S >= used - 0.05


@linux
def test_a_run_records_the_load_at_each_log_window_and_sums_it_up(fast_config, tmp_path):
    """Every training line has perf/busy_cpus_other (between 0 and the CPUs), summary.json its min, median and max,
    environment.json the CPUs counted (red without the measurement in the log window)."""
    train(fast_config())
    folder = tmp_path / "run"
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    windows = [line[load.OTHER] for line in lines if "train/loss" in line]
    assert len(windows) == 3 and len(windows) == sum(load.OTHER in line for line in lines)
    cpus = json.loads((folder / "environment.json").read_text())["cpus"]
    assert cpus == len(load.affinity()) and all(0 <= value <= cpus for value in windows)
    summary = json.loads((folder / "summary.json").read_text())["load"]
    assert summary == {"busy_cpus_other": {"min": min(windows), "median": statistics.median(windows),
                                           "max": max(windows)}, "windows": 3, "cpus": cpus}


def test_no_load_is_logged_where_it_cannot_be_read(fast_config, tmp_path, monkeypatch):
    monkeypatch.setattr(load, "affinity", lambda: None)
    train(fast_config())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "perf/tokens_per_s" in lines and load.OTHER not in lines
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["load"] is None


@linux
@pytest.mark.serial
def test_two_processes_log_the_load_at_each_window(fast_config, tmp_path):
    """Every process measures its own CPU use and their sum is taken at each window, a collective that every
    process calls: the run ends, each window with its load."""
    train(fast_config("hardware=cpu_ddp", "hardware.timeout_s=60", "train.global_batch_size=8"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [line[load.OTHER] for line in lines if "train/loss" in line]
    assert len(windows) == 3 and all(0 <= value <= len(load.affinity()) for value in windows)
