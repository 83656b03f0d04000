"""A stop signal at any moment of a submitit job (rlhf/launch/submitit_job.py): held from the job's first statement,
what the job unpickles first is light, and a preemption warning before the run began requeues the job, which then
ends as an uninterrupted run ends (never FAILED).

The last test runs on a real Slurm cluster (``bash scripts/slurm/start.sh``): it is skipped when none answers, unless
``RLHF_TESTS_REQUIRE_SLURM=1`` (scripts/ci_slurm.sh, which starts one): then it fails.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from submitit.helpers import DelayedSubmission

from rlhf import train
from rlhf.launch import slurm_accounting, submitit_job
from tests.conftest import FAST, ROOT, compose_config

RUN = [*FAST, "hardware.threads_per_process=1"]  # 1 CPU, 1 thread: the same numbers in a job and in this process
HEAVY = ("rlhf", "torch", "transformers", "accelerate", "hydra")

# Run by the job's Python (submitit_job.python_command) as `-m probe <pickle> <requeued pickle>`: the signal mask at its
# first statement, what loading the submitted call imports, the mask during the call and after it.
PROBE = f"""
HEAVY = {HEAVY!r}
import json, signal, sys
from submitit.core.utils import DelayedSubmission
def mask():
    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
start = mask()
delayed = DelayedSubmission.load(sys.argv[1])
loaded = sorted(m for m in HEAVY if m in sys.modules)
during = sorted(int(s) for s in delayed.result())
delayed.function.checkpoint(*delayed.args).dump(sys.argv[2])
print(json.dumps({{"name": __name__, "start": start, "loaded": loaded, "during": during, "end": mask()}}))
"""


def test_a_job_holds_the_stop_signals_from_its_first_statement_and_loads_nothing_heavy(tmp_path):
    """The call (here: a function that reports the signal mask) travels as bytes inside a light pickle; the warning
    (USR2) is let through when the call begins, SIGTERM when it ends (or when the run's own handler is installed)."""
    call, [job] = submitit_job.deferred(signal.pthread_sigmask, [[signal.SIG_BLOCK], [()]])
    DelayedSubmission(call, job).dump(tmp_path / "submitted.pkl")
    (tmp_path / "probe.py").write_text(PROBE)
    command = [*shlex.split(submitit_job.python_command()), "-u", "-m", "probe", str(tmp_path / "submitted.pkl"),
               str(tmp_path / "requeued.pkl")]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    usr2, term = int(signal.SIGUSR2), int(signal.SIGTERM)
    assert seen["name"] == "__main__" and {usr2, term} <= set(seen["start"]), seen
    assert seen["loaded"] == [], f"loading the submitted call imported {seen['loaded']}"
    assert term in seen["during"] and usr2 not in seen["during"], seen
    assert usr2 not in seen["end"] and term not in seen["end"], seen
    again = subprocess.run([sys.executable, "-c", "import sys; from submitit.core.utils import DelayedSubmission; "
                            f"DelayedSubmission.load(sys.argv[1]); print([m for m in {HEAVY!r} if m in sys.modules])",
                            str(tmp_path / "requeued.pkl")], capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == "[]", again.stdout + again.stderr[-3000:]  # a requeued job's pickle is light too


def _sweep(sweep: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", "-m", *overrides, *RUN, f"hydra.sweep.dir={sweep}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stop(launcher: subprocess.Popen) -> str:
    """The sweep's output, once it ended (killed, with the processes it started, if it did not within 3 minutes)."""
    try:
        out, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return out


def _assert_same_as_uninterrupted(sweep: Path, reference: Path) -> None:
    (run,) = [p.parent.parent for p in sweep.glob("*/.hydra/hydra.yaml")]
    a, b = load_file(run / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "parameters differ"

    def metrics(folder: Path) -> list[dict]:
        lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in lines]

    assert metrics(run) == metrics(reference)


def _job_logs(sweep: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((sweep / ".submitit").glob("*/*_log.*")))


def _signal_mask(pid: int) -> tuple[int, int]:
    """(blocked, caught) signal bit masks of a process."""
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return int(status["SigBlk"], 16), int(status["SigCgt"], 16)


@pytest.mark.serial
def test_a_warning_before_submitit_is_even_imported_requeues_a_local_job(tmp_path):
    """``launcher=submitit_local``: USR2 to the job's Python as soon as it holds the signal, long before submitit has
    loaded anything or installed its handler. The job is requeued (submitit's local controller starts it again) and
    ends as an uninterrupted run."""
    sweep, reference = tmp_path / "sweep", tmp_path / "reference"
    launcher = _sweep(sweep, "launcher=submitit_local")
    usr2 = 1 << (signal.SIGUSR2 - 1)
    try:
        while True:
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
            jobs = [p for p in Path("/proc").glob("[0-9]*") if _job_of(p, sweep)]
            if jobs:
                try:
                    blocked, caught = _signal_mask(int(jobs[0].name))
                except OSError:
                    continue
                if caught & usr2:
                    pytest.fail("submitit's handler was up before this test saw the job's Python holding USR2")
                if blocked & usr2:
                    os.kill(int(jobs[0].name), signal.SIGUSR2)
                    break
            time.sleep(0.002)
        said_then = _job_logs(sweep)
        train(compose_config(*RUN, output_dir=reference))  # the uninterrupted run, meanwhile
    finally:
        out = _stop(launcher)
    logs = _job_logs(sweep)
    assert launcher.returncode == 0, f"{logs[-3000:]}\nsweep:\n{out[-2000:]}"
    assert "Loading pickle" not in said_then  # the signal came before the job loaded anything
    assert "Caught signal SIGUSR2" in logs and "Requeued job" in logs, logs[-3000:]
    _assert_same_as_uninterrupted(sweep, reference)


def _job_of(process: Path, sweep: Path) -> bool:
    try:
        command = (process / "cmdline").read_bytes()
    except OSError:
        return False
    return b"submitit.core._submit" in command and str(sweep).encode() in command


# --- on a real Slurm cluster ------------------------------------------------------------------------------------------
def _cluster_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return ping.returncode == 0 and "UP" in ping.stdout


@pytest.fixture
def busy_cpus():
    """A busy loop per CPU for the test's duration: the job starts several times slower, as on a loaded node."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for loop in loops:
        loop.kill()
        loop.wait()


def _squeue(*args: str) -> list[str]:
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, timeout=20).stdout.split("\n")


def _slurm_job(sweep: Path, launcher: subprocess.Popen) -> str:
    """The Slurm job the sweep submitted (submitit names a folder after it)."""
    while True:
        folders = [p.name for p in (sweep / ".submitit").glob("*") if p.is_dir() and p.name.split("_")[0].isdigit()]
        if folders:
            return folders[0].split("_")[0]
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        time.sleep(0.05)


def _signal_one_second_after_running(job: str, launcher: subprocess.Popen, timeline: dict) -> None:
    """USR2 through Slurm (as a preemption or a time limit sends it: to every process of the job's step) 1 s after
    the job is RUNNING. Slurm signals job steps only: a signal sent before the step exists is lost, so it waits
    for the step if the step is slower than that."""
    start = time.monotonic()
    while "RUNNING" not in _squeue("-j", job, "-o", "%T"):
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        time.sleep(0.05)
    timeline["running"] = round(time.monotonic() - start, 2)
    time.sleep(1)
    while not any(step.startswith((f"{job}_0.0", f"{job}.0")) for step in _squeue("-s", "-o", "%i")):
        time.sleep(0.02)
    timeline["signalled"] = round(time.monotonic() - start, 2)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=20)


def _release_while_requeued(job: str, launcher: subprocess.Popen) -> None:
    """Slurm holds a requeued job 121 s (Reason=BeginTime): release it, 3 s after it is first seen held (released
    within the second of its requeue, it fails to start: "Job credential revoked")."""
    held = None
    while launcher.poll() is None:
        if "BeginTime" in _squeue("-j", job, "-o", "%r"):
            held = held or time.monotonic()
            if time.monotonic() - held >= 3:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=20)
                held = None
        time.sleep(0.2)


@pytest.mark.serial
@pytest.mark.skipif(os.environ.get("RLHF_TESTS_REQUIRE_SLURM") != "1" and not _cluster_up(),
                    reason="no Slurm cluster is running (bash scripts/slurm/start.sh)")
def test_a_slurm_preemption_warning_one_second_after_the_job_starts_requeues_it(tmp_path, busy_cpus):
    """``launcher=slurm``, every CPU busy: USR2 1 s after the job is RUNNING (before the change: the job was still
    loading the package, torch and transformers to unpickle its call, had no handler and ended FAILED)."""
    sweep, reference = tmp_path / "sweep", tmp_path / "reference"
    began = time.monotonic()
    launcher = _sweep(sweep, "launcher=slurm", "hydra.launcher.timeout_min=5", "hydra.launcher.max_num_timeout=3")
    timeline: dict[str, float] = {}
    job = None
    try:
        job = _slurm_job(sweep, launcher)
        _signal_one_second_after_running(job, launcher, timeline)
        train(compose_config(*RUN, output_dir=reference))  # the uninterrupted run, meanwhile
        _release_while_requeued(job, launcher)
    finally:
        out = _stop(launcher)
        if job is not None and launcher.returncode != 0:
            subprocess.run(["scancel", job], timeout=20)
    logs = _job_logs(sweep)
    said = f"timeline {timeline}; job log:\n{logs[-3000:]}\nsweep:\n{out[-2000:]}"
    assert launcher.returncode == 0, said
    # the launcher returns on the job's result; Slurm ends the job, then its accounting records it, moments later
    sacct = [r["State"] for r in slurm_accounting.final_states([job])[job]]
    said = f"sacct {sacct}; {said}"
    assert "Caught signal SIGUSR2" in logs, said  # the warning reached the job, and submitit's handler
    assert "REQUEUED" in sacct and sacct[-1] == "COMPLETED", said
    _assert_same_as_uninterrupted(sweep, reference)
    print(f"requeued, then bit-identical to an uninterrupted run, in {time.monotonic() - began:.1f} s: "
          f"timeline (s) {timeline}, sacct {sacct}")
