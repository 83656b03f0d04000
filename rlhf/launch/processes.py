"""Starting the processes of one run: `rlhf.train(cfg)` is one Hydra job, one run folder, any number of processes.

- One process (``hardware=cpu``, ``gpu``, ``auto`` on one device): the loop runs here.
- Several (``cpu_ddp``, ``ddp``, ``fsdp``, ``zero*``, ``multinode``): this process starts them with torch's elastic
  launch API (``spawn``; a c10d rendezvous on a free port of 127.0.0.1, or ``hardware.rdzv_endpoint`` across
  machines), hands them the config resolved once here, and returns rank 0's metrics. A failing rank stops the
  others within seconds; its error comes back as one plain exception (a :class:`UserError` stays one).
- Already started by someone else (``torchrun``, ``accelerate launch``: ``WORLD_SIZE`` is set): the loop runs
  here on the ranks it was given, and never launches again.

Whatever the number of processes, only global rank 0 writes the run folder (metrics, log, checkpoints, model).
This process holds the folder's lock for the whole run and resolves ``resume`` once, before any rank starts
(:mod:`rlhf.run.folder`). A stop signal ends the ranks after their checkpoint and comes back as
:class:`~rlhf.run.signals.Stopped`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import logging.config
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlhf.config import tuned_defaults
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build, in_a_sweep
from rlhf.hardware import cpus
from rlhf.hardware.cpus import THREADS_WHY
from rlhf.hardware.ports import free_port
from rlhf.hardware.precision import computes_in_bf16, model_dtype
from rlhf.run import checkpoint, resume_check, signals
from rlhf.run import folder as run_folder
from rlhf.run.signals import Stopped, catch_stop_signals

log = logging.getLogger(__name__)

_USER_ERROR = "rlhf.UserError: "
_STOPPED = "__stopped__"


def launched_elsewhere() -> bool:
    """True when a launcher (torchrun, accelerate launch, or this module) already started this process as a rank."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def train(cfg: DictConfig) -> dict[str, float]:
    """Check `cfg`, then train as it says (:func:`run`); return the final metrics. The entry for Python callers."""
    check_config(cfg)
    return run(cfg)


