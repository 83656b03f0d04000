"""The training loop: one Accelerate loop for every algorithm, readable top to bottom.

config -> objects (model, algorithm, data, optimizer, scheduler) -> loop -> metrics.jsonl and <run dir>/final/.
The loop never asks which algorithm it runs: the algorithm object tokenizes, collates and computes the loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import datasets
import torch
from accelerate.utils import set_seed
from datasets import DatasetDict, load_from_disk
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rlhf import checkpoint, run_folder
from rlhf.checkpoint import TrainState
from rlhf.config import build, check_config
from rlhf.errors import UserError
from rlhf.hardware import global_numel
from rlhf.optim import param_groups
from rlhf.settings import TrainSettings
from rlhf.signals import Stopped, catch_stop_signals

log = logging.getLogger(__name__)


class NonFinite(UserError):
    """Training produced a NaN or Inf; nothing non-finite was saved."""


def window_means(state: TrainState, prefix: str, accelerator) -> dict[str, float]:
    """The log window's metric means over every process (each process saw its own shard of the batches)."""
    keys = sorted(state.window_sums)
    if not keys:
        return {}
    packed = torch.tensor([[state.window_sums[k], state.window_weights[k]] for k in keys], dtype=torch.float64,
                          device=accelerator.device)
    if accelerator.num_processes > 1:
        packed = accelerator.reduce(packed, reduction="sum")
    return {f"{prefix}{k}": float(s / w) for k, (s, w) in zip(keys, packed.tolist())}


