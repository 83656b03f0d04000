"""The launcher options: the Slurm resources derived from the hardware option (rlhf/launch/slurm.py), offline.

No Slurm is needed: ``sinfo`` is simulated by a script put first on PATH (or hidden), so these tests give the same
answer on a laptop, in CI, and on a machine where a real Slurm is running.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

import rlhf.launch.slurm  # noqa: F401  (registers the resolvers, as `import rlhf` does)
from rlhf.core.errors import UserError
from rlhf.launch.slurm import largest_node_cpus, slurm_cpus
from tests.conftest import CONF, ROOT, compose_config


@pytest.fixture
def sinfo(tmp_path, monkeypatch):
    """``sinfo(text)`` makes ``sinfo`` print `text` (lines of "<partition>|<cpus>", the default one marked "*");
    ``sinfo(None)``: no sinfo at all; ``sinfo(fail=True)``: an sinfo that fails (controller down)."""

    def make(text: str | None = "debug*|64", fail: bool = False) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "sinfo"
        if text is None and not fail:
            script.unlink(missing_ok=True)
            monkeypatch.setenv("PATH", str(bin_dir))  # nothing else on PATH either: no real sinfo found
            return
        body = "echo 'sinfo: error: Unable to contact slurm controller' >&2; exit 1" if fail else f"cat <<'EOF'\n{text}\nEOF"
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    return make


def launcher(*overrides: str) -> dict:
    """hydra.launcher as the slurm/submitit launcher receives it, resolved against the composed config."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


def test_cpu_ddp_asks_for_one_task_with_two_cpus_and_no_gpu(sinfo):
    sinfo("debug*|2")
    node = launcher("launcher=slurm", "hardware=cpu_ddp")
    assert node["_target_"].endswith("SlurmLauncher")
    assert (node["nodes"], node["tasks_per_node"], node["cpus_per_task"]) == (1, 1, 2)
    assert not node["gpus_per_node"]
    assert node["max_num_timeout"] >= 1 and node["signal_delay_s"] == 120
    assert launcher("launcher=slurm", "hardware=cpu")["cpus_per_task"] == 1
    assert launcher("launcher=slurm", "hardware=cpu_ddp", "hardware.threads_per_process=1")["cpus_per_task"] == 2


def test_gpus_per_node_follow_the_cuda_processes(sinfo):
    sinfo("debug*|64")
    node = launcher("launcher=slurm", "hardware=ddp", "hardware.num_processes=8")
    assert (node["gpus_per_node"], node["cpus_per_task"], node["tasks_per_node"]) == (8, 8, 1)
    assert launcher("launcher=slurm", "hardware=gpu")["gpus_per_node"] == 1
    assert not launcher("launcher=slurm", "hardware=auto")["gpus_per_node"]  # auto asks for no GPU
    node = launcher("launcher=slurm", "hardware=ddp", "hardware.num_processes=4", "hardware.threads_per_process=8")
    assert (node["gpus_per_node"], node["cpus_per_task"]) == (4, 32)


def test_cuda_with_processes_null_is_a_clear_error(sinfo):
    sinfo(None)
    with pytest.raises(InterpolationResolutionError, match=r"needs hardware.num_processes.*Fix: e.g. hardware.num_processes=8"):
        launcher("launcher=slurm", "hardware=ddp")


def test_more_cpus_than_the_largest_node_are_refused(sinfo):
    sinfo("debug*|2\nbig|64\nbig|32")
    with pytest.raises(InterpolationResolutionError,
                       match=r"hydra.launcher.cpus_per_task=4 .* largest node of the default partition has 2 CPUs.*PENDING"):
        launcher("launcher=slurm", "hardware=cpu_ddp", "hardware.num_processes=4")
    with pytest.raises(UserError, match=r"cpus_per_task=128 .* partition big has 64 CPUs"):
        slurm_cpus(64, 2, "big")
    node = launcher("launcher=slurm", "hardware=cpu_ddp", "hardware.num_processes=4", "hydra.launcher.partition=big")
    assert node["cpus_per_task"] == 4 and node["partition"] == "big"
    assert largest_node_cpus("big") == 64 and largest_node_cpus("debug,big") == 64 and largest_node_cpus(None) == 2


def test_without_a_working_sinfo_the_check_is_skipped(sinfo):
    sinfo(None)
    assert largest_node_cpus(None) is None
    assert launcher("launcher=slurm", "hardware=cpu_ddp", "hardware.num_processes=16")["cpus_per_task"] == 16
    sinfo(fail=True)
    assert largest_node_cpus(None) is None
    sinfo("debug*|2")
    assert largest_node_cpus("no_such_partition") is None  # sbatch names the bad partition itself


