"""Sweep points whose process dies, under the submitit launchers (``launcher=submitit_local``, ``launcher=slurm``).

Each point of such a sweep runs in a process of its own. A point that fails by an exception is recorded by the
point itself (:mod:`rlhf.sweeps.points`); one whose process dies (the out-of-memory killer's SIGKILL, a segfault, a Slurm
job cancelled or out of time) leaves no result, and Hydra's submitit launcher then raises submitit's
``UncompletedJobError`` while it collects the batch's results: the whole sweep ended there, with a traceback, no
closing line, and its later batches never launched. :class:`DeadPointsFail` collects the results job by job
instead: a job that ended without a result becomes a failed point, its ``failed.json`` (:data:`rlhf.sweeps.points.FAILED`)
written by the sweep's process in the point's run folder with the reason (the job's state and what its error log
says), and handed to Hydra as a :class:`~rlhf.sweeps.points.FailedPoint`, as a point that failed by an exception is: the
sweep goes on, :class:`~rlhf.sweeps.points.SweepSummary` counts it in its closing line, and ``train.py`` exits 1.

The launchers themselves are in ``hydra_plugins/rlhf_launchers.py`` (Hydra builds a launcher only from a class of
the ``hydra_plugins`` package); this module holds what they do.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlhf.launch import submitit_job
from rlhf.launch.slurm_accounting import is_terminal, recorded_end
from rlhf.sweeps.points import FailedPoint, record_failure

log = logging.getLogger(__name__)
_HEALTHY_STATES = ("FINISHED", "COMPLETED", "UNKNOWN")  # submitit's local jobs read FINISHED whatever the task's end


class ProcessDied(RuntimeError):
    """A sweep point's process ended without a result (recorded as the ``error`` of its ``failed.json``)."""


_PROGRESS = re.compile(r"^\w[\w ]*:\s+\d+%\|.*\]")  # a progress bar (tqdm), up to its closing "]"
_TROUBLE = re.compile(r"error|killed|fatal|signal|oom", re.IGNORECASE)


def last_log_line(text: str, limit: int = 300) -> str:
    """The line of a job's error log that tells most why it ended: the last one naming trouble (``srun: error: ...
    task 0: Killed``, ``Fatal Python error: Segmentation fault``, ``slurmstepd: error: Detected 1 oom_kill event``,
    an exception), else the last one that says something. Progress bars and blank lines are skipped (text glued
    after a bar is kept)."""
    lines = [_PROGRESS.sub("", line).strip() for line in text.replace("\r", "\n").splitlines()]
    said = [line for line in lines if line]
    trouble = [line for line in said if _TROUBLE.search(line)]
    line = (trouble or said or [""])[-1]
    return line if len(line) <= limit else line[:limit] + "..."


def death_reason(job: Any) -> str:
    """Why a submitit job left no result, from what submitit knows: its state and its error log. A Slurm job's state
    comes from the accounting (``sacct``), which records a job's end a moment after it: one not terminal yet is said
    to be not recorded yet (:func:`rlhf.launch.slurm_accounting.recorded_end`), not read as the job's end."""
    from submitit.slurm.slurm import SlurmJob

    state = str(job.state)
    if isinstance(job, SlurmJob) and not is_terminal(state):
        said = f" ({recorded_end(state)})"
    else:
        said = f" (job state {state})" if state.upper() not in _HEALTHY_STATES else ""
    try:
        text = job.stderr() or ""
        where = str(job.paths.stderr)
    except OSError:
        text, where = "", "unknown"
    line = last_log_line(text)
    tail = f"; its log says: {line!r}" if line else ""
    return (f"the process ended without a result{said}: killed (out of memory?), crashed (a segfault?) or "
            f"stopped{tail}; its log: {where}")


