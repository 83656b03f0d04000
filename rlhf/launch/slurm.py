"""Slurm resources derived from the ``hardware`` option, for ``conf/launcher/slurm.yaml`` (and ``submitit_local``).

``python train.py -m launcher=slurm ...`` submits one Slurm job per sweep point through hydra-submitit-launcher.
A job is one Hydra run: one task per node, which starts the run's own processes (:mod:`rlhf.launch.processes`), so the
job asks for what those processes need. The launcher options read it from the hardware option through the
resolvers below, registered when ``rlhf`` is imported:

- ``${rlhf.slurm_gpus:<device>,<num_processes>}``: GPUs per node. None for ``cpu`` and ``auto`` (``auto`` asks
  for no GPU: use ``hardware=gpu`` or ``ddp`` for GPU jobs), ``num_processes`` for ``cuda``. A ``cuda`` option
  with ``num_processes: null`` ("one per local GPU") is an error: the submitting machine may have no GPU to count.
- ``${rlhf.slurm_cpus:<num_processes>,<threads_per_process>,<partition>}``: CPUs per task = processes x threads
  (one thread per process unless ``threads_per_process`` is set; ``num_processes: null`` counts what the option starts
  on a node without GPU: 2 for ``fsdp``/``zero*``, else 1). A request larger than the largest node of the
  partition (asked of ``sinfo``, when it is installed) is refused: Slurm would keep such a job PENDING forever.
- ``${rlhf.local_gpus:<device>,<num_processes>}``: GPUs a ``submitit_local`` job may see (it runs on this machine,
  so ``auto`` and ``num_processes: null`` count this machine's GPUs).

The launcher is built once, from the config without the sweep's own overrides, so every job of one ``-m`` run
gets the same resources. A sweep over the hardware itself (``hardware=cpu,cpu_ddp``) would hand every point the
resources of the default hardware; the resolvers refuse it and say to run one sweep per hardware option.

A failing job (a user error, an exception in the run) is recorded in its run folder and counted by the sweep's
closing line (:mod:`rlhf.sweeps.points`), as under the local launcher; a job whose process dies (out of memory, a
segfault) is reported by submitit, where the sweep was started.

Several machines (``hardware=multinode hardware.num_nodes=N``): the job asks for N nodes, one task each; every task
runs the Hydra job, takes its node rank from ``SLURM_NODEID`` and meets the others at the first node of the job on a
port derived from the job id (:func:`rdzv_endpoint`). Only the first node writes the run folder (``.hydra/``,
``train.log``, and, as global rank 0, everything else).

Time limits and requeue: ``signal_delay_s`` before its time limit a job gets USR2. The run's handler
(:mod:`rlhf.run.signals`) lets the step finish, writes a checkpoint, then calls submitit's own handler, which requeues
the job (at most ``max_num_timeout`` times) and ends the process. The requeued job is the same Hydra job in the same
run folder (the folder's timestamp is cached in the pickled config), and ``resume: auto`` (set by
``conf/launcher/slurm.yaml``) continues from that checkpoint. Tested on a real Slurm by ``scripts/ci_slurm.sh``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Any

from omegaconf import OmegaConf

from rlhf.core.errors import UserError

log = logging.getLogger(__name__)

# Hardware fields that decide a job's resources: a sweep over any of them needs one launch per value.
_RESOURCE_KEYS = ("hardware", "hardware.device", "hardware.num_processes", "hardware.threads_per_process",
                  "hardware.num_nodes")


def slurm_gpus(device: str, num_processes: int | None, _root_: Any = None) -> int | None:
    """GPUs per node for a job of this hardware (None: ask for none)."""
    _refuse_hardware_sweep(_root_)
    if device != "cuda":
        return None
    if num_processes is None:
        raise UserError("launcher=slurm with hardware.device=cuda needs hardware.num_processes (the GPUs per node "
                        "to ask for): null means 'one per local GPU', which the submitting machine cannot count. "
                        "Fix: e.g. hardware.num_processes=8")
    return int(num_processes)


def slurm_cpus(num_processes: int | None, threads_per_process: int | None, partition: str | None = None,
               _root_: Any = None) -> int:
    """CPUs per task: the job's processes x threads each, checked against the partition's largest node."""
    _refuse_hardware_sweep(_root_)
    processes = int(num_processes) if num_processes is not None else _processes_without_gpu(_root_)
    threads = int(threads_per_process or 1)
    cpus = processes * threads
    largest = largest_node_cpus(partition)
    if largest is not None and cpus > largest:
        where = f"partition {partition}" if partition else "the default partition"
        raise UserError(
            f"hydra.launcher.cpus_per_task={cpus} (hardware.num_processes={processes} x {threads} thread(s)) but the "
            f"largest node of {where} has {largest} CPUs: Slurm would keep the job PENDING forever. Fix: fewer "
            f"processes or threads (e.g. hardware.num_processes={max(1, largest // threads)}), or a partition with "
            "bigger nodes (hydra.launcher.partition=...)")
    return cpus


def _processes_without_gpu(root: Any) -> int:
    """``hardware.num_processes: null`` on a node given no GPU (``slurm_gpus`` asks for none unless the device is
    ``cuda``, which needs the number): the processes the hardware option starts there, asked of its class
    (``fsdp``/``zero*``: 2, the fewest that shard; the others: 1)."""
    target = OmegaConf.select(root, "hardware._target_") if root is not None else None
    if target is None:
        return 1
    from hydra.utils import get_class

    counted = getattr(get_class(target), "processes_without_gpu", None)  # a strategy of one's own may not say
    return int(counted(None)) if counted is not None else 1


def local_gpus(device: str, num_processes: int | None) -> int:
    """GPUs a submitit_local job may see (it sets CUDA_VISIBLE_DEVICES to the first N): 0 on the CPU."""
    if device == "cpu":
        return 0
    import torch

    count = torch.cuda.device_count()
    if device == "cuda" and num_processes is not None:
        return int(num_processes)
    return count


def slurm_node() -> int | None:
    """This machine's index among the nodes of the Slurm job that submitit started here (``SLURM_NODEID``: every
    node's task runs the same Hydra job), else None."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_NODEID" in os.environ:
        return int(os.environ["SLURM_NODEID"])
    return None


