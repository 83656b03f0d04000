"""A job's final state read from Slurm's accounting only once it is recorded (rlhf/launch/slurm_accounting.py), checked
against an accounting that lags on purpose: scripts/slurm/lagging/sacct in front of a stand-in for the real sacct
that prints what a test wrote (no Slurm needed)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rlhf.launch import slurm_accounting
from rlhf.launch.slurm_accounting import AccountingLag, final_states, is_terminal, recorded_end
from tests.conftest import ROOT

LAGGING = ROOT / "scripts" / "slurm" / "lagging"

# The "real" sacct: prints the lines of $FAKE_SACCT_RECORDS (JobID|State|Elapsed), and counts its calls.
FAKE = """#!/usr/bin/env bash
echo x >> "$FAKE_SACCT_RECORDS.calls"
cat "$FAKE_SACCT_RECORDS"
"""


@pytest.fixture
def accounting(tmp_path, monkeypatch):
    """A lagging sacct (SACCT_LAG_S=1.5) in front of a stand-in that prints the records a test writes."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "sacct").write_text(FAKE)
    (real / "sacct").chmod(0o755)
    records = tmp_path / "records.txt"
    monkeypatch.setenv("FAKE_SACCT_RECORDS", str(records))
    monkeypatch.setenv("PATH", f"{LAGGING}{os.pathsep}{real}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SACCT_LAG_S", "1.5")
    monkeypatch.setenv("SACCT_LAG_DIR", str(tmp_path / "lag"))
    return records


def calls(records: Path) -> int:
    return len(Path(f"{records}.calls").read_text().splitlines())


def test_the_lagging_sacct_hides_a_recorded_end_for_its_lag_then_shows_it(accounting):
    """The test double itself: read at once, a requeued job that completed shows REQUEUED then RUNNING (as CI saw)."""
    accounting.write_text("11|REQUEUED|00:00:06\n11|COMPLETED|00:00:10\n")
    first = subprocess.run(["sacct", "-X", "-n", "-P", "-D", "-j", "11"], capture_output=True, text=True).stdout
    assert first.split() == ["11|REQUEUED|00:00:06", "11|RUNNING|00:00:10"]
    time.sleep(1.6)
    later = subprocess.run(["sacct", "-X", "-n", "-P", "-D", "-j", "11"], capture_output=True, text=True).stdout
    assert later.split() == ["11|REQUEUED|00:00:06", "11|COMPLETED|00:00:10"]


def test_final_states_waits_until_the_accounting_records_every_end(accounting):
    """One read would see RUNNING (the CI failure); the helper asks again until the end is recorded."""
    accounting.write_text("11|REQUEUED|00:00:06\n11|COMPLETED|00:00:10\n12_0|COMPLETED|00:00:07\n"
                          "12_1|CANCELLED by 0|00:00:01\n")
    start = time.monotonic()
    records = final_states(["11", "12"], poll_s=0.2, timeout_s=20)
    assert 1.4 < time.monotonic() - start < 15
    assert calls(accounting) > 1
    assert [r["State"] for r in records["11"]] == ["REQUEUED", "COMPLETED"]
    assert [(r["JobID"], r["State"]) for r in records["12"]] == [("12_0", "COMPLETED"), ("12_1", "CANCELLED by 0")]


def test_an_array_waits_for_each_task_not_only_its_last_record(tmp_path):
    """A finished task listed last does not end the wait while another task still runs."""
    rows = [[{"JobID": "12_0", "State": "RUNNING"}, {"JobID": "12_1", "State": "COMPLETED"}],
            [{"JobID": "12_0", "State": "COMPLETED"}, {"JobID": "12_1", "State": "COMPLETED"}]]
    seen = []

    def read(jobs, **_):
        seen.append(1)
        return {"12": rows[min(len(seen), 2) - 1]}

    assert final_states(["12"], read=read, poll_s=0.01)["12"] == rows[1]
    assert len(seen) == 2


def test_a_lag_past_the_timeout_fails_saying_what_sacct_showed_and_how_long_it_waited(accounting, monkeypatch):
    monkeypatch.setenv("SACCT_LAG_S", "600")
    accounting.write_text("11|REQUEUED|00:00:06\n11|COMPLETED|00:00:10\n")
    with pytest.raises(AccountingLag, match=r"end of job\(s\) 11 within [01] s .*showed 11: \['REQUEUED', 'RUNNING'\]"):
        final_states(["11"], poll_s=0.1, timeout_s=0.5)
    accounting.write_text("")
    with pytest.raises(AccountingLag, match="13: no record"):
        final_states(["13"], poll_s=0.1, timeout_s=0.3)


def test_the_command_line_prints_each_record_once_ended(accounting, capsys):
    accounting.write_text("11|REQUEUED|00:00:06\n11|COMPLETED|00:00:10\n")
    assert slurm_accounting.main(["11"]) == 0
    assert capsys.readouterr().out.split() == ["11|REQUEUED|00:00:06", "11|COMPLETED|00:00:10"]


def test_terminal_states_and_a_state_not_recorded_yet():
    assert is_terminal("CANCELLED by 0") and is_terminal("OUT_OF_MEMORY") and is_terminal("completed")
    assert not any(is_terminal(s) for s in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING", "UNKNOWN", ""))
    assert recorded_end("FAILED") == "FAILED"
    assert recorded_end("RUNNING") == "its end not recorded by Slurm's accounting yet: RUNNING"


def test_a_dead_slurm_point_whose_end_is_not_recorded_yet_says_so(accounting, tmp_path):
    """The reason a sweep gives for a Slurm job that left no result reads the job's state through submitit's
    watcher (sacct): a lagging record reads "not recorded yet", not RUNNING as if that were the job's end."""
    from submitit.slurm.slurm import SlurmJob

    from rlhf.launch.sweep_launchers import death_reason

    SlurmJob.watcher.clear()
    accounting.write_text("JobID|State|NodeList\n41|OUT_OF_MEMORY|node1\n")
    lagging = death_reason(SlurmJob(folder=tmp_path, job_id="41"))
    assert "(its end not recorded by Slurm's accounting yet: RUNNING)" in lagging, lagging
    SlurmJob.watcher.clear()
    time.sleep(1.6)
    recorded = death_reason(SlurmJob(folder=tmp_path, job_id="41"))
    assert "(job state OUT_OF_MEMORY)" in recorded and "not recorded" not in recorded, recorded
    SlurmJob.watcher.clear()


def test_a_failing_sacct_is_asked_again_and_named_at_the_timeout():
    """A busy slurmdbd's error (or a call that does not answer) is one more reason to wait, not an end."""
    answers = [RuntimeError("sacct: error: slurmdbd busy"), {"11": [{"JobID": "11", "State": "COMPLETED"}]}]

    def read(jobs, **_):
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert final_states(["11"], read=read, poll_s=0.01)["11"][0]["State"] == "COMPLETED"

    def failing(jobs, **_):
        raise RuntimeError("sacct: error: slurmdbd busy")

    with pytest.raises(AccountingLag, match="11: no record; its last call failed: sacct: error: slurmdbd busy"):
        final_states(["11"], read=failing, poll_s=0.05, timeout_s=0.2)
