"""rlhf/launch/processes.py: each check and each build once per process, and resume resolved in one place."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import FAST, ROOT

# Runs train.py in this interpreter after wrapping the functions to count; prints the counts as the last line.
_COUNTING = r"""
import json, runpy, sys
import rlhf.run.checkpoint, rlhf.config.checks, rlhf.launch.processes
from rlhf.hardware.base import DataParallel

counts = {"check_config": 0, "strategy": 0, "resume_resolved": 0}

def counted(key, function):
    def wrapper(*args, **kwargs):
        counts[key] += 1
        return function(*args, **kwargs)
    return wrapper

check = counted("check_config", rlhf.config.checks.check_config)
rlhf.config.checks.check_config = rlhf.launch.processes.check_config = check
rlhf.run.checkpoint.resolve = counted("resume_resolved", rlhf.run.checkpoint.resolve)
DataParallel.__init__ = counted("strategy", DataParallel.__init__)
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    print(json.dumps(counts))
"""


def _counts(*args: str) -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _COUNTING, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_single_run_is_checked_built_and_resolved_once(tmp_path):
    """The Hydra callback checks; train.py's entry does not check again; one strategy; resume resolved once."""
    counts = _counts(*FAST, "train.save_every_steps=3", f"hydra.run.dir={tmp_path}")
    assert counts == {"check_config": 1, "strategy": 1, "resume_resolved": 1}
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
    record = {p.name: p.read_text() for p in (tmp_path / ".hydra").iterdir()}
    # As a user resumes: the folder, resume=auto and the one deliberate change; the run's own overrides (FAST: a
    # smaller model, which the resume check would refuse to change) come from its record.
    resumed = _counts(f"hydra.run.dir={tmp_path}", "resume=auto", "train.max_steps=4",
                      "resume_changes=[train.max_steps]")
    assert resumed == {"check_config": 1, "strategy": 1, "resume_resolved": 1}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "perf/checkpoint_time_s" not in line]
    assert steps == [0, 1, 2, 3, 3, 4, 4]  # it did resume: step 4's train and eval lines follow step 3's
    assert [line["step"] for line in lines if "perf/checkpoint_time_s" in line] == [3]  # the checkpoint's seconds
    assert {p.name: p.read_text() for p in (tmp_path / ".hydra").glob("*.yaml")} == record  # the run's own record
    (attempt,) = (tmp_path / ".hydra").glob("attempt-*")  # the resumed attempt's, beside it
    assert (attempt / "resumed_from.txt").read_text().strip().endswith("step_00000003")
    assert (attempt / "overrides.yaml").read_text().splitlines()[-3:] == [
        "- resume=auto", "- train.max_steps=4", "- resume_changes=[train.max_steps]"]


def test_a_sweep_checks_its_base_then_each_job_once(tmp_path):
    """on_multirun_start checks the sweep's base config before the sweep folder exists; each job's own config is
    checked once, in the job."""
    counts = _counts("-m", *FAST, "train.max_steps=1", "seed=0,1", f"hydra.sweep.dir={tmp_path}")
    assert counts == {"check_config": 1 + 2, "strategy": 2, "resume_resolved": 2}


# Runs train.py with the model taken for one other than the embedded one, on a machine of 1 CPU.
_ANOTHER_MODEL_ON_ONE_CPU = r"""
import runpy, sys
import rlhf.config.tuned_defaults, rlhf.hardware.cpus
rlhf.config.tuned_defaults.embedded_model = lambda model: False
rlhf.hardware.cpus.cpus_available = lambda: 1
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_the_start_up_warnings_of_a_run_name_what_the_user_left_and_what_oversubscribes(tmp_path):
    """Under train.py, once each, before the first step: the defaults tuned on the embedded model that the command
    leaves (not algo.beta, which it sets), the warmup longer than the run, and 2 threads on 1 CPU (red: any of them
    missing, or the beta the user typed named)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _ANOTHER_MODEL_ON_ONE_CPU, *FAST, "algo.beta=0.1",
                          "hardware.threads_per_process=2", f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    warnings = [line.split("[WARNING] - ", 1)[1] for line in log.splitlines() if "[WARNING] - " in line]
    tuned = [w for w in warnings if w.startswith("defaults tuned on the embedded tiny model")]
    assert len(tuned) == 1 and "algo.beta" not in tuned[0], warnings
    assert tuned[0].startswith("defaults tuned on the embedded tiny model, not for model=tiny: optimizer.lr=1e-4 (TRL "
                               "DPOConfig: 1e-6), scheduler.num_warmup_steps=10 (TRL: 0). ")
    assert [w for w in warnings if w.startswith("scheduler.num_warmup_steps=10 is not shorter than the run's 3 ")]
    assert [w for w in warnings if w.startswith("1 process(es) x 2 thread(s) = 2 threads on 1 CPU(s) "
                                                "(hardware.threads_per_process=2)")]
    assert log.index(tuned[0]) < log.index("hardware: ")  # at start-up