def run(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` (already checked in this process: ``train.py`` after :class:`~rlhf.config.checks.CheckBeforeRun`)
    says, on as many processes as ``cfg.hardware`` asks for; return the final metrics.

    The strategy is built here once; ``resume`` is resolved here once (:func:`rlhf.run.folder.prepare`), by every
    process that enters, before any rank of this run starts training."""
    from rlhf.run import loop

    signals.reached("startup")
    strategy = build(cfg.hardware)
    run_dir = Path(cfg.output_dir)
    started_here = run_folder.owned_by_parent() or launched_elsewhere()  # a rank: the loop runs in this process
    holds_folder = strategy.node_rank == 0 and not run_folder.owned_by_parent() and os.environ.get("RANK", "0") == "0"
    # The main machine's first process holds the folder (one lock); the others only read which checkpoint to resume.
    with run_folder.claim(run_dir) if holds_folder else contextlib.nullcontext():
        resume = run_folder.prepare(run_dir, cfg.get("resume"))
        processes = strategy.processes_per_node()
        # Decided once, before the resume check compares it: here for every process this one starts (they inherit
        # it), by each rank that someone else started. A sweep's points share one measurement of the machine's load.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if started_here else processes
        sweep = Path(HydraConfig.get().sweep.dir) if in_a_sweep() else None
        strategy.threads(local, resumed=resume_check.recorded_threads(resume) if resume else None,
                         busy=(lambda: cpus.sweep_load(sweep)) if sweep is not None else None,
                         bf16=computes_in_bf16(strategy.mixed_precision, model_dtype(cfg.get("model"))))
        warn_at_start(cfg, strategy, local, once_per_run=holds_folder)
        if resume is not None:  # before any process starts or anything loads: the config a resume must keep
            resume_check.check_config(cfg, strategy, resume)
            run_folder.record_resume(resume)
        if started_here or (processes == 1 and strategy.num_nodes == 1):
            return loop.train(cfg, strategy, resume)
        return _start(cfg, resume, processes, strategy.threads_settled, strategy.num_nodes, strategy.node_rank,
                      strategy.rdzv_endpoint, strategy_why=getattr(strategy, "_threads_why", ""))


def warn_at_start(cfg: DictConfig, strategy, local: int, once_per_run: bool) -> None:
    """Start-up warnings decided before anything loads: more threads than this machine's CPUs (by the first process
    of each machine), and defaults tuned on the embedded model left on another model (once per run:
    ``once_per_run``, the process that holds the run folder)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        line = cpus.oversubscribed(strategy.threads_settled, local, strategy.threads_per_process)
        if line:
            log.warning("%s", line)
    if once_per_run:
        overrides, model = tuned_defaults.hydra_context()
        line = tuned_defaults.warning(cfg, overrides, model)
        if line:
            log.warning("%s", line)


def _start(cfg: DictConfig, resume: Path | None, processes: int, threads: int, nodes: int, node_rank: int,
           endpoint: str | None, strategy_why: str = "") -> dict[str, float]:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    container = OmegaConf.to_container(cfg, resolve=True)  # resolved here: ${hydra:...} means nothing in a child
    run_id = hashlib.sha1(str(cfg.output_dir).encode()).hexdigest()[:12]  # the same on every machine
    config = LaunchConfig(
        min_nodes=nodes, max_nodes=nodes, nproc_per_node=processes, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=endpoint or f"127.0.0.1:{free_port()}",
        rdzv_configs={"is_host": node_rank == 0, "join_timeout": 600},
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=None),
    )
    log.info("starting %d process(es) on this machine (%d machine(s) in all)", processes, nodes)
    quiet = logging.getLogger("torch.distributed.elastic")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its INFO and WARNING lines (e.g. closing the ranks on Ctrl-C) mean nothing to a user
    omp, why = os.environ.get("OMP_NUM_THREADS"), os.environ.get(THREADS_WHY)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the children's thread count: processes x threads <= CPUs
    if strategy_why:
        os.environ[THREADS_WHY] = strategy_why  # why, for the start-up line the children print
    try:
        with catch_stop_signals() as request:
            if request.signum is not None:  # before any rank exists: stop here, nothing new to save
                raise Stopped(request.signum, resume, Path(cfg.output_dir), checkpoint.step_of(resume) if resume else 0)
            results = _launch_and_wait(elastic_launch(config, _worker), request,
                                       container, str(resume) if resume else None, _logging_config())
    except ChildFailedError as error:
        raise _plain(error) from None  # ChildFailedError does not survive submitit's pickling of a result
    finally:
        quiet.setLevel(level)
        for name, value in (("OMP_NUM_THREADS", omp), (THREADS_WHY, why)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    result = results.get(0, {}) if results else {}
    if _STOPPED in result:  # rank 0 stopped on a signal after its checkpoint
        signum, folder, step = result[_STOPPED]
        raise Stopped(request.signum or signum, Path(folder) if folder else None, Path(cfg.output_dir), step)
    if request.signum is not None:
        log.warning("received %s after the last step: the run finished first (nothing to resume)",
                    signal.Signals(request.signum).name)
    return result


def _launch_and_wait(launch, request, *args) -> dict:
    """Run torch's elastic agent in a thread of its own, which starts the ranks with the stop signals blocked (they
    unblock them once their handler is installed). The agent, outside the main thread, installs no signal handlers:
    this process's own handler records a stop signal, and this thread passes it on to every rank (however long their
    step and checkpoint take; no 30 s grace). A second Ctrl-C kills the ranks and aborts."""
    outcome: dict[str, Any] = {}

    def agent() -> None:
        signals.block()  # inherited by the ranks this thread spawns
        try:
            outcome["results"] = launch(*args)
        except BaseException as error:  # handed to the main thread
            outcome["error"] = error

    thread = threading.Thread(target=agent, name="rlhf-ranks", daemon=True)
    forward = signals.Forwarder(request)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.05)
            forward()
    except KeyboardInterrupt:  # the second Ctrl-C
        _quiet_teardown()
        forward.kill_all()
        thread.join(30)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


def _quiet_teardown() -> None:
    """Silence torch's elastic agent and spawn helpers for an abort: the ranks are killed on purpose, and the
    agent would otherwise log, depending on which of them it notices first, a traceback for each killed rank
    (torch's loggers set their own levels, so each is disabled by name)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).disabled = True


def _plain(error: Exception) -> Exception:
    """The failing ranks' own message as a plain exception (a UserError when a rank raised one)."""
    failures = getattr(error, "failures", {})
    messages = {rank: _failure_message(f) for rank, f in failures.items()}
    for _, message in sorted(messages.items()):
        if _USER_ERROR in message:
            return UserError(message.split(_USER_ERROR, 1)[1].strip())
    first = getattr(error, "get_first_failure", lambda: (None, None))()[0]
    rank = first if first in messages else min(messages, default=None)
    detail = messages.get(rank, str(error))
    return RuntimeError(f"rank {rank} failed: {detail}")


def _failure_message(failure: Any) -> str:
    message = getattr(failure, "message", "")
    if isinstance(message, dict):
        message = message.get("message", "") or str(message)
    return str(message) or f"exit code {getattr(failure, 'exitcode', '?')}"


def _logging_config() -> dict | None:
    """Hydra's logging setup for this job, resolved, for the children (spawned processes start with none)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)
    except Exception:  # not under Hydra (rlhf.train called from Python)
        pass
    return None


def configure_worker_logging(logging_config: dict | None, rank: int) -> None:
    """Rank 0 logs like the parent (console and train.log); the others print warnings and errors only."""
    if rank == 0 and logging_config:
        logging.config.dictConfig(logging_config)
    elif rank == 0:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}][%(name)s][%(levelname)s] - %(message)s")
        import datasets

        datasets.disable_progress_bars()


def _worker(container: dict, resume: str | None, logging_config: dict | None) -> dict[str, float]:
    """One rank: rebuild the config (checked and resolved by the parent: not checked again), build the strategy and
    run the loop from the parent's ``resume``. Errors are logged here, where the cause is known."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from rlhf.run import loop

    _die_with_parent()
    signals.reached("rank_startup")  # tests: a signal before this rank's handler (held back: see rlhf.run.signals)
    rank = int(os.environ.get("RANK", "0"))
    signals.install(announce=False, ctrl_c=False)  # for the rank's whole life; then what came meanwhile is delivered
    configure_worker_logging(logging_config, rank)

    @record
    def run() -> dict[str, float]:
        try:
            cfg = OmegaConf.create(container)
            return loop.train(cfg, build(cfg.hardware), Path(resume) if resume else None)
        except UserError as error:
            raise RuntimeError(f"{_USER_ERROR}{error}") from None
        except Stopped as stopped:  # a clean stop, after the checkpoint: the parent reads it from rank 0's result
            return {_STOPPED: (stopped.signum, str(stopped.checkpoint or ""), stopped.step)}
        except KeyboardInterrupt:  # not expected (the rank ignores Ctrl-C): abort quietly
            os._exit(130)

    try:
        return run()
    finally:  # the rank's work is done (or failed): a late stop signal must not kill it while it exits
        signals.ignore()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the process that started it dies (even by SIGKILL): ranks that outlive
    a killed run would go on training and writing its folder."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


# --- one run folder under torchrun / accelerate launch ----------------------------------------------------------
def launch_time() -> datetime.datetime:
    """When this run was started: for ranks started by torchrun or `accelerate launch`, the start of their common
    parent (the launcher), so that every rank names the same Hydra run folder; else now."""
    if launched_elsewhere() and "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
            boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                        if line.startswith("btime"))
            return datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return _NOW


_NOW = datetime.datetime.fromtimestamp(time.time())


def hydra_overrides_for_this_rank() -> list[str]:
    """Extra Hydra overrides for a rank other than 0 started by an outside launcher: Hydra still composes the
    config in every rank, but only rank 0 writes ``.hydra/`` and ``train.log``."""
    if launched_elsewhere() and os.environ.get("RANK", "0") != "0":
        return ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    return []


# hydra.run.dir / hydra.sweep.dir use ${rlhf.now:<format>}: the same folder for every rank of a torchrun launch.
# use_cache: Hydra copies resolved values into each sweep job (and a requeued Slurm job), so the folder stays the
# same when a job starts minutes after the sweep.
OmegaConf.register_new_resolver("rlhf.now", lambda fmt: launch_time().strftime(fmt), replace=True, use_cache=True)
