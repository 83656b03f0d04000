"""rlhf/hardware/cpus.py: the thread count a run chooses, and the one load measurement a sweep's points share."""

from __future__ import annotations

from rlhf.hardware import cpus


def test_the_points_of_a_sweep_share_one_measurement_of_the_load(tmp_path, monkeypatch):
    """The first point measures the busy CPUs and keeps the figure in the sweep's folder; the next ones use it, so
    points of the same hardware get the same thread count however busy the machine was as each began (red: each
    point measuring its own)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # which would decide instead (the test runner sets it)
    loads = iter([1.8, 0.0, 0.5])
    monkeypatch.setattr(cpus, "busy_cpus", lambda: next(loads))
    assert cpus.sweep_load(tmp_path) == 1.8
    assert cpus.sweep_load(tmp_path) == 1.8
    assert cpus.sweep_load(tmp_path / "another") == 0.0
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    assert cpus.choose_threads(None, 1, busy=cpus.sweep_load(tmp_path))[0] == 1
    count, why = cpus.choose_threads(None, 1, busy=cpus.sweep_load(tmp_path))
    assert count == 1 and "as the sweep's first point started" in why
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / cpus.SWEEP_LOAD).write_text("{}")  # never readable: the point's own measurement
    assert cpus.sweep_load(tmp_path / "edited") == 0.5
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert cpus.sweep_load(tmp_path) is None  # a Slurm job's CPUs are its own


def test_a_bf16_run_on_a_cpu_keeps_the_count_of_an_idle_machine_whatever_the_load(monkeypatch):
    """bf16 results on a CPU depend on the thread count: the same command gives the same numbers on a busy machine
    as on an idle one (the line says it is slower and names the faster count); float32, whose numbers do not depend on
    it, leaves the busy CPUs out (red: bf16 following the load)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 1.8)
    count, why = cpus.choose_threads(None, 1, follow_load=False)
    assert count == 2 and "bf16 results on a CPU depend on the thread count, so the run keeps 2" in why
    assert "Faster, with numbers of its own: hardware.threads_per_process=1" in why
    assert cpus.choose_threads(None, 1)[0] == 1
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 0.0)
    assert cpus.choose_threads(None, 1, follow_load=False) == (2, "")
