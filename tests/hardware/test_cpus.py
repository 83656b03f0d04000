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


def test_a_run_in_bf16_weights_or_autocast_keeps_its_count_on_a_busy_machine(fast_config, monkeypatch, caplog):
    """A model loaded in bfloat16 computes in bf16 as autocast does: its run keeps the count of an idle machine
    and says why (red: only hardware.mixed_precision consulted, the busy CPUs left out)."""
    import logging

    from rlhf import train
    from rlhf.hardware.precision import computes_in_bf16

    assert computes_in_bf16("bf16", "float32") and computes_in_bf16("no", "bfloat16")
    assert computes_in_bf16("no", "auto") and not computes_in_bf16("no", "float32")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 2.0)
    caplog.set_level(logging.INFO, logger="rlhf")
    train(fast_config("model.dtype=bfloat16", "train.max_steps=1"))
    line = next(r.message for r in caplog.records if r.message.startswith("hardware:"))
    assert "2 thread(s) each (2.0 of the 2 CPUs were busy with other work as the run started, but bf16 results" in line
    assert "on a CPU, bf16 results depend on the thread count" in line


def test_more_threads_than_cpus_is_a_warning_naming_what_set_them_and_the_fix(monkeypatch):
    """hardware.threads_per_process, OMP_NUM_THREADS or more processes than CPUs: each oversubscribes the CPUs and
    is said with the measured cost and its fix; a count that fits, or one this module chose, says nothing (red: the
    1000 threads of hardware.threads_per_process=1000 on 2 CPUs run without a word)."""
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpus.THREADS_WHY, raising=False)
    line = cpus.oversubscribed(1000, 1, 1000)
    assert line.startswith("1 process(es) x 1000 thread(s) = 1000 threads on 2 CPU(s) "
                           "(hardware.threads_per_process=1000): threads beyond the CPUs wait for each other")
    assert "measured 8.5x" in line and "docs/threads/2026-11-27-busy-machine.md" in line
    assert line.endswith("Fix: hardware.threads_per_process=2, or null: the CPUs shared out")
    assert cpus.oversubscribed(2, 2, 2).endswith("Fix: hardware.threads_per_process=1, or null: the CPUs shared out")
    assert cpus.oversubscribed(2, 1, 2) is None and cpus.oversubscribed(1, 2, None) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert cpus.choose_threads(None, 1)[0] == 8
    assert "(OMP_NUM_THREADS=8)" in cpus.oversubscribed(8, 1, None)
    assert cpus.oversubscribed(8, 1, None).endswith("Fix: OMP_NUM_THREADS=2, or unset it: the CPUs shared out")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpus.oversubscribed(1, 4, None).endswith("Fix: at most 2 process(es) on this machine "
                                                    "(hardware.num_processes=2)")
    # one thread each, set on purpose: the processes are what to cut, not the threads (the fix named them before)
    assert cpus.oversubscribed(1, 4, 1).endswith("Fix: at most 2 process(es) on this machine (hardware.num_processes=2)")
