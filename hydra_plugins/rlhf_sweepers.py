"""Hydra's plugins for ``hydra/sweeper=select_then_confirm`` (search on validation rows, then confirm each choice with
fresh runs on the held-out rows: ``rlhf/sweeps/search.py``) and ``hydra/sweeper=optimizer_bench`` (optimizers
compared the AlgoPerf way: ``rlhf/sweeps/bench/``).

Hydra instantiates sweepers from the ``hydra_plugins`` package only, and imports every module here when it starts:
this one imports nothing heavy at the top.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)
NAME_LIMIT = 96  # characters of a job folder's name after its number (longer ones end in a hash)


class SelectThenConfirm(Sweeper):
    """Args (``hydra.sweeper.*``):
        compare: values searched and confirmed each on its own, e.g. ``optimizer=sgd,adamw`` (null: one search).
        search: the grid of every compared value (``"optimizer.lr=0.01,0.1"``), or one per value keyed by the
            compared value (``{sgd: ..., adamw: ...}``).
        select_on: ``{key: value}`` of every search job (``{data.evaluate_on: validation, seed: 0}``).
        confirm_on: ``{key: value}`` of the confirm jobs; a sweep value gives one job each (``{data.evaluate_on:
            held_out, seed: "1,2,3"}``).
        max_batch_size: jobs launched at once at most (null: each stage in one batch).
        confirm: ``chosen`` (search, then confirm each compared value's choice) or ``every`` (no search: every point
            of the grids confirmed, e.g. each objective at each strength for a reward-KL frontier).
        widen_edges: when a choice sits on the edge of its grid, search one more point beyond it, once, and choose
            again.
    """

    def __init__(self, compare: str | None = None, search: Any = None, select_on: Any = None, confirm_on: Any = None,
                 max_batch_size: int | None = None, confirm: str = "chosen", widen_edges: bool = False) -> None:
        from rlhf.sweeps.search import as_overrides

        super().__init__()
        self.compare, self.search = compare, search
        self.select_on, self.confirm_on = as_overrides(select_on), as_overrides(confirm_on)
        self.max_batch_size = max_batch_size
        self.confirm, self.widen_edges = confirm, widen_edges
        self.config: DictConfig | None = None
        self.launcher = None
        self.hydra_context: HydraContext | None = None
        self.jobs = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def _launch(self, stage: str, points: list, arguments: list[str], extra: list[str]) -> list[JobReturn]:
        """Run ``points`` (each a :class:`rlhf.sweeps.search.Point`) into ``<sweep dir>/<stage>/``; fill in their folders
        and values. ``extra``: overrides of every job of the stage."""
        from rlhf.config.checks import short_name
        from rlhf.sweeps.search import outcome

        constant = {o for o in [*self.select_on, *self.confirm_on] if "," not in o}  # the same in a whole stage
        shared: dict[tuple, set[str]] = {}  # and the same in every point of one compared value (its batch size)
        for p in points:
            own = set(p.overrides)
            key = tuple(p.compared)
            shared[key] = shared[key] & own if key in shared else own

        def place(point) -> str:  # <stage>/<job number>_<its own values>: e.g. search/3_optimizer=sgd,optimizer.lr=0.1
            name = ",".join(o for o in [*point.compared, *point.overrides] if o not in constant) or stage
            if len(name) > NAME_LIMIT:  # too long for a folder: what varies within the compared value, and the seed
                same = shared.get(tuple(point.compared), set()) - set(point.compared)
                name = ",".join(o for o in [*point.compared, *point.overrides] if o not in constant | same)
            name = short_name(name.replace("/", "."), NAME_LIMIT)  # algo/reward_funcs=...: one folder, not two
            return f"hydra.sweep.subdir='{stage}/${{hydra.job.num}}_{name}'"

        jobs = [[*arguments, *p.compared, *p.overrides, *extra, place(p)] for p in points]
        self.validate_batch_is_legal(jobs)  # an unknown key: Hydra's message before anything runs
        size = self.max_batch_size or len(jobs) or 1
        returns: list[JobReturn] = []
        for start in range(0, len(jobs), size):
            returns += self.launcher.launch(jobs[start:start + size], initial_job_idx=self.jobs)
            self.jobs += len(jobs[start:start + size])
        for point, job_return in zip(points, returns):
            output_dir = OmegaConf.select(job_return.hydra_cfg or {}, "hydra.runtime.output_dir")
            point.folder = str(Path(output_dir).relative_to(Path(self.config.hydra.sweep.dir).resolve())
                               if output_dir else "")
            point.value, point.reason = outcome(job_return)
        return returns

    def sweep(self, arguments: list[str]) -> Any:
        from rlhf.core.errors import UserError
        from rlhf.sweeps.search import Study, check_arguments, write

        assert self.config is not None and self.launcher is not None
        try:
            check_arguments(arguments)
            study = Study.plan(self.compare, self.search, OmegaConf.to_container(self.config.objective, resolve=True),
                               confirm=self.confirm)
        except UserError as error:  # one message before anything runs, as for any bad input
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1) from None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        results = [] if study.every else self._launch("search", study.search, arguments, self.select_on)
        if self.widen_edges and not study.every:
            added = study.widen()
            if added:
                log.info("widening the grid once beyond its chosen edge: %s",
                         "; ".join(" ".join([*p.compared, *p.overrides]) for p in added))
                results += self._launch("search", added, arguments, self.select_on)
        results += self._launch("confirm", study.plan_confirm(self.confirm_on), arguments, [])
        written = write(study, sweep_dir)
        log.info("selection: %s", ", ".join(str(p) for p in written[:2]))
        print((sweep_dir / "selection.md").read_text(), end="")
        return results


class OptimizerBench(Sweeper):
    """Args (``hydra.sweeper.*``, documented in ``conf/hydra/sweeper/optimizer_bench.yaml``): workloads, optimizers,
    trials, studies, confirm_seeds, self_tuning_budget, reference, r_max, select_on, confirm_on, max_batch_size,
    plan_only. The plan: :class:`rlhf.sweeps.bench.plan.Bench`; running it: :func:`rlhf.sweeps.bench.runner.run`;
    the report: :mod:`rlhf.sweeps.bench.report`."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None
        self.jobs = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from rlhf.core.errors import UserError
        from rlhf.sweeps.bench import report, runner
        from rlhf.sweeps.bench.plan import Bench
        from rlhf.sweeps.points import count_failures_as_misses

        assert self.config is not None and self.launcher is not None
        count_failures_as_misses()  # a failed trial is a miss in the report, not a failure of the benchmark
        options = OmegaConf.to_container(OmegaConf.create(self.options), resolve=True)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        try:
            bench = Bench.from_config(options)
            self._check(bench, arguments)
            if options.get("plan_only"):
                clock = runner.Clock(bench)
                print(bench.describe())
                print(f"estimated time on one machine, one job at a time: "
                      f"{clock.line([*bench.search_jobs(), *bench.confirm_jobs([])])}")
                return []
            sweep_dir.mkdir(parents=True, exist_ok=True)
            if not (sweep_dir / "multirun.yaml").exists():  # how it was started: kept when it is continued
                OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

            def launch(jobs, resume) -> None:
                lists = [[*arguments, *job.overrides, *(["resume=auto"] if again else []),
                          f"hydra.sweep.subdir={job.folder}"] for job, again in zip(jobs, resume)]
                self.launcher.launch(lists, initial_job_idx=self.jobs)
                self.jobs += len(lists)

            jobs = runner.run(bench, sweep_dir, launch, options.get("max_batch_size"), arguments=arguments)
        except UserError as error:  # one message, before anything runs (or before a mixed-up folder is touched)
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(1) from None
        written = report.write(bench, jobs, sweep_dir)
        log.info("benchmark report: %s", ", ".join(str(p) for p in written))
        print((sweep_dir / report.MARKDOWN).read_text(), end="")
        return []

    def _check(self, bench, arguments: list[str]) -> None:
        """Before anything runs: no sweep and no key the jobs set themselves on the command line, and the config of
        each workload with each optimizer (at the middle of its space) composed and checked, so that a refusal
        that does not depend on the point stops the benchmark instead of failing every one of its jobs."""
        from rlhf.config.checks import check_config
        from rlhf.core.errors import UserError
        from rlhf.sweeps.bench.plan import SET_PER_JOB
        from rlhf.sweeps.search import check_arguments

        check_arguments(arguments, "hydra.sweeper.optimizers.<name>.space",
                        "hydra.sweeper.optimizers.<name>.space.<key>={low: ..., high: ..., scale: ...}")
        probes = bench.probes()
        set_by_jobs = {*SET_PER_JOB, *(o.lstrip("~+").partition("=")[0] for job in probes for o in job.overrides)}
        for argument in arguments:
            key = argument.lstrip("~+").partition("=")[0]
            if key in set_by_jobs:  # the job's own value comes after the command line's and wins, for some jobs
                raise UserError(f"{argument}: the benchmark's jobs set {key} themselves (a workload's overrides, an "
                                "optimizer's space or overrides, a study's seed), so it would apply to some of them "
                                "only. Fix: hydra.sweeper.workloads.<name>.overrides or "
                                "hydra.sweeper.optimizers.<name> (conf/hydra/sweeper/optimizer_bench.yaml)")
        for job in probes:
            overrides = [*arguments, *job.overrides]  # an unknown key: Hydra's message, from composing it
            config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            try:
                with open_dict(config):
                    config.pop("hydra", None)
                    config.output_dir = str(Path(self.config.hydra.sweep.dir) / job.folder)  # as the job's, unmade
                check_config(config)
            except UserError as error:
                raise UserError(f"workload {job.workload} with {job.optimizer}: {error}") from None