class Batches:
    """Training micro-batches, epoch after epoch, keeping ``state.epoch`` and ``state.batch_in_epoch`` so that a
    resumed run continues with the very next batch: each epoch's order comes from ``set_epoch`` (Accelerate's
    seedable sampler, seeded by ``seed`` + epoch), and a resumed epoch skips the batches already consumed."""

    def __init__(self, loader: DataLoader, state: TrainState, accelerator) -> None:
        self.loader, self.state, self.accelerator = loader, state, accelerator
        self._iterator: Iterator | None = None

    def next(self) -> dict[str, torch.Tensor]:
        while True:
            if self._iterator is None:
                if hasattr(self.loader, "set_epoch"):
                    self.loader.set_epoch(self.state.epoch)
                done = self.state.batch_in_epoch
                self._iterator = iter(self.accelerator.skip_first_batches(self.loader, done) if done else self.loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.state.epoch, self.state.batch_in_epoch, self._iterator = self.state.epoch + 1, 0, None
                continue
            self.state.batch_in_epoch += 1
            return batch


def eval_loader(dataset, batch_size: int, collate, accelerator) -> DataLoader:
    """This process's share of the held-out split: the batches one process would make, dealt out in turn.

    Whole batches, not rows, are dealt out, so every metric is the same mean of the same batch means on any number
    of processes; no row is repeated (a distributed sampler pads the last batch with duplicates, which a mean
    would count twice). A process left without a batch evaluates the first one with weight 0."""
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = [list(range(start, min(start + batch_size, len(dataset)))) for start in range(0, len(dataset), batch_size)]
    # Every process runs the same number of forward passes (under FSDP2 or ZeRO-3 each is a collective): one with
    # fewer batches repeats the first with weight 0 (negative indices, see evaluate).
    mine = batches[rank::world]
    mine += [[-1 - i for i in batches[0]]] * (-(-len(batches) // world) - len(mine))
    return DataLoader(_Weighted(dataset), batch_sampler=mine, collate_fn=lambda rows: _collate_weighted(rows, collate))


class _Weighted(torch.utils.data.Dataset):
    """Rows of `dataset`; index -1-i is row i with weight 0."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index if index >= 0 else -1 - index], float(index >= 0)


def _collate_weighted(rows, collate) -> tuple[dict[str, torch.Tensor], float]:
    return collate([row for row, _ in rows]), sum(weight for _, weight in rows)


@torch.no_grad()
def evaluate(model, algo, loader, accelerator) -> dict[str, float]:
    """Mean of the algorithm's evaluation metrics over the held-out split (row-weighted, summed over processes)."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for batch, rows in tqdm(loader, desc="evaluating", leave=False, disable=not accelerator.is_main_process):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        for key, value in algo.evaluate(model, batch).items():
            sums[key] = sums.get(key, 0) + value.double() * rows
        count += rows
    model.train()
    totals = accelerator.reduce({**sums, "_count": count}, reduction="sum")
    return {f"eval/{k}": float(v / totals["_count"]) for k, v in totals.items() if k != "_count"}


def save_pretrained_atomically(model, tokenizer, folder: Path, state_dict: dict | None = None) -> None:
    """Write to a sibling folder, then swap it in: an interrupted or failed save never replaces a good model.
    ``state_dict``: the whole model's weights when the model itself is sharded (FSDP2, ZeRO-3)."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
    except OSError as error:  # e.g. the disk is full
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"could not save the model to {folder} ({error}); the checkpoints, the metrics and any "
                        "previous model there are kept. Fix: free disk space, then resume=auto.") from error
    checkpoint.replace_folder(staging, folder)


def tokenize_once(splits: DatasetDict, algo, tokenizer, accelerator, cache: Path) -> DatasetDict:
    """Tokenize on the main process of each machine; the other processes load its result from ``cache``."""
    def tokenize() -> DatasetDict:
        return splits.map(algo.tokenize, fn_kwargs={"tokenizer": tokenizer},
                          remove_columns=splits["train"].column_names, desc="tokenizing")

    if accelerator.num_processes == 1:
        return tokenize()
    folder = cache / f"tokenized-node{accelerator.process_index - accelerator.local_process_index}"
    with accelerator.local_main_process_first():
        if accelerator.is_local_main_process:
            shutil.rmtree(folder, ignore_errors=True)
            datasets.disable_progress_bars()  # saving and loading a cache is not news
            try:
                tokenize().save_to_disk(str(folder))
            finally:
                datasets.enable_progress_bars()
        tokenized = load_from_disk(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process:
        shutil.rmtree(folder, ignore_errors=True)  # loaded (memory-mapped) by every process by now
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # when empty
    return tokenized


@contextlib.contextmanager
def log_file(run_dir: Path, enabled: bool) -> Iterator[None]:
    """Log to ``<run dir>/train.log`` for the duration of the run, unless a handler already does (Hydra's)."""
    path = (run_dir / "train.log").resolve()
    root = logging.getLogger()
    if not enabled or any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    level = logging.getLogger("rlhf").level
    if logging.getLogger("rlhf").getEffectiveLevel() > logging.INFO:
        logging.getLogger("rlhf").setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        logging.getLogger("rlhf").setLevel(level)


def train(cfg: DictConfig) -> dict[str, float]:
    """One process's part of a run (see :mod:`rlhf.launch` for starting the processes and for the run folder's
    lock); return the final metrics (held-out ``eval/*`` and last ``train/*``). Raises :class:`Stopped` after a
    stop signal (a checkpoint was written) and :class:`NonFinite` when training diverged."""
    # --- configuration -----------------------------------------------------------------------------------
    check_config(cfg)  # the train block first (TrainSettings), then every component
    settings = TrainSettings(**cfg.train)
    run_dir = Path(cfg.output_dir)
    strategy = build(cfg.hardware)
    accelerator = strategy.start(seed=cfg.seed)
    with log_file(run_dir, accelerator.is_main_process), catch_stop_signals() as stop:
        return _run(cfg, settings, run_dir, strategy, accelerator, stop)


def _run(cfg: DictConfig, settings: TrainSettings, run_dir: Path, strategy, accelerator, stop) -> dict[str, float]:
    accum = settings.accumulation_steps(accelerator.num_processes)
    set_seed(cfg.seed)
    is_main = accelerator.is_main_process
    resume = cfg.get("resume")  # a checkpoint folder, resolved by rlhf.launch (or "auto" when called directly)
    resume = checkpoint.resolve(resume, run_dir) if resume == "auto" else (Path(resume) if resume else None)

    # --- components, each built from its config group ----------------------------------------------------
    with accelerator.local_main_process_first():  # e.g. the tiny model's warm start is built once per machine
        policy = build(cfg.model)
    model, tokenizer = policy.model, policy.tokenizer
    algo = build(cfg.algo)
    data = build(cfg.data)
    with accelerator.local_main_process_first():
        splits = data.load(algo.columns, tokenizer)
    tokenized = tokenize_once(splits, algo, tokenizer, accelerator, run_dir / ".cache")
    if len(tokenized["train"]) < settings.per_device_batch_size * accelerator.num_processes:
        raise UserError(f"the training split has {len(tokenized['train'])} rows, fewer than one batch "
                        f"(train.per_device_batch_size={settings.per_device_batch_size} x "
                        f"{accelerator.num_processes} process(es)). Fix: lower the batch size.")
    if len(tokenized["eval"]) < accelerator.num_processes:
        raise UserError(f"the held-out split has {len(tokenized['eval'])} rows, fewer than the "
                        f"{accelerator.num_processes} processes. Fix: hold out more rows (data.eval_size).")
    algo.setup(model, tokenizer, accelerator)  # before prepare(): e.g. the reference copies the initial policy
    train_loader = DataLoader(tokenized["train"], batch_size=settings.per_device_batch_size, shuffle=True,
                              drop_last=True, collate_fn=algo.collate,
                              generator=torch.Generator().manual_seed(cfg.seed))
    evaluation = eval_loader(tokenized["eval"], settings.eval_batch_size, algo.collate, accelerator)
    # The optimizer is built by the strategy, after sharding (FSDP2 replaces the parameters it shards).
    make_optimizer = build(cfg.optimizer, _convert_="all")  # plain lists (betas): checkpoints load weights-only
    model, optimizer, train_loader = strategy.prepare(model, lambda m: make_optimizer(param_groups(m)), train_loader)
    max_steps = settings.max_steps
    if settings.num_epochs is not None:  # the schedule reads ${train.max_steps}: fill it in before building it
        max_steps = settings.num_epochs * len(train_loader) // accum
        if max_steps < 1:
            raise UserError(f"train.num_epochs={settings.num_epochs} is less than one optimizer step "
                            f"({len(train_loader)} micro-batch(es) per epoch per process, {accum} per step). "
                            "Fix: more epochs, or a smaller train.per_device_batch_size / accumulation.")
        with open_dict(cfg):
            cfg.train.max_steps = max_steps
    scheduler = build(cfg.scheduler)(optimizer)

    # --- what is about to happen -------------------------------------------------------------------------
    global_batch = settings.per_device_batch_size * accelerator.num_processes * accum
    total = sum(global_numel(p) for p in strategy.unwrap(model).parameters())  # ZeRO-3 keeps empty local tensors
    trainable = sum(global_numel(p) for p in strategy.unwrap(model).parameters() if p.requires_grad)
    log.info("run dir: %s", run_dir)
    log.info("hardware: %s", strategy.describe())
    log.info("global batch %d = %d per device x %d process(es) x %d accumulation step(s); %d optimizer steps%s",
             global_batch, settings.per_device_batch_size, accelerator.num_processes, accum, max_steps,
             f" ({settings.num_epochs} epoch(s))" if settings.num_epochs else "")
    log.info("parameters: %s (%s trainable); %d training rows, %d held-out rows",
             f"{total:,}", f"{trainable:,}", len(tokenized["train"]), len(tokenized["eval"]))

    state = TrainState()
    if resume is not None:
        state = checkpoint.load(resume, model=model, optimizer=optimizer, scheduler=scheduler, algo=algo,
                                strategy=strategy, accelerator=accelerator)
        log.info("resumed from %s: step %d, epoch %d", resume, state.step, state.epoch)
    logger = build(cfg.logger)
    if is_main:
        run_folder.clear_previous_results(run_dir)
        logger.start(str(run_dir), OmegaConf.to_container(cfg, resolve=True),
                     resume_step=state.step if resume is not None else None)

    def record(metrics: dict[str, float], step: int) -> None:
        state.last.update(metrics)
        if is_main:
            logger.log(metrics, step)

    def save_checkpoint() -> Path:
        if not strategy.all_finite(model):
            raise NonFinite(f"step {state.step}: the model's parameters are not finite; no checkpoint was written "
                            "over the good ones. " + _CAUSES)
        folder = checkpoint.save(run_dir, state, model=model, optimizer=optimizer, scheduler=scheduler, algo=algo,
                                 strategy=strategy, accelerator=accelerator, keep_last=settings.keep_last,
                                 meta={"processes": accelerator.num_processes, "strategy": type(strategy).__name__,
                                       "torch": torch.__version__})
        log.info("step %d: checkpoint %s", state.step, folder)
        return folder

    if resume is None and getattr(data, "skipped_rows", 0):  # data.on_bad_row=skip left rows out
        record({"data/skipped_rows": data.skipped_rows}, 0)
    if resume is None and (settings.eval_at_start or max_steps == 0):
        metrics = evaluate(model, algo, evaluation, accelerator)
        record(metrics, 0)
        log.info("step 0: %s", _brief(metrics))

    # --- the loop ----------------------------------------------------------------------------------------
    batches = Batches(train_loader, state, accelerator)
    window_start = time.perf_counter()
    bar = tqdm(total=max_steps, initial=state.step, desc="training", disable=not is_main or max_steps == 0,
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 15.0)
    with logging_redirect_tqdm():  # log lines print above the progress bar
        while state.step < max_steps:
            step_metrics, step_tokens, finite = [], 0, True
            for micro in range(accum):
                batch = batches.next()
                # Gradients are averaged across processes only on the last micro-batch of the step.
                with strategy.accumulate(model, sync=micro == accum - 1):
                    loss, metrics = algo.loss(model, batch)
                    strategy.backward(loss / accum, model)
                finite = finite and math.isfinite(float(loss.detach()))
                step_metrics.append(metrics)
                step_tokens += int(batch["attention_mask"].sum())
            grad_norm = strategy.clip_gradients(model, settings.max_grad_norm)
            finite = finite and (grad_norm is None or math.isfinite(grad_norm))
            # One all-reduce for both: any process's NaN, or stop signal, acts on every process at this step.
            nonfinite_anywhere, stop_anywhere = _any_process(accelerator, not finite, stop.signum is not None)
            state.step += 1
            if nonfinite_anywhere:
                _skip_or_stop(state, settings, strategy, model, optimizer, grad_norm)
            else:
                after = strategy.step(model, optimizer)  # ZeRO: the norm is known only now, after its step
                if after is not None and not math.isfinite(after):
                    raise NonFinite(f"step {state.step}: the gradient norm is {after} and DeepSpeed has already "
                                    "applied the step; stopping without saving. " + _CAUSES)
                grad_norm = after if grad_norm is None else grad_norm
                state.nonfinite_in_row = 0
                for metrics in step_metrics:
                    for key, value in metrics.items():
                        state.window_sums[key] += float(value) / accum
                        state.window_weights[key] += 1.0 / accum
                state.window_tokens += step_tokens
            with warnings.catch_warnings():  # a skipped first step: torch warns that the optimizer has not stepped
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                scheduler.step()  # a skipped step advances the schedule too: the run keeps its length
            state.window_steps += 1
            bar.update(1)

            step = state.step
            if step % settings.log_every_steps == 0 or step == max_steps:
                elapsed = time.perf_counter() - window_start
                train_metrics = {**window_means(state, "train/", accelerator), "train/lr": scheduler.get_last_lr()[0],
                                 "perf/tokens_per_s": state.window_tokens * accelerator.num_processes / elapsed,
                                 "perf/step_time_s": elapsed / max(state.window_steps, 1)}
                if grad_norm is not None and math.isfinite(grad_norm):
                    train_metrics["train/grad_norm"] = grad_norm
                if state.nonfinite_steps:
                    train_metrics["train/nonfinite_steps"] = state.nonfinite_steps
                record(train_metrics, step)
                if "train/loss" in train_metrics:
                    bar.set_postfix(loss=f"{train_metrics['train/loss']:.4f}", refresh=False)
                log.info("step %d: %s", step, _brief({k: v for k, v in train_metrics.items() if k.startswith("train/")}))
                state.window_sums.clear()
                state.window_weights.clear()
                state.window_steps, state.window_tokens, window_start = 0, 0, time.perf_counter()
            every = settings.eval_every_steps
            if (every and step % every == 0) or step == max_steps:
                eval_metrics = evaluate(model, algo, evaluation, accelerator)
                record(eval_metrics, step)
                log.info("step %d: %s", step, _brief(eval_metrics))
            saved = None
            if settings.save_every_steps and step % settings.save_every_steps == 0:
                saved = save_checkpoint()
            if stop_anywhere:
                bar.close()
                raise Stopped(_requested_signal(stop), saved or save_checkpoint(), run_dir, step)
        bar.close()

    # --- results -----------------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    final = dict(state.last)
    if settings.save_final and max_steps > 0:
        if not strategy.all_finite(model):
            raise NonFinite(f"step {state.step}: the model's parameters are not finite; final/ was not written. "
                            + _CAUSES)
        strategy.save_model(model, tokenizer, run_dir / "final", save_pretrained_atomically)
        log.info("saved the final model to %s", run_dir / "final")
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(
            {"final": final, "train": {**asdict(settings), "max_steps": max_steps}, "seed": cfg.seed}, indent=2))
        logger.finish()
    return final


_CAUSES = ("Likely causes: a learning rate too high for this optimizer (optimizer.lr), no gradient clipping "
           "(train.max_grad_norm=null), float16 overflow (use bf16 or float32), or a bad data row.")


def _any_process(accelerator, *flags: bool) -> list[bool]:
    """Each flag OR-ed over every process (one small all-reduce)."""
    values = torch.tensor([float(f) for f in flags], device=accelerator.device)
    if accelerator.num_processes > 1:
        values = accelerator.reduce(values, reduction="sum")
    return [bool(v > 0) for v in values.tolist()]


def _requested_signal(stop) -> int:
    """The signal this process received, or (when only another process did) SIGTERM."""
    return stop.signum if stop.signum is not None else int(signal.SIGTERM)


def _skip_or_stop(state: TrainState, settings: TrainSettings, strategy, model, optimizer, grad_norm) -> None:
    """A non-finite loss or gradient on some process: drop the step, or stop (see ``train.on_nonfinite``)."""
    state.nonfinite_steps += 1
    state.nonfinite_in_row += 1
    what = f"step {state.step}: the loss or the gradient norm ({grad_norm}) is not finite on at least one process"
    if settings.on_nonfinite == "stop":
        raise NonFinite(f"{what}; stopping (train.on_nonfinite=stop), nothing of this step saved. " + _CAUSES)
    if state.nonfinite_in_row >= settings.max_nonfinite_in_row:
        raise NonFinite(f"{what}, {state.nonfinite_in_row} steps in a row (train.max_nonfinite_in_row="
                        f"{settings.max_nonfinite_in_row}); stopping, nothing of these steps saved. " + _CAUSES)
    strategy.skip_step(model, optimizer)
    log.warning("%s: step skipped (%d in a row; the run stops at %d)", what, state.nonfinite_in_row,
                settings.max_nonfinite_in_row)


def _brief(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
