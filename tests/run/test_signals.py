"""Stop signals (rlhf/run/signals.py): a checkpoint at the step boundary, one line, a non-zero exit; never a traceback.

Each test starts ``train.py`` as a user would, waits until it is training, and signals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.run import checkpoint, signals
from tests.conftest import FAST, ROOT
from tests.runs import TWO_PROCESSES, assert_same_run, start, uninterrupted

SLOW_RUN = [*(o for o in FAST if not o.startswith("train.max_steps")), "train.max_steps=100000",
            "train.save_every_steps=0"]


def _start(run: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *SLOW_RUN, *overrides, f"hydra.run.dir={run}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_step(process: subprocess.Popen, run: Path, step: int = 3) -> None:
    deadline = time.time() + 240
    while True:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline
        text = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""
        if any(json.loads(line)["step"] >= step for line in text[:text.rfind("\n") + 1].splitlines()):  # whole lines
            return
        time.sleep(0.05)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in line]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_checkpoints_and_exits_with_one_line_that_resumes(sig, tmp_path):
    run = tmp_path / "run"
    process = _start(run)
    _wait_for_step(process, run)
    os.kill(process.pid, sig)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + sig
    assert "Traceback" not in err
    last = [line for line in err.splitlines() if "stopped by" in line]
    assert len(last) == 1 and f"stopped by {signal.Signals(sig).name} after step" in last[0]
    step = int(last[0].split("after step ")[1].split(";")[0])
    folder = run / "checkpoints" / f"step_{step:08d}"
    assert (folder / "meta.json").exists() and str(folder) in last[0]
    command = last[0].split("To resume: ")[1]
    assert command.split() == ["python", "train.py", f"hydra.run.dir={run}", "resume=auto"]  # the run's own overrides
    if sig == signal.SIGTERM:  # the printed command continues the run where it stopped (here: 2 steps more)
        argv = [sys.executable, *command.split()[1:], f"train.max_steps={step + 2}", "resume_changes=[train.max_steps]"]
        resumed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        steps = _steps(run)
        assert steps == list(range(1, step + 3)), "no step lost or logged twice"


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    """From step 2 on each micro-batch takes 60 s: the first Ctrl-C waits for the step's end; the second must end
    the run within seconds, in the middle of the step."""
    run = tmp_path / "run"
    process = _start(run, "algo=sft", "algo._target_=tests.slow_loss.SlowFrom", "+algo.call=1", "+algo.seconds=60")
    _wait_for_step(process, run, step=1)
    os.kill(process.pid, signal.SIGINT)
    time.sleep(0.5)
    assert process.poll() is None, "the first Ctrl-C must let the step finish"
    _assert_second_ctrl_c_aborts(process, run, within_s=10)  # the step would have taken 60 s more


def _assert_second_ctrl_c_aborts(process: subprocess.Popen, run: Path, within_s: float) -> None:
    """A second Ctrl-C ends the run within ``within_s``: exit 130, one line, no traceback, no checkpoint (stopped
    before any: none, and nothing half-written kept)."""
    os.kill(process.pid, signal.SIGINT)
    aborted = time.perf_counter()
    try:
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert time.perf_counter() - aborted < within_s
    assert process.returncode == 130 and "Traceback" not in err and "aborted by Ctrl-C" in err, err[-3000:]
    assert not checkpoint.complete(run)


@pytest.mark.serial
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_a_signal_to_a_two_process_run_stops_both_ranks_and_resumes_exactly(sig, tmp_path, two_process_reference):
    """SIGTERM: torch's elastic agent passes it to the ranks. USR2: this package's parent passes it on (outside
    Slurm no handler came before ours, so the run stops as on SIGTERM; under Slurm submitit's handler takes over
    after the checkpoint, which scripts/ci_slurm.sh tests on a real cluster). Both ranks checkpoint at the same
    step, and the resumed run ends exactly as an uninterrupted one."""
    run = tmp_path / "run"
    process = start(run, *TWO_PROCESSES, wait=False)
    _wait_for_step(process, run)
    os.kill(process.pid, sig)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and f"stopped by {signal.Signals(sig).name} after step" in err
    newest = checkpoint.latest(run)
    assert {p.name for p in newest.glob("rank_*.pt")} == {"rank_0.pt", "rank_1.pt"}
    assert 3 <= checkpoint.step_of(newest) < 40 and not (run / "final").exists()
    start(run, *TWO_PROCESSES, "resume=auto")
    assert_same_run(two_process_reference, run, 40, processes=2)


# --- a signal at any moment: each phase hit deterministically (rlhf.run.signals.reached) --------------------------------
def _signalled(run: Path, when: str, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """``train.py`` (tests.runs.RUN: 40 steps, checkpoints every 10) that sends itself ``when`` =
    ``<phase>:<SIGNAL>:<parent|all>`` as the phase begins; ``all`` signals every process of the run (its own
    session), as Slurm does."""
    process = start(run, *overrides, wait=False, env={signals.TEST_SIGNAL: when})
    _, err = process.communicate(timeout=240)
    assert "Traceback" not in err, err[-3000:]
    return process, err


def _stopped_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "stopped by" in line]
    assert len(lines) == 1, lines
    return lines[0]


def _assert_stopped_before_the_first_step(run: Path, process, err: str, sig: int) -> None:
    assert process.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name} before the first step; nothing to resume" in _stopped_line(err)
    assert not checkpoint.complete(run) and not (run / "final").exists()


def _assert_stopped_with_checkpoint(run: Path, process, err: str, sig: int, step: int) -> None:
    assert process.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name} after step {step};" in _stopped_line(err)
    assert checkpoint.latest(run).name == f"step_{step:08d}" and not (run / "final").exists()


def _assert_finished_despite(run: Path, process, err: str) -> None:
    assert process.returncode == 0, err[-3000:]
    assert "during the final save; the run finished first" in err or "after the last step" in err, err[-3000:]
    assert (run / "final" / "model.safetensors").exists() and "stopped by" not in err


def test_a_signal_in_each_phase_of_a_one_process_run_ends_cleanly(tmp_path):
    """Start-up (before any handler of the loop: recorded, the run stops before its first step), the first step
    (it completes and is checkpointed), the final evaluation (a checkpoint of the last step; the resumed run only
    saves the final model and ends exactly as an uninterrupted one), the final save (it completes: the run is
    finished)."""
    one_process_reference = tmp_path / "reference"
    uninterrupted(one_process_reference)
    process, err = _signalled(tmp_path / "a", "startup:SIGTERM:all")
    _assert_stopped_before_the_first_step(tmp_path / "a", process, err, signal.SIGTERM)
    process, err = _signalled(tmp_path / "b", "step_1:SIGINT:parent")
    _assert_stopped_with_checkpoint(tmp_path / "b", process, err, signal.SIGINT, 1)
    process, err = _signalled(tmp_path / "c", "final_eval:SIGUSR2:parent")  # outside Slurm USR2 stops as SIGTERM
    _assert_stopped_with_checkpoint(tmp_path / "c", process, err, signal.SIGUSR2, 40)
    start(tmp_path / "c", "resume=auto")
    assert_same_run(one_process_reference, tmp_path / "c", 40)
    process, err = _signalled(tmp_path / "d", "final_save:SIGTERM:all")
    _assert_finished_despite(tmp_path / "d", process, err)
    assert_same_run(one_process_reference, tmp_path / "d", 40)


@pytest.mark.serial
def test_a_signal_in_each_phase_of_a_two_process_run_ends_cleanly(tmp_path, two_process_reference):
    """The same phases on 2 processes, signalling the parent alone (which passes it on) or every process at once
    (Slurm's way: each rank gets it directly, and again from the parent: one request). A rank signalled before its
    handler exists holds the signal until the handler is installed."""
    process, err = _signalled(tmp_path / "a", "rank_startup:SIGUSR2:all", *TWO_PROCESSES)
    _assert_stopped_before_the_first_step(tmp_path / "a", process, err, signal.SIGUSR2)
    process, err = _signalled(tmp_path / "b", "startup:SIGTERM:parent", *TWO_PROCESSES)
    _assert_stopped_before_the_first_step(tmp_path / "b", process, err, signal.SIGTERM)
    process, err = _signalled(tmp_path / "c", "step_1:SIGUSR2:all", *TWO_PROCESSES)
    _assert_stopped_with_checkpoint(tmp_path / "c", process, err, signal.SIGUSR2, 1)
    process, err = _signalled(tmp_path / "d", "final_eval:SIGTERM:all", *TWO_PROCESSES)
    _assert_stopped_with_checkpoint(tmp_path / "d", process, err, signal.SIGTERM, 40)
    start(tmp_path / "d", *TWO_PROCESSES, "resume=auto")
    assert_same_run(two_process_reference, tmp_path / "d", 40, processes=2)
    process, err = _signalled(tmp_path / "e", "final_save:SIGUSR2:parent", *TWO_PROCESSES)
    _assert_finished_despite(tmp_path / "e", process, err)
    assert_same_run(two_process_reference, tmp_path / "e", 40, processes=2)


@pytest.mark.serial
def test_two_process_ranks_get_as_long_as_their_step_takes_and_a_second_ctrl_c_aborts_them(tmp_path):
    """The first Ctrl-C reaches the parent alone; it passes it on and waits for the ranks however long their step
    takes (torch's elastic agent, left to itself, would SIGKILL them after 30 s). The second Ctrl-C kills the ranks
    and ends the run at once: exit 130, one line, no checkpoint."""
    run = tmp_path / "run"
    process = start(run, *TWO_PROCESSES, "algo._target_=tests.slow_loss.SlowDPOFrom", "+algo.call=1",
                    "+algo.seconds=50", wait=False, env={signals.TEST_SIGNAL: "step_1:SIGINT:parent"})
    deadline = time.time() + 120
    while "received SIGINT" not in ((run / "train.log").read_text() if (run / "train.log").exists() else ""):
        assert process.poll() is None and time.time() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.2)
    time.sleep(32)
    assert process.poll() is None, "the ranks were not given the time their step takes"
    _assert_second_ctrl_c_aborts(process, run, within_s=12)  # the step had 15 s more to sleep at least
