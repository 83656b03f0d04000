"""One side of the GPU check's speed pairs in a process that lives for the whole check: started once, it builds a
side for each pair and trains it turn by turn as the coordinator (:mod:`gpu_check.workers.turns`) asks, so that the
process's start-up (imports, CUDA, the compiler's first graphs) is paid once per call, not once per run.

    python -m gpu_check.workers.worker ours|trl    # reads one JSON command a line on stdin

Commands, each answered by one line ``@gpu_check {...}`` on stdout (``{"error": ...}`` where it failed; whatever
else the libraries print goes to the same stream, before it):

- ``{"op": "build", "side": "ours" | "trl", "spec": {...}, "warmup": N}``: build the side (ours: the run of
  ``bench._our_command``'s overrides, in this process, trained by the loop's own :func:`rlhf.run.loop.train_step`;
  TRL's: ``bench.trl_trainer``, trained by its own ``train()``, paused at each step's end by a callback between
  turns) and train ``N`` untimed steps (the first steps' allocations and compiles);
- ``{"op": "run", "steps": N}``: one timed window of ``N`` steps, its two ends waiting for the device: samples/s,
  ours also the tokens it ran through the model (``perf/tokens_per_s``), peak memory since the build, and the graphs
  torch.compile made during the window (a window with a compile in it is flagged, not timed as steady state);
- ``{"op": "profile", "steps": N, "to": folder}``: ``N`` steps under torch.profiler
  (:class:`rlhf.telemetry.profiling.StepProfiler`: ``profile.txt`` and ``profile_trace.json`` in ``folder``);
- ``{"op": "free"}``: drop the side (its model, optimizer, data; the device's cached memory);
- ``{"op": "quit"}``.

Every answer says whether torch's compiler hit its recompile limit since the last one (``recompile_limit``: the
warnings, :mod:`gpu_check.recompiles`): past it our compiled paths run eagerly, and the turns fail that side.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path

import bench  # benchmarks/bench.py

from gpu_check.recompiles import RecompileWatch
from gpu_check.workers.isolated import REPLY  # the marker of a reply line

WATCH = RecompileWatch("this side", fail=False)  # for the process's life: each answer takes its own hits


def reply(message: dict) -> None:
    hits = WATCH.take()
    if hits:
        message = {**message, "recompile_limit": hits}
    sys.stdout.write(REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()


def read() -> dict:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {"op": "quit"}


def graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 where the counter is not there)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _NoStop:
    signum = None  # the loop's stop request: never, here


class Ours:
    """Our side of one pair: the run built from ``bench._our_command``'s overrides, stepped by ``train_step``."""

    def __init__(self, spec: dict) -> None:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from rlhf.config.checks import check_config
        from rlhf.core.instantiate import build
        from rlhf.core.train_state import TrainState
        from rlhf.hardware.precision import computes_in_bf16
        from rlhf.run.components import build_run

        command = bench._our_command(spec["case"], Path(spec["model_dir"]), Path(spec["data"]),
                                     Path(spec["run_dir"]), spec["batch"], spec["steps"], spec["threads"],
                                     Path(spec["cache"]), spec.get("extra", []), spec["device"], spec["shape"])
        overrides = [o for o in command[2:] if not o.startswith(("hydra.run.dir=", "train.max_steps="))]
        overrides += [f"train.max_steps={spec['max_steps']}", f"output_dir={spec['run_dir']}"]
        with initialize_config_dir(config_dir=str(bench.ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        check_config(cfg)
        strategy = build(cfg.hardware)
        strategy.threads(1, bf16=computes_in_bf16(strategy.mixed_precision, OmegaConf.select(cfg, "model.dtype")))
        self.accelerator = strategy.start(seed=cfg.seed)
        Path(spec["run_dir"]).mkdir(parents=True, exist_ok=True)
        self.run = build_run(cfg, strategy, Path(spec["run_dir"]))
        self.state = TrainState()
        self.batches = self.run.algo.batch_source(self.run.train_loader, self.state, self.accelerator,
                                                  model=self.run.model)
        self.run.model.train()
        self.device = self.accelerator.device

    def steps(self, count: int, profiler=None) -> None:
        from rlhf.run.loop import train_step

        for _ in range(count):
            if profiler is not None:
                profiler.before(self.state.step + 1)
            train_step(self.run, self.state, self.batches, _NoStop())
            if profiler is not None:
                profiler.after(self.state.step)

    def window(self, count: int) -> dict:
        from rlhf.run.window import settle, window_metrics

        # The verdicts kept on the device (train.nonfinite_on_device) of the steps before this window (warm-up,
        # profile) are read now: read inside the window, their samples would count in its samples/s.
        settle(self.run, self.state)
        self.state.new_window()
        synchronize(self.device)
        before, started = graphs(), time.perf_counter()
        self.steps(count)
        synchronize(self.device)
        seconds = time.perf_counter() - started
        metrics = window_metrics(self.run, self.state, None, seconds)  # reads what the window left on the device
        self.state.new_window()
        return {"samples_per_s": metrics["perf/samples_per_s"], "computed_tokens_per_s": metrics["perf/tokens_per_s"],
                "peak_mem_mb": self.run.peak.mb(), "seconds": seconds, "compiles": graphs() - before}

    def profile(self, count: int, folder: Path) -> None:
        from rlhf.telemetry.profiling import StepProfiler

        self.steps(count, StepProfiler(count, self.state.step + 1, folder, self.device, writes=True))


def serve_ours() -> None:
    """Commands for our side, until ``quit``."""
    side, size = None, None
    while True:
        command = read()
        op = command["op"]
        try:
            if op == "build":
                import torch

                if size is not None and command["spec"]["size"] != size:
                    torch._dynamo.reset()  # another model's layers: its graphs, not the earlier size's
                started = time.perf_counter()
                side, size = Ours(command["spec"]), command["spec"]["size"]
                side.steps(command["warmup"])
                synchronize(side.device)
                reply({"built_s": time.perf_counter() - started})
            elif op == "run":
                reply(side.window(command["steps"]))
            elif op == "profile":
                side.profile(command["steps"], Path(command["to"]))
                reply({"profiled": command["to"]})
            elif op == "free":
                side = None
                release()
                reply({"freed": True})
            else:
                reply({"quit": True})
                return
        except Exception as error:  # noqa: BLE001  (the coordinator records it and restarts this process)
            traceback.print_exc()
            reply({"error": f"{type(error).__name__}: {str(error).strip()[-1500:]}"})


class _Paused(Exception):
    """``quit`` while a TRL side is built: leave its ``train()`` and the process."""


def serve_trl() -> None:
    """Commands for TRL's side: ``build`` starts the trainer's ``train()``; a callback at each step's end answers
    the command in progress once its steps are done and reads the next, until ``free`` stops the training."""
    import torch
    from transformers import TrainerCallback

    from rlhf.telemetry.memory_preflight import PeakMemory
    from rlhf.telemetry.profiling import StepProfiler

    class Turns(TrainerCallback):
        def __init__(self, device, warmup: int, batch: int) -> None:
            self.device, self.left, self.batch = device, warmup, batch
            self.peak = PeakMemory(device)
            self.started, self.before, self.count, self.profiler, self.op = 0.0, 0, 0, None, "build"
            self.built_at = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            if self.profiler is not None:
                self.profiler.before(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is not None:
                self.profiler.after(state.global_step)
            self.left -= 1
            if self.left > 0:
                return
            synchronize(self.device)
            if self.op == "build":
                reply({"built_s": time.perf_counter() - self.built_at})
            elif self.op == "run":
                seconds = time.perf_counter() - self.started
                reply({"samples_per_s": self.batch * self.count / seconds, "peak_mem_mb": self.peak.mb(),
                       "seconds": seconds, "compiles": graphs() - self.before})
            elif self.op == "profile":
                self.profiler = None
                reply({"profiled": True})
            command = read()
            self.op = command["op"]
            if self.op == "run":
                self.left = self.count = command["steps"]
                self.before, self.started = graphs(), time.perf_counter()
            elif self.op == "profile":
                self.left = command["steps"]
                self.profiler = StepProfiler(command["steps"], state.global_step + 1, Path(command["to"]),
                                             self.device, writes=True)
            elif self.op == "free":
                control.should_training_stop = True
            else:
                raise _Paused()

    while True:
        command = read()
        if command["op"] != "build":
            reply({"freed": True} if command["op"] == "free" else {"quit": True})
            if command["op"] == "quit":
                return
            continue
        spec = command["spec"]
        try:
            torch.set_num_threads(spec["threads"])
            device = torch.device(spec["device"])
            turns = Turns(device, command["warmup"], spec["batch"])
            trainer = bench.trl_trainer(spec, spec["max_steps"], device)
            trainer.add_callback(turns)
            trainer.train()
            del trainer
            release()
            reply({"freed": True})
        except _Paused:
            reply({"quit": True})
            return
        except Exception as error:  # noqa: BLE001  (the coordinator records it and restarts this process)
            traceback.print_exc()
            reply({"error": f"{type(error).__name__}: {str(error).strip()[-1500:]}"})


def main() -> int:
    import datasets
    import transformers

    import rlhf  # noqa: F401  (first: it quiets bitsandbytes' notice of a Hub kernel, which TRL's import prints)

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    with WATCH:
        (serve_ours if sys.argv[1:] == ["ours"] else serve_trl)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