class _Collected:
    """A submitted job whose ``results()`` returns a failed point, instead of raising, when the job left no
    result."""

    def __init__(self, job: Any, launcher: Any, overrides: Sequence[str], job_num: int) -> None:
        self.job, self.launcher, self.overrides, self.job_num = job, launcher, list(overrides), job_num
        if getattr(launcher, "_EXECUTOR", None) == "local":  # on this machine a result is written before the
            job._results_timeout_s = 1  # job ends: no need for the 15 s submitit waits for a slow shared disk

    def results(self) -> list:
        from submitit.core.utils import UncompletedJobError

        try:
            return self.job.results()
        except UncompletedJobError:
            return [self.launcher.failed_point(self.overrides, self.job_num, death_reason(self.job))]


class DeadPointsFail:
    """Mixin for Hydra's submitit launchers: a job that ends without a result is a failed point of the sweep
    (see the module docstring); every other job's result is collected as before."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        self._travel_by_value()
        with self._collecting():
            return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]

    def _travel_by_value(self) -> None:
        """Each job unpickles this launcher. Its class lives in ``hydra_plugins/`` beside ``train.py``, which a job
        started from another working directory cannot import: the class is pickled whole (its bases, in the
        installed packages, by name)."""
        import cloudpickle  # submitit's own pickler

        module = sys.modules.get(type(self).__module__)
        if module is not None and hasattr(cloudpickle, "register_pickle_by_value"):  # cloudpickle >= 2
            cloudpickle.register_pickle_by_value(module)

    @contextlib.contextmanager
    def _collecting(self) -> Iterator[None]:
        """The plugin builds its executor as ``submitit.AutoExecutor`` and reads each job's results in turn: for
        this launch, each job's Python holds the stop signals from its first statement, what it unpickles first is
        light (a stop signal at any moment of the job is honoured: :mod:`rlhf.launch.submitit_job`), and its jobs are
        wrapped so that a dead one reads as a failed point."""
        import submitit

        launcher, stock = self, submitit.AutoExecutor

        class Executor(stock):  # type: ignore[misc,valid-type]
            def __init__(self, folder: Any, cluster: str | None = None, **kwargs: Any) -> None:
                if cluster:  # the plugin names it ("slurm", "local"): the python of that executor
                    kwargs.setdefault(f"{cluster}_python", submitit_job.python_command())
                super().__init__(folder, cluster=cluster, **kwargs)

            def map_array(self, fn: Any, *iterable: Sequence[Any]) -> list:
                jobs = super().map_array(*submitit_job.deferred(fn, iterable))
                overrides, nums = iterable[0], iterable[2]  # the plugin's arguments: overrides, dir key, job number
                return [_Collected(job, launcher, o, n) for job, o, n in zip(jobs, overrides, nums)]

        submitit.AutoExecutor = Executor
        try:
            yield
        finally:
            submitit.AutoExecutor = stock

    def failed_point(self, overrides: Sequence[str], job_num: int, reason: str) -> Any:
        """Record the point in its run folder (as the job would have named it) and return its JobReturn: completed,
        with a :class:`FailedPoint` for a value, as a point that failed by an exception returns (a failed
        JobReturn would make Hydra's sweeper raise, ending the sweep)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobReturn, JobStatus
        from omegaconf import OmegaConf, open_dict

        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))  # type: ignore[attr-defined]
        with open_dict(config.hydra.job):
            config.hydra.job.num = job_num
            config.hydra.job.id = f"job_id_for_{job_num}"
        before = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)  # as Hydra's run_job has it when it names the folder
        try:
            folder = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(
                OmegaConf.select(config, "hydra.sweep.subdir"))
        finally:
            HydraConfig.instance().cfg = before
        failed: FailedPoint = record_failure(folder.absolute(), ProcessDied(reason))
        log.error("point %s: %s", folder.name, reason)
        where = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(folder.absolute())}}})  # read by a sweeper
        returned = JobReturn(overrides=list(overrides), working_dir=str(folder.absolute()), hydra_cfg=where,
                             task_name=str(config.hydra.job.name), status=JobStatus.COMPLETED)
        returned.return_value = failed
        return returned
