"""What an optimizer benchmark runs: its workloads, each optimizer's search space, and every job, planned ahead.

The protocol is MLCommons AlgoPerf's external-tuning ruleset (github.com/mlcommons/algorithmic-efficiency,
docs/DOCUMENTATION.md), with this project's split of choosing from reporting (:mod:`rlhf.sweeps.search`):

- one **search space** per optimizer, the same on every workload (:class:`Dimension`: a range on a linear, log or
  ``1 - x`` log scale; a warmup as a fraction of the workload's steps);
- the **same number of trials** for every tuned optimizer, drawn quasi-randomly (a scrambled Sobol sequence,
  ``scipy.stats.qmc.Sobol``), in several **independent studies** (each study its own Sobol seed and training seed);
- each study **chooses** its trial with the best final score on the validation rows at the end of the step budget
  (Wen et al. 2025, arXiv 2509.02046: rankings flip before a schedule has decayed, so compare at its end);
- each choice is **confirmed** from scratch on the held-out rows with a fresh seed (``confirm_seeds`` per study):
  these runs give every reported figure (final score, steps and seconds to the target);
- the **self-tuning track**: optimizers without a search space run at their defaults, untuned, with
  ``self_tuning_budget`` times the step budget (AlgoPerf's self-tuning ruleset gives more time in place of tuning),
  scored apart.

A job's folder is ``<stage>/<workload>/<optimizer>/s<study>_t<trial>`` (confirm: ``s<study>_c<k>``): the same plan
gives the same folders, which is how a stopped benchmark continues (:mod:`rlhf.sweeps.bench.runner`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf.core.errors import UserError

SCALES = ("linear", "log", "log1m")  # log1m: 1 - x on a log scale (a beta near 1: 0.9, 0.99, 0.999 equally spaced)
EDGE = 0.1  # a chosen value within this fraction of its range's ends (on its scale) is marked as on the edge
STAGES = ("search", "confirm")
TUNED, SELF_TUNING = "tuned", "self-tuning"
CONFIRM_SEED = 1000  # confirm seeds start here: never a search's seed (a study's index)


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One searched key: ``low`` to ``high`` on ``scale``; ``integer``: rounded; ``of_steps``: ``low``/``high`` are
    fractions of the workload's step budget and the override is the whole number of steps (a warmup)."""

    key: str
    low: float
    high: float
    scale: str = "linear"
    integer: bool = False
    of_steps: bool = False

    @classmethod
    def parse(cls, key: str, node: Any, where: str) -> Dimension:
        if not isinstance(node, Mapping) or not {"low", "high"} <= set(node):
            raise UserError(f"{where}.{key}: {node!r} is not a range. Fix: {{low: <number>, high: <number>, scale: "
                            "linear|log|log1m}} (integer: true for a whole number; of_steps: true for a fraction of "
                            "the step budget)")
        unknown = set(node) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise UserError(f"{where}.{key}: unknown field(s) {sorted(unknown)}. Fix: low, high, scale, integer, "
                            "of_steps")
        dim = cls(key, float(node["low"]), float(node["high"]), str(node.get("scale", "linear")),
                  bool(node.get("integer", False)), bool(node.get("of_steps", False)))
        problem = (f"scale one of {', '.join(SCALES)}" if dim.scale not in SCALES
                   else "low < high" if not dim.low < dim.high
                   else "low > 0 on a log scale" if dim.scale == "log" and dim.low <= 0
                   else "high < 1 on a log1m scale" if dim.scale == "log1m" and dim.high >= 1
                   else "0 <= low and high <= 1 for a fraction of the steps" if dim.of_steps
                   and not 0 <= dim.low < dim.high <= 1
                   else "")
        if problem:
            raise UserError(f"{where}.{key}: needs {problem} (got low={dim.low:g}, high={dim.high:g}, "
                            f"scale={dim.scale}). Fix: change the range so that {problem}")
        return dim

    def _forward(self, x: float) -> float:
        return {"linear": x, "log": math.log(x) if x > 0 else -math.inf,
                "log1m": math.log(1 - x) if x < 1 else -math.inf}[self.scale]

    def _backward(self, y: float) -> float:
        return {"linear": y, "log": math.exp(y), "log1m": 1 - math.exp(y)}[self.scale]

    def at(self, unit: float) -> float:
        """The value at ``unit`` in [0, 1] of the range, on its scale."""
        a, b = self._forward(self.low), self._forward(self.high)
        return self._backward(a + unit * (b - a))

    def unit(self, value: float) -> float:
        """Where ``value`` lies in the range, on its scale: 0 at ``low``, 1 at ``high``."""
        a, b = self._forward(self.low), self._forward(self.high)
        return (self._forward(value) - a) / (b - a)

    def override(self, value: float, steps: int) -> str:
        if self.of_steps:
            return f"{self.key}={round(value * steps)}"
        if self.integer:
            return f"{self.key}={round(value)}"
        return f"{self.key}={value:.6g}"

    def edge(self, value: float) -> str:
        """``"low"`` or ``"high"`` when ``value`` lies in the outer :data:`EDGE` of the range: the best may lie
        beyond it (widen the range); else ``""``."""
        where = self.unit(value)
        return "low" if where < EDGE else "high" if where > 1 - EDGE else ""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One task with its step budget: ``overrides`` of every job (``algo=dpo``), the metric scored and its target
    (``None``: the reference optimizer's median final score on the held-out rows)."""

    name: str
    overrides: tuple[str, ...]
    max_steps: int
    eval_every_steps: int
    metric: str
    direction: str
    target: float | None = None
    seconds_per_step: float | None = None  # the plan's estimate before this machine has run any step of it


@dataclasses.dataclass
class Job:
    """One run of the benchmark, planned; ``value`` (the final ``metric``) and ``reason`` once it ran."""

    stage: str
    workload: str
    optimizer: str
    track: str
    study: int
    index: int  # the trial (search) or the confirm seed's number within the study
    seed: int
    steps: int
    point: dict[str, float]  # the searched values (a confirm job: its study's choice); {} for the self-tuning track
    overrides: list[str]
    value: float | None = None
    reason: str = ""
    launched: bool = True  # False: a confirm job with nothing to run (every trial of its study failed)
    reached: Any = None  # a confirm job's steps and seconds to the target (rlhf.sweeps.bench.scores.Reached)

    @property
    def folder(self) -> str:
        kind = "t" if self.stage == "search" else "c"
        return f"{self.stage}/{self.workload}/{self.optimizer}/s{self.study}_{kind}{self.index}"


SET_PER_JOB = ("seed", "train.max_steps", "train.eval_every_steps", "train.eval_at_start", "objective.metric",
               "objective.direction", "optimizer")  # what every job sets itself: not a command-line override
SWEEPER_KEYS = ("workloads", "optimizers", "trials", "studies", "confirm_seeds", "self_tuning_budget", "reference",
                "r_max", "select_on", "confirm_on", "max_batch_size", "plan_only")
WORKLOAD_KEYS = ("overrides", "max_steps", "eval_every_steps", "metric", "direction", "target", "seconds_per_step")
NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # a workload's or an entry's name: one folder, one override value


def _unknown(keys: Any, known: Sequence[str], where: str) -> None:
    """An unknown key of ``where`` refused, naming the known key it resembles."""
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"{where}.{close[0]} (the key it resembles)" if close else "one of " + ", ".join(known)
            raise UserError(f"{where}.{key} is not a setting of the optimizer benchmark (it would be ignored). Fix: "
                            f"{hint}")


@dataclasses.dataclass
class Bench:
    """The whole plan: :meth:`from_config` reads ``hydra.sweeper``; :meth:`search_jobs` and :meth:`confirm_jobs`
    list the runs, the latter once the search has values."""

    workloads: list[Workload]
    spaces: dict[str, list[Dimension]]  # every optimizer's search space; [] for the self-tuning track
    fixed: dict[str, list[str]]  # every entry's own overrides (e.g. scheduler=constant for schedule-free)
    trials: int
    studies: int
    confirm_seeds: int = 1
    self_tuning_budget: float = 1.5
    reference: str = "adamw"
    r_max: float = 4.0  # the performance profile's range of tau: 1 to r_max (AlgoPerf: 4)
    select_on: list[str] = dataclasses.field(default_factory=list)
    confirm_on: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> Bench:
        where = "hydra.sweeper"
        _unknown(cfg, (*SWEEPER_KEYS, "_target_"), where)
        for key in ("workloads", "optimizers"):
            if not cfg.get(key):
                raise UserError(f"{where}.{key} is empty. Fix: see conf/experiment/optimizer_bench.yaml for a "
                                "complete benchmark")
        workloads = []
        for name, node in cfg["workloads"].items():
            node = dict(node or {})
            _unknown(node, WORKLOAD_KEYS, f"{where}.workloads.{name}")
            missing = {"max_steps", "metric", "direction"} - set(node)
            if missing:
                raise UserError(f"{where}.workloads.{name} lacks {sorted(missing)}. Fix: give max_steps, metric "
                                "(an eval/* metric of its algorithm) and direction (maximize or minimize)")
            if node["direction"] not in ("maximize", "minimize"):
                raise UserError(f"{where}.workloads.{name}.direction={node['direction']!r}. Fix: maximize or "
                                "minimize")
            overrides = node.get("overrides") or []
            workloads.append(Workload(
                str(name), tuple(overrides.split() if isinstance(overrides, str) else map(str, overrides)),
                int(node["max_steps"]), int(node["max_steps"] if node.get("eval_every_steps") is None
                                            else node["eval_every_steps"]),
                str(node["metric"]), str(node["direction"]),
                None if node.get("target") is None else float(node["target"]),
                None if node.get("seconds_per_step") is None else float(node["seconds_per_step"])))
        spaces, fixed = {}, {}
        for name, node in cfg["optimizers"].items():
            node = dict(node or {})
            unknown = set(node) - {"option", "space", "overrides"}
            if unknown:
                raise UserError(f"{where}.optimizers.{name}: unknown field(s) {sorted(unknown)}. Fix: option (the "
                                "conf/optimizer option; default: the entry's name), space ({key: {low, high, "
                                "scale}}; none: the self-tuning track) and overrides")
            spaces[str(name)] = [Dimension.parse(str(k), v, f"{where}.optimizers.{name}.space")
                                 for k, v in (node.get("space") or {}).items()]
            overrides = node.get("overrides") or []
            fixed[str(name)] = [f"optimizer={node.get('option') or name}",
                                *(overrides.split() if isinstance(overrides, str) else map(str, overrides))]
        bench = cls(workloads, spaces, fixed, int(cfg.get("trials", 5)), int(cfg.get("studies", 3)),
                    int(cfg.get("confirm_seeds", 1)), float(cfg.get("self_tuning_budget", 1.5)),
                    str(cfg.get("reference", "adamw")), float(cfg.get("r_max", 4.0)),
                    [f"{k}={v}" for k, v in (cfg.get("select_on") or {}).items()],
                    [f"{k}={v}" for k, v in (cfg.get("confirm_on") or {}).items()])
        bench.check()
        return bench

    def check(self) -> None:
        if self.trials < 1 or self.studies < 1 or self.confirm_seeds < 1:
            raise UserError(f"hydra.sweeper: trials={self.trials}, studies={self.studies}, confirm_seeds="
                            f"{self.confirm_seeds}: each must be >= 1. Fix: e.g. trials=5 studies=3 confirm_seeds=1")
        if self.self_tuning_budget <= 0:
            raise UserError(f"hydra.sweeper.self_tuning_budget={self.self_tuning_budget}: a factor of the step "
                            "budget, > 0. Fix: 1.5 (AlgoPerf's self-tuning track has more time in place of tuning)")
        if not self.r_max > 1:
            raise UserError(f"hydra.sweeper.r_max={self.r_max}: the profile runs from 1 to r_max, so it must exceed "
                            "1. Fix: hydra.sweeper.r_max=4 (AlgoPerf's)")
        for name in [*(w.name for w in self.workloads), *self.spaces]:
            if not NAME.match(name):
                raise UserError(f"hydra.sweeper: the name {name!r} is a folder and an override value: letters, "
                                "digits, _ and - only. Fix: rename it")
        for w in self.workloads:
            if w.max_steps < 1 or w.eval_every_steps < 1:
                raise UserError(f"hydra.sweeper.workloads.{w.name}: max_steps={w.max_steps}, eval_every_steps="
                                f"{w.eval_every_steps}: each must be >= 1. Fix: e.g. max_steps: 40, "
                                "eval_every_steps: 5")
        untargeted = [w.name for w in self.workloads if w.target is None]
        if untargeted and not self.spaces.get(self.reference):
            raise UserError(f"workloads {untargeted} take their target from the reference optimizer "
                            f"{self.reference!r}, which is not a tuned optimizer of this benchmark. Fix: "
                            "hydra.sweeper.reference=<a tuned optimizer>, or a target for each workload")

    def tuned(self) -> list[str]:
        return [name for name, space in self.spaces.items() if space]

    def self_tuning(self) -> list[str]:
        return [name for name, space in self.spaces.items() if not space]

    def track(self, optimizer: str) -> str:
        return TUNED if self.spaces[optimizer] else SELF_TUNING

    def points(self, optimizer: str, study: int) -> list[dict[str, float]]:
        """The study's ``trials`` quasi-random points of the optimizer's space: a scrambled Sobol sequence seeded by
        the optimizer and the study (the same points on every workload, AlgoPerf's one search space)."""
        from scipy.stats import qmc

        space = self.spaces[optimizer]
        sobol = qmc.Sobol(d=len(space), scramble=True, seed=zlib.crc32(f"{optimizer}/{study}".encode()))
        with warnings.catch_warnings():  # Sobol's balance wants 2^k points; a budget of 5 is still quasi-random
            warnings.simplefilter("ignore", UserWarning)
            units = sobol.random(self.trials)
        return [{dim.key: dim.at(float(u)) for dim, u in zip(space, row)} for row in units]

    def _job(self, stage: str, workload: Workload, optimizer: str, study: int, index: int, seed: int,
             point: dict[str, float], extra: Sequence[str]) -> Job:
        steps = workload.max_steps if self.spaces[optimizer] else round(workload.max_steps * self.self_tuning_budget)
        dims = {d.key: d for d in self.spaces[optimizer]}
        evaluate = ([f"train.eval_every_steps={workload.eval_every_steps}", "train.eval_at_start=true"]
                    if stage == "confirm" else ["train.eval_every_steps=0", "train.eval_at_start=false"])
        overrides = [*workload.overrides, *self.fixed[optimizer],
                     *(dims[k].override(v, steps) for k, v in point.items()), f"train.max_steps={steps}",
                     f"seed={seed}", f"objective.metric={workload.metric}",
                     f"objective.direction={workload.direction}", *evaluate, *extra]
        return Job(stage, workload.name, optimizer, self.track(optimizer), study, index, seed, steps, dict(point),
                   overrides)

    def search_jobs(self) -> list[Job]:
        """Every trial of every study of every tuned optimizer on every workload (the self-tuning track searches
        nothing): ``len(workloads) x len(tuned) x studies x trials`` jobs, each scored on the validation rows."""
        return [self._job("search", w, name, study, trial, study, point, self.select_on)
                for w in self.workloads for name in self.tuned() for study in range(self.studies)
                for trial, point in enumerate(self.points(name, study))]

    def probes(self) -> list[Job]:
        """One job per workload and entry at the middle of its space (self-tuning: its confirm job), to check every
        combination's config before anything runs: a refusal that does not depend on the point (a metric the
        algorithm does not report, an option that does not exist) stops the benchmark, not each of its jobs."""
        return [self._job("search" if self.spaces[name] else "confirm", w, name, 0, 0, 0,
                          {d.key: d.at(0.5) for d in self.spaces[name]},
                          self.select_on if self.spaces[name] else self.confirm_on)
                for w in self.workloads for name in self.spaces]

    def better(self, direction: str, a: float, b: float) -> bool:
        return a > b if direction == "maximize" else a < b

    def choice(self, search: Sequence[Job], workload: str, optimizer: str, study: int) -> Job | None:
        """The study's trial with the best final score (failed trials never chosen); ``None`` if all failed."""
        direction = next(w.direction for w in self.workloads if w.name == workload)
        best = None
        for job in search:
            if (job.workload, job.optimizer, job.study) == (workload, optimizer, study) and job.value is not None:
                if best is None or self.better(direction, job.value, best.value):
                    best = job
        return best

    def confirm_jobs(self, search: Sequence[Job]) -> list[Job]:
        """Each study's choice (tuned) or the defaults (self-tuning), from scratch on the held-out rows with
        ``confirm_seeds`` fresh seeds each. A study whose every trial failed gets jobs that do not run
        (``launched`` False): misses in every figure."""
        jobs = []
        for w in self.workloads:
            for name in self.spaces:
                for study in range(self.studies):
                    chosen = self.choice(search, w.name, name, study) if self.spaces[name] else None
                    for k in range(self.confirm_seeds):
                        seed = CONFIRM_SEED + study * self.confirm_seeds + k
                        job = self._job("confirm", w, name, study, k, seed, chosen.point if chosen else {},
                                        self.confirm_on)
                        job.launched = chosen is not None or not self.spaces[name]
                        if not job.launched:
                            job.reason = "every trial of its study failed"
                        jobs.append(job)
        return jobs

    def edges(self, optimizer: str, point: Mapping[str, float]) -> dict[str, str]:
        """The chosen point's keys on the edge of their range (``{"optimizer.lr": "high"}``)."""
        dims = {d.key: d for d in self.spaces[optimizer]}
        return {k: dims[k].edge(v) for k, v in point.items() if k in dims and dims[k].edge(v)}

    def counts(self) -> dict[str, int]:
        """Runs and training steps the plan makes."""
        n_search = len(self.workloads) * len(self.tuned()) * self.studies * self.trials
        n_confirm = len(self.workloads) * len(self.spaces) * self.studies * self.confirm_seeds
        steps = sum(w.max_steps * (len(self.tuned()) * self.studies * (self.trials + self.confirm_seeds))
                    + round(w.max_steps * self.self_tuning_budget) * len(self.self_tuning()) * self.studies
                    * self.confirm_seeds for w in self.workloads)
        return {"search": n_search, "confirm": n_confirm, "runs": n_search + n_confirm, "steps": steps}

    def describe(self) -> str:
        """The plan in a few lines: workloads, optimizers with their spaces, the runs it makes."""
        counts = self.counts()
        lines = [f"optimizer benchmark: {len(self.workloads)} workloads x {len(self.tuned())} tuned optimizers "
                 f"({self.trials} trials in each of {self.studies} studies) + {len(self.self_tuning())} self-tuning "
                 f"at {self.self_tuning_budget:g}x the steps; each study's choice confirmed with "
                 f"{self.confirm_seeds} fresh seed(s): {counts['runs']} runs ({counts['search']} search, "
                 f"{counts['confirm']} confirm), {counts['steps']:,} training steps"]
        for w in self.workloads:
            target = f"{w.target:g}" if w.target is not None else f"the tuned {self.reference}'s median"
            lines.append(f"  workload {w.name}: {' '.join(w.overrides) or '(defaults)'}, {w.max_steps} steps, "
                         f"{w.metric} ({w.direction}) to reach {target}")
        for name, space in self.spaces.items():
            what = ", ".join(f"{d.key} {d.low:g}..{d.high:g}" + (f" ({d.scale})" if d.scale != "linear" else "")
                             + (" x steps" if d.of_steps else "") for d in space) or "its defaults (self-tuning)"
            fixed = f" [{' '.join(self.fixed[name])}]"
            lines.append(f"  {name}{fixed}: {what}")
        return "\n".join(lines)
