"""The training loop: one Accelerate loop for every algorithm, readable top to bottom.

One run: build it once (:func:`rlhf.run.components.build_run`), maybe resume, then a ``while`` over optimizer steps,
each one call to :func:`train_step`, followed by logging, evaluation and checkpoints; at the end the final model
and ``summary.json``. The loop never asks which algorithm it runs: the algorithm object tokenizes, collates,
computes the loss and says where its batches come from (:class:`rlhf.algos.base.Algorithm`).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rlhf.core.instantiate import build
from rlhf.core.train_state import TrainState
from rlhf.ops.collectives import any_process, max_over_processes
from rlhf.run import checkpoint, resume_check, signals
from rlhf.run import folder as run_folder
from rlhf.run.components import BuiltRun, build_run
from rlhf.run.nonfinite import CAUSES, NonFinite, skip_or_stop
from rlhf.run.optimizer_modes import before_training, evaluation_weights
from rlhf.run.signals import Stopped, catch_stop_signals
from rlhf.run.window import settle, window_metrics
from rlhf.telemetry import bf16_updates
from rlhf.telemetry.loggers import Loggers, log_file
from rlhf.telemetry.optimizer_state import held_against_predicted
from rlhf.telemetry.profiling import StepProfiler

log = logging.getLogger(__name__)


def train(cfg: DictConfig, strategy, resume: Path | None) -> dict[str, float]:
    """One process's part of a run: ``cfg`` is checked and resolved, ``strategy`` built from ``cfg.hardware``, and
    ``resume`` the checkpoint to continue from (or None), all by :mod:`rlhf.launch.processes`. Return the final metrics
    (held-out ``eval/*`` and last ``train/*``). Raises :class:`Stopped` after a stop signal (a checkpoint was
    written) and :class:`NonFinite` when training diverged."""
    run_dir = Path(cfg.output_dir)
    accelerator = strategy.start(seed=cfg.seed)
    with log_file(run_dir, accelerator.is_main_process), catch_stop_signals() as stop:
        run = build_run(cfg, strategy, run_dir)
        run.describe()
        run.record_environment()
        state = TrainState()
        if resume is not None:
            resume_check.check_data(cfg, run.resume_record[resume_check.DATA], resume)
            state = checkpoint.load(resume, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler,
                                    algo=run.algo, strategy=strategy, accelerator=accelerator)
            log.info("resumed from %s: step %d, epoch %d", resume, state.step, state.epoch)
        logger = Loggers([build(node) for node in (cfg.get("logger") or {}).values()])  # metrics.jsonl and the list
        if accelerator.is_main_process:  # what an earlier run or branch left in the folder goes aside, said in a line
            run_folder.make_room(run_dir, state.step if resume is not None else None, logger.filename)
            logger.start(str(run_dir), OmegaConf.to_container(cfg, resolve=True),
                         resume_step=state.step if resume is not None else None)

        def record(metrics: dict[str, float], step: int) -> None:
            state.last.update(metrics)
            if accelerator.is_main_process:
                logger.log(metrics, step)

        def record_tables(step: int) -> None:
            if accelerator.is_main_process:
                for name, rows in run.algo.tables(step).items():
                    logger.log_table(name, rows, step)

        # rows data.on_bad_row=skip left out, and rows truncation cut (the start-up lines say which side)
        counts = {"data/skipped_rows": run.skipped_rows, "data/truncated_rows": run.truncated["either"]}
        if resume is None and any(counts.values()):
            record({name: count for name, count in counts.items() if count}, 0)
        if resume is None and (run.settings.eval_at_start or run.max_steps == 0):
            _evaluate(run, record, 0)
        _train(run, state, record, record_tables, stop, resume)
        final = _finish(run, state, cfg.seed)
        if stop.signum is not None and stop.announce:  # during the final save, which completed: the run is finished
            log.warning("received %s during the final save; the run finished first (nothing to resume)",
                        signal.Signals(stop.signum).name)
        if accelerator.is_main_process:
            logger.finish()
        return final


def _train(run: BuiltRun, state: TrainState, record, record_tables, stop, resume: Path | None) -> None:
    """Optimizer steps from ``state.step`` to ``run.max_steps``: step, log, evaluate, checkpoint, stop on a signal
    (one that came during start-up stops the run before its first step; one during the final evaluation, after
    a checkpoint of the last step)."""
    settings, accelerator = run.settings, run.accelerator
    if any_process({"stop": stop.signum is not None}, accelerator)["stop"]:
        raise Stopped(_signum(stop), resume, run.run_dir, state.step)
    batches = run.algo.batch_source(run.train_loader, state, accelerator, model=run.model)
    # schedule-free: the training weights in, rollouts with the evaluation weights (nothing for other optimizers)
    before_training(run.optimizer, run.model, run.scheduler, run.max_steps, batches, accelerator.is_main_process)
    window_start = time.perf_counter()
    bar = tqdm(total=run.max_steps, initial=state.step, desc="training", dynamic_ncols=True,
               disable=not accelerator.is_main_process or run.max_steps == 0,
               mininterval=0.5 if sys.stderr.isatty() else 15.0)
    run.model.train()  # a model loaded with from_pretrained comes in eval mode (dropout off); evaluations set it back
    hidden = bf16_updates.watch(run.strategy, run.model, run.optimizer, run.max_steps, last=state.last)  # bf16 only
    profiler = StepProfiler(settings.profile_steps, state.step + settings.log_every_steps + 1, run.run_dir,
                            accelerator.device, accelerator.is_main_process, memory=settings.profile_memory)
    save_every_s = 60.0 * settings.save_every_minutes
    with logging_redirect_tqdm():  # log lines print above the progress bar (an error ends its line: train.py)
        saved, first, last_save = None, state.step, _clock()
        while state.step < run.max_steps:
            signals.reached(f"step_{state.step + 1}")
            profiler.before(state.step + 1)
            due = bool(save_every_s) and _clock() - last_save >= save_every_s  # agreed on by every process below
            outcome = train_step(run, state, batches, stop, save_due=due)
            hidden.after_step(state.step, record)  # bf16: steps until the forward pass sees an update (once)
            bar.update(1)
            step = state.step
            profiler.after(step, run.max_steps)
            record_tables(step)
            if step % settings.log_every_steps == 0 or step == run.max_steps:
                metrics = window_metrics(run, state, outcome.grad_norm, time.perf_counter() - window_start)
                record(metrics, step)
                if "train/loss" in metrics:
                    bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", refresh=False)
                log.info("step %d: %s", step, _brief({k: v for k, v in metrics.items() if k.startswith("train/")}))
                state.new_window()
                window_start = time.perf_counter()
            every = settings.eval_every_steps
            paused = time.perf_counter()  # evaluations and checkpoints are not training: left out of perf/*
            if (every and step % every == 0) or step == run.max_steps:
                if step == run.max_steps:
                    signals.reached("final_eval")
                _evaluate(run, record, step)
            window_start += time.perf_counter() - paused
            if settings.empty_cache_every_steps and step % settings.empty_cache_every_steps == 0:
                run.strategy.empty_cache()
            saved, paused = None, time.perf_counter()
            if (settings.save_every_steps and step % settings.save_every_steps == 0) or outcome.save:
                saved = _save_checkpoint(run, state)
                record({"perf/checkpoint_time_s": time.perf_counter() - paused}, step)  # its cost, beside the steps'
                last_save = _clock()
            window_start += time.perf_counter() - paused
            if outcome.stop:
                bar.close()
                raise Stopped(_signum(stop), saved or _save_checkpoint(run, state), run.run_dir, step)
        bar.close()
    if state.step > first and any_process({"stop": stop.signum is not None}, accelerator)["stop"]:  # final evaluation
        raise Stopped(_signum(stop), saved or _save_checkpoint(run, state), run.run_dir, state.step)


def _clock() -> float:
    """Seconds on a clock that only moves forward: what ``train.save_every_minutes`` counts (the tests set it)."""
    return time.monotonic()


def _signum(stop) -> int:
    return stop.signum if stop.signum is not None else int(signal.SIGTERM)  # another process's signal


@dataclass
class StepOutcome:
    norm: torch.Tensor | float | None  # the gradient norm before clipping, on the device (read only when logged);
    # None when not known (ZeRO before its step, or a step skipped by the host); NaN for a step the device skipped
    stop: bool  # a stop signal reached some process: checkpoint and stop after this step
    save: bool = False  # train.save_every_minutes has passed on some process: checkpoint after this step

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm as a number (reading it waits for the device: once per log window)."""
        return None if self.norm is None else float(self.norm)


def train_step(run: BuiltRun, state: TrainState, batches, stop, accumulation: int | None = None,
               save_due: bool = False) -> StepOutcome:
    """One optimizer step: ``accumulation`` micro-batches (default ``run.accumulation``), each from
    ``batches.next()``, the clip, then the step on every process, or on none when any process saw a non-finite
    loss or gradient (``train.on_nonfinite``). Advances ``state`` (step, log window) and the schedule, which moves
    on a skipped step too, so that the run keeps its length. The loop passes the algorithm's batch source;
    :class:`rlhf.launch.step_trainer.StepTrainer` passes the micro-batches its caller gave. ``save_due``: this process's
    clock says a checkpoint is due; the outcome's ``save`` is whether any process's says so (every process saves).

    The metrics, token counts and gradient norm stay on the device, summed into the log window, and are read when
    the window is logged (:func:`window_metrics`). Whether the step is finite stays there too where the optimizer
    skips on the device (``run.verdicts``, :mod:`rlhf.run.nonfinite`): then the step never waits for the device, and
    a GPU runs ahead of the host through the log window. Elsewhere the step waits once, to read it (skip or step:
    the one decision the host makes; with several processes the flags' one all-reduce is read too)."""
    strategy, model, accum = run.strategy, run.model, accumulation or run.accumulation
    step_sums: dict[str, torch.Tensor | float] = {}
    step_weights: dict[str, float] = {}
    nonfinite, step_tokens, step_samples = None, 0, 0
    for micro in range(accum):
        batch = batches.next()
        with strategy.accumulate(model, sync=micro == accum - 1):  # gradients averaged on the last one only
            loss, metrics = run.algo.loss(model, batch)
            strategy.backward(loss / accum, model)
        bad = ~torch.isfinite(loss.detach())
        nonfinite = bad if nonfinite is None else nonfinite | bad
        for key, value in metrics.items():  # float64 on the device: the sums a Python float would make
            value = value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else float(value)
            step_sums[key] = step_sums.get(key, 0.0) + value / accum
            step_weights[key] = step_weights.get(key, 0.0) + 1.0 / accum
        step_tokens = step_tokens + batch["attention_mask"].sum()
        step_samples += run.algo.samples(batch)
    norm = strategy.clip_gradients(model, run.settings.max_grad_norm)
    if norm is not None:
        nonfinite = nonfinite | ~torch.isfinite(torch.as_tensor(norm, device=nonfinite.device))
    state.step += 1
    if run.verdicts is not None:  # the verdict stays on the device: the optimizer's kernel skips there
        flags = any_process({"stop": stop.signum is not None, "save": save_due}, run.accelerator)  # one process
        strategy.step(model, run.optimizer, skip=nonfinite.to(torch.float32))
        run.verdicts.add(state, nonfinite, norm, step_sums, step_weights, step_tokens, step_samples)
        norm = torch.where(nonfinite, float("nan"), norm) if norm is not None else None  # a skipped step's: none
    else:
        # One all-reduce for all: any process's NaN, stop signal or due checkpoint acts on every process at this step.
        flags = any_process({"nonfinite": bool(nonfinite), "stop": stop.signum is not None, "save": save_due},
                            run.accelerator)  # bool(): the step's one read of the device
        if flags["nonfinite"]:
            skip_or_stop(state, run.settings, strategy, model, run.optimizer, None if norm is None else float(norm))
            norm = None
        else:
            after = strategy.step(model, run.optimizer)  # ZeRO: the norm is known only now, after its step
            if after is not None and not math.isfinite(after):
                raise NonFinite(f"step {state.step}: the gradient norm is {after} and DeepSpeed has already applied "
                                "the step; stopping without saving. " + CAUSES)
            norm = after if norm is None else norm
            state.nonfinite_in_row = 0
            for key, value in step_sums.items():
                state.window_sums[key] += value
                state.window_weights[key] += step_weights[key]
            state.window_tokens += step_tokens
            state.window_samples += step_samples
    with warnings.catch_warnings():  # a skipped first step: torch warns that the optimizer has not stepped
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        run.scheduler.step()
    state.window_steps += 1
    return StepOutcome(norm, flags["stop"], flags["save"])


def _evaluate(run: BuiltRun, record, step: int) -> None:
    with evaluation_weights(run.optimizer):  # schedule-free: the averaged weights, not those the gradient is taken at
        metrics = run.evaluate()
    record(metrics, step)
    log.info("step %d: %s", step, _brief(metrics))


def _save_checkpoint(run: BuiltRun, state: TrainState) -> Path:
    settle(run, state)  # a stop the verdicts call for comes before the save
    if not run.strategy.all_finite(run.model):
        raise NonFinite(f"step {state.step}: the model's parameters are not finite; no checkpoint was written over "
                        "the good ones. " + CAUSES)
    accelerator = run.accelerator
    with evaluation_weights(run.optimizer):  # a checkpoint's model is the one to evaluate; a resume rebuilds y from z
        folder = checkpoint.save(run.run_dir, state, model=run.model, optimizer=run.optimizer,
                                 scheduler=run.scheduler, algo=run.algo, strategy=run.strategy,
                                 accelerator=accelerator, keep_last=run.settings.keep_last, config=run.resume_record,
                                 meta={"processes": accelerator.num_processes,
                                       "strategy": type(run.strategy).__name__, "torch": torch.__version__})
    log.info("step %d: checkpoint %s", state.step, folder)
    return folder


def _finish(run: BuiltRun, state: TrainState, seed: int) -> dict[str, float]:
    """The final model in ``<run dir>/final`` and ``summary.json``; return the final metrics."""
    run.accelerator.wait_for_everyone()
    final = dict(state.last)
    final["perf/peak_mem_mb"] = max_over_processes(run.peak.mb(), run.accelerator)
    held_mb, held = held_against_predicted(run.optimizer, run.memory.optimizer_state)  # this process's state
    log.info("memory: peak %.1f MB on the busiest process (%s) against %.1f MB predicted; %s", final["perf/peak_mem_mb"],
             "allocated by torch" if run.peak.cuda else "resident set above its size before the run was built",
             run.memory.total / 2**20, held)
    signals.reached("final_save")
    if run.settings.save_final and run.max_steps > 0:
        if not run.strategy.all_finite(run.model):
            raise NonFinite(f"step {state.step}: the model's parameters are not finite; final/ was not written. "
                            + CAUSES)
        with evaluation_weights(run.optimizer):  # schedule-free: the averaged weights, those evaluated
            run.strategy.save_model(run.model, run.tokenizer, run.run_dir / "final",
                                    checkpoint.save_pretrained_atomically)
            log.info("saved the final model to %s", run.run_dir / "final")
            if run.accelerator.is_main_process:  # peft.merge=true: final/merged/, the adapter merged into the base
                run.adapter.save_merged(run.run_dir / "final", run.tokenizer, checkpoint.save_pretrained_atomically)
        run.accelerator.wait_for_everyone()
    elif run.accelerator.is_main_process:
        run_folder.drop_earlier_model(run.run_dir)  # an earlier run's final/ is not this run's model
    if run.accelerator.is_main_process:
        (run.run_dir / "summary.json").write_text(json.dumps(
            {"final": final, "train": {**asdict(run.settings), "max_steps": run.max_steps}, "seed": seed,
             "memory_predicted_mb": run.memory.megabytes(),
             "memory_held_mb": held_mb, "load": run.load.summary()}, indent=2))
        run_folder.drop_previous_results(run.run_dir)  # this run's results are complete: the previous run's go
    return final


def _brief(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