def test_a_sweep_over_the_hardware_is_refused():
    """One launcher per -m run means one set of resources: every point of hardware=cpu,cpu_ddp would get cpu's."""
    root = OmegaConf.create({"hydra": {"overrides": {"task": ["launcher=slurm", "hardware=cpu,cpu_ddp"]}}})
    with pytest.raises(UserError, match=r"sweep over hardware=cpu,cpu_ddp.*one sweep per value"):
        slurm_cpus(2, None, None, _root_=root)
    root = OmegaConf.create({"hydra": {"overrides": {"task": ["hardware.num_processes=1,2"]}}})
    with pytest.raises(UserError, match="hardware.num_processes=1,2"):
        rlhf.launch.slurm.slurm_gpus("cuda", 2, _root_=root)
    root = OmegaConf.create({"hydra": {"overrides": {"task": ["hardware=cpu_ddp", "optimizer=sgd,lion",
                                                               "hardware.mixed_precision=no,bf16"]}}})
    assert rlhf.launch.slurm.slurm_gpus("cpu", 2, _root_=root) is None


def test_submitit_local_shows_no_gpu_to_cpu_jobs():
    node = launcher("launcher=submitit_local", "hardware=cpu_ddp")
    assert node["_target_"].endswith("LocalLauncher")
    assert (node["gpus_per_node"], node["nodes"], node["tasks_per_node"]) == (0, 1, 1)


def test_the_command_line_shows_the_slurm_config_without_slurm(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # no sinfo, no sbatch
    out = subprocess.run([sys.executable, "train.py", "launcher=slurm", "hardware=cpu_ddp", "--cfg", "all",
                          "--resolve"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    launcher_cfg = OmegaConf.create(out.stdout).hydra.launcher
    assert (launcher_cfg.cpus_per_task, launcher_cfg.tasks_per_node, launcher_cfg.nodes) == (2, 1, 1)


def test_each_node_of_a_multinode_slurm_job_derives_its_rank_and_the_rendezvous(monkeypatch):
    """In a Slurm job that submitit started (one task per node): the node rank is SLURM_NODEID, the rendezvous is
    the job's first host (from Slurm's compressed node list) on a port derived from the job id, the same on every
    node; only the first node writes .hydra/. Outside Slurm: NODE_RANK / RDZV_ENDPOINT, or 0 / none."""
    for key in ("SUBMITIT_EXECUTOR", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "NODE_RANK",
                "RDZV_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)

    def composed() -> tuple:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=["hardware=multinode", "output_dir=x"], return_hydra_config=True)
        return cfg.hardware.node_rank, cfg.hardware.rdzv_endpoint, cfg.hydra.output_subdir

    assert composed() == (0, None, ".hydra")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("RDZV_ENDPOINT", "10.0.0.1:29500")
    assert composed() == (1, "10.0.0.1:29500", ".hydra")  # outside Slurm every machine writes its own .hydra/
    monkeypatch.delenv("RDZV_ENDPOINT")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[03-04]")
    ports = set()
    for node in (0, 1):
        monkeypatch.setenv("SLURM_NODEID", str(node))
        rank, endpoint, subdir = composed()
        assert rank == node and subdir == (".hydra" if node == 0 else None)
        ports.add(endpoint)
    assert ports == {f"gpu03:{rlhf.launch.slurm.port_for_job(123456)}"}
    assert 20000 <= rlhf.launch.slurm.port_for_job(123456) < 60000
    assert rlhf.launch.slurm.port_for_job(123456) != rlhf.launch.slurm.port_for_job(123457)


@pytest.mark.parametrize("option, cpus", [("fsdp", 2), ("zero3", 2), ("auto", 1), ("multinode", 1), ("cpu_ddp", 2)])
def test_a_cpu_job_asks_for_a_cpu_per_process_the_option_starts(option, cpus):
    """hardware.num_processes: null on a node without GPU: fsdp and zero* start 2 processes there, so the job asks
    for 2 CPUs (red when null counted as 1 process for every option); the class says it, as it does at run time."""
    cfg = compose_config(f"hardware={option}")
    assert slurm_cpus(cfg.hardware.num_processes, None, None, _root_=cfg) == cpus
    strategy = get_class(cfg.hardware._target_)
    assert strategy.processes_without_gpu(cfg.hardware.num_processes) == cpus
