"""The training loop: one Accelerate loop for every algorithm, readable top to bottom.

config -> objects (model, algorithm, data, optimizer, scheduler) -> loop -> metrics.jsonl and <run dir>/final/.
The loop never asks which algorithm it runs: the algorithm object tokenizes, collates and computes the loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from accelerate.utils import set_seed
from datasets import DatasetDict, load_from_disk
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rlhf.config import build, check_config, check_fields
from rlhf.errors import UserError
from rlhf.hardware import global_numel
from rlhf.optim import param_groups

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """The ``train:`` block of the config: how long and in what batches to train. Units are in the names."""

    max_steps: int = 300  # optimizer steps
    per_device_batch_size: int = 32  # examples (pairs for DPO) per process per micro-batch
    grad_accumulation_steps: int | None = None  # micro-batches per optimizer step (None: 1, or from global)
    global_batch_size: int | None = None  # examples per optimizer step over all processes (None: not fixed)
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; null disables clipping
    eval_every_steps: int = 50  # evaluate on the held-out split every N optimizer steps (0: only at the end)
    eval_batch_size: int = 64  # examples per process per evaluation batch
    log_every_steps: int = 10  # write averaged training metrics every N optimizer steps
    eval_at_start: bool = True  # evaluate before the first step, to show where training starts from
    save_final: bool = True  # save the trained model and tokenizer to <run dir>/final

    def __post_init__(self) -> None:
        for name in ("max_steps", "per_device_batch_size", "grad_accumulation_steps", "global_batch_size",
                     "eval_batch_size", "log_every_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"train.{name}={getattr(self, name)} must be at least 1.")
        if self.eval_every_steps < 0 or (self.max_grad_norm is not None and self.max_grad_norm <= 0):
            raise UserError("train.eval_every_steps must be >= 0 and train.max_grad_norm > 0 (or null).")


    def accumulation_steps(self, processes: int) -> int:
        """Micro-batches per optimizer step: set, or derived from ``global_batch_size`` for this many processes,
        so that a sweep over ``hardware=`` keeps the optimization identical."""
        if self.global_batch_size is None:
            return self.grad_accumulation_steps or 1
        per_step = self.per_device_batch_size * processes
        if self.global_batch_size % per_step:
            raise UserError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of per_device_batch_size x "
                f"processes = {self.per_device_batch_size} x {processes} = {per_step}. Fix: a multiple of {per_step}, "
                "or another train.per_device_batch_size.")
        derived = self.global_batch_size // per_step
        if self.grad_accumulation_steps is not None and self.grad_accumulation_steps != derived:
            raise UserError(
                f"train.grad_accumulation_steps={self.grad_accumulation_steps} disagrees with "
                f"train.global_batch_size={self.global_batch_size} = {self.per_device_batch_size} per device x "
                f"{processes} process(es) x {derived}. Fix: drop one of them (train.grad_accumulation_steps=null).")
        return derived


class _Mean:
    """Running weighted means of scalar metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            self.sums[key] += float(value) * weight
            self.weights[key] += weight

    def means(self, prefix: str, accelerator) -> dict[str, float]:
        """The means over every process (each process saw its own shard of the batches)."""
        keys = sorted(self.sums)
        packed = torch.tensor([[self.sums[k], self.weights[k]] for k in keys], dtype=torch.float64,
                              device=accelerator.device)
        if accelerator.num_processes > 1:
            packed = accelerator.reduce(packed, reduction="sum")
        return {f"{prefix}{k}": float(s / w) for k, (s, w) in zip(keys, packed.tolist())}


def _forever(loader: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    """Batches from `loader`, epoch after epoch (reshuffled each epoch)."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


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
    """Write to a sibling folder, then swap it in: an interrupted save never replaces a good model.
    ``state_dict``: the whole model's weights when the model itself is sharded (FSDP2, ZeRO-3)."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, state_dict=state_dict)
    tokenizer.save_pretrained(staging)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old)
    else:
        os.replace(staging, folder)


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
    """One process's part of a run (see :mod:`rlhf.launch` for starting the processes); return the final
    metrics (held-out ``eval/*`` and last ``train/*``)."""
    # --- configuration -----------------------------------------------------------------------------------
    check_fields(OmegaConf.to_container(cfg.train), TrainSettings, "train")
    check_config(cfg)
    settings = TrainSettings(**cfg.train)
    run_dir = Path(cfg.output_dir)
    strategy = build(cfg.hardware)
    accelerator = strategy.start(seed=cfg.seed)
    with log_file(run_dir, accelerator.is_main_process):
        return _run(cfg, settings, run_dir, strategy, accelerator)