def node_rank() -> int:
    """``hardware.node_rank`` of ``multinode``: the Slurm node index in a Slurm job, else ``$NODE_RANK``, else 0."""
    node = slurm_node()
    return node if node is not None else int(os.environ.get("NODE_RANK", "0"))


def rdzv_endpoint(num_nodes: int) -> str | None:
    """``hardware.rdzv_endpoint`` of ``multinode``: ``$RDZV_ENDPOINT`` when set; in a Slurm job of several nodes,
    the job's first host (submitit parses Slurm's compressed node list) and a port derived from the job id, so that
    every node agrees without talking; else None (the strategy then asks for it)."""
    if os.environ.get("RDZV_ENDPOINT"):
        return os.environ["RDZV_ENDPOINT"]
    if slurm_node() is None or int(num_nodes) <= 1:
        return None
    from submitit import JobEnvironment

    return f"{JobEnvironment().hostnames[0]}:{port_for_job(int(os.environ['SLURM_JOB_ID']))}"


def port_for_job(job_id: int) -> int:
    """The rendezvous port of a Slurm job: in 20000..59999, the same on every node, different for jobs whose ids
    are less than 40000 apart."""
    return 20000 + job_id % 40000


def on_first_node(value: Any) -> Any:
    """``value`` on the first node of a Slurm job (and outside Slurm), None on the others: every node's task runs the
    Hydra job, and only the first writes the run folder (``hydra.output_subdir``: ``.hydra/``)."""
    return value if slurm_node() in (None, 0) else None


def log_to_the_run_folder_from_the_first_node_only() -> None:
    """On another node of a Slurm job, stop Hydra's ``train.log`` handler (the first node writes the run's log;
    this node's warnings still reach its own stderr, which Slurm keeps)."""
    if slurm_node() in (None, 0):
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def in_submitit_job() -> bool:
    """True inside a job started by submitit (launcher=slurm or submitit_local)."""
    return "SUBMITIT_EXECUTOR" in os.environ


def largest_node_cpus(partition: str | None) -> int | None:
    """The CPU count of the largest node of `partition` (None: the default partition), from ``sinfo``; None when
    sinfo is not installed or cannot answer (the check is then skipped)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        # -N: a line per node and partition; -a: hidden partitions too. "%P" marks the default partition with "*".
        out = subprocess.run(["sinfo", "-h", "-N", "-a", "-o", "%P|%c"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("sinfo failed (%s): not checking hydra.launcher.cpus_per_task against the nodes", error)
        return None
    rows = []
    for line in out.splitlines():
        name, _, cpus = line.strip().partition("|")
        if name and cpus.strip().isdigit():
            rows.append((name, int(cpus)))
    if partition:
        wanted = set(partition.split(","))  # sbatch --partition takes a list
        counts = [c for name, c in rows if name.rstrip("*") in wanted]
    else:
        counts = [c for name, c in rows if name.endswith("*")] or [c for _, c in rows]
    if not counts:
        log.warning("sinfo lists no node for partition %s: not checking hydra.launcher.cpus_per_task", partition)
        return None
    return max(counts)


def _refuse_hardware_sweep(root: Any) -> None:
    """Refuse a sweep over the hardware's resources (one launcher, hence one set of resources, per -m run)."""
    overrides = OmegaConf.select(root, "hydra.overrides.task", default=None) if root is not None else None
    if not overrides:
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # Hydra has parsed them already; never fail here on a form this check does not know
        return
    for override in parsed:
        if override.is_sweep_override() and override.key_or_group in _RESOURCE_KEYS:
            raise UserError(
                f"a Slurm sweep over {override.input_line} would give every job the resources of one hardware "
                "option (the launcher is configured once per -m run). Fix: one sweep per value, e.g. "
                f"`python train.py -m launcher=slurm {override.key_or_group}=<value> ...`, or set "
                "hydra.launcher.cpus_per_task and hydra.launcher.gpus_per_node yourself for the largest point.")


OmegaConf.register_new_resolver("rlhf.slurm_gpus", slurm_gpus, replace=True)
OmegaConf.register_new_resolver("rlhf.slurm_cpus", slurm_cpus, replace=True)
OmegaConf.register_new_resolver("rlhf.local_gpus", local_gpus, replace=True)
OmegaConf.register_new_resolver("rlhf.node_rank", node_rank, replace=True)
OmegaConf.register_new_resolver("rlhf.rdzv_endpoint", rdzv_endpoint, replace=True)
OmegaConf.register_new_resolver("rlhf.on_first_node", on_first_node, replace=True)