def _run(cfg: DictConfig, settings: TrainSettings, run_dir: Path, strategy, accelerator) -> dict[str, float]:
    accum = settings.accumulation_steps(accelerator.num_processes)
    set_seed(cfg.seed)
    is_main = accelerator.is_main_process

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
    make_optimizer = build(cfg.optimizer)
    model, optimizer, train_loader = strategy.prepare(model, lambda m: make_optimizer(param_groups(m)), train_loader)
    scheduler = build(cfg.scheduler)(optimizer)

    # --- what is about to happen -------------------------------------------------------------------------
    global_batch = settings.per_device_batch_size * accelerator.num_processes * accum
    total = sum(global_numel(p) for p in strategy.unwrap(model).parameters())  # ZeRO-3 keeps empty local tensors
    trainable = sum(global_numel(p) for p in strategy.unwrap(model).parameters() if p.requires_grad)
    log.info("run dir: %s", run_dir)
    log.info("hardware: %s", strategy.describe())
    log.info("global batch %d = %d per device x %d process(es) x %d accumulation step(s)",
             global_batch, settings.per_device_batch_size, accelerator.num_processes, accum)
    log.info("parameters: %s (%s trainable); %d training rows, %d held-out rows",
             f"{total:,}", f"{trainable:,}", len(tokenized["train"]), len(tokenized["eval"]))
    logger = build(cfg.logger)
    if is_main:
        logger.start(str(run_dir), OmegaConf.to_container(cfg, resolve=True))

    def record(metrics: dict[str, float], step: int) -> None:
        if is_main:
            logger.log(metrics, step)

    final: dict[str, float] = {}
    if settings.eval_at_start:
        final = evaluate(model, algo, evaluation, accelerator)
        record(final, 0)
        log.info("step 0: %s", _brief(final))

    # --- the loop ----------------------------------------------------------------------------------------
    batches = _forever(train_loader)
    window, tokens, window_steps, window_start = _Mean(), 0, 0, time.perf_counter()
    bar = tqdm(range(1, settings.max_steps + 1), desc="training", disable=not is_main, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 15.0)
    with logging_redirect_tqdm():  # log lines print above the progress bar
        for step in bar:
            for micro in range(accum):
                batch = next(batches)
                # Gradients are averaged across processes only on the last micro-batch of the step.
                with strategy.accumulate(model, sync=micro == accum - 1):
                    loss, metrics = algo.loss(model, batch)
                    strategy.backward(loss / accum, model)
                window.add(metrics, 1.0 / accum)
                tokens += int(batch["attention_mask"].sum())
            grad_norm = strategy.optimizer_step(model, optimizer, settings.max_grad_norm)
            scheduler.step()
            window_steps += 1

            if step % settings.log_every_steps == 0 or step == settings.max_steps:
                elapsed = time.perf_counter() - window_start
                train_metrics = {**window.means("train/", accelerator), "train/lr": scheduler.get_last_lr()[0],
                                 "perf/tokens_per_s": tokens * accelerator.num_processes / elapsed,  # non-pad, all processes
                                 "perf/step_time_s": elapsed / window_steps}
                if grad_norm is not None:
                    train_metrics["train/grad_norm"] = grad_norm
                record(train_metrics, step)
                final.update(train_metrics)
                bar.set_postfix(loss=f"{train_metrics['train/loss']:.4f}", refresh=False)
                window, tokens, window_steps, window_start = _Mean(), 0, 0, time.perf_counter()
            every = settings.eval_every_steps
            if (every and step % every == 0) or step == settings.max_steps:
                eval_metrics = evaluate(model, algo, evaluation, accelerator)
                record(eval_metrics, step)
                final.update(eval_metrics)
                log.info("step %d: %s", step, _brief(eval_metrics))
        bar.close()

    # --- results -----------------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    if settings.save_final:
        strategy.save_model(model, tokenizer, run_dir / "final", save_pretrained_atomically)
        log.info("saved the final model to %s", run_dir / "final")
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(
            {"final": final, "train": asdict(settings), "seed": cfg.seed}, indent=2))
        logger.finish()
    return final


def _brief(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
