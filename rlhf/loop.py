"""The training loop: one Accelerate loop for every algorithm, readable top to bottom.

config -> objects (model, algorithm, data, optimizer, scheduler) -> loop -> metrics.jsonl and <run dir>/final/.
The loop never asks which algorithm it runs: the algorithm object tokenizes, collates and computes the loss.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rlhf.config import build, check_config, check_fields
from rlhf.errors import UserError
from rlhf.optim import param_groups

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """The ``train:`` block of the config: how long and in what batches to train. Units are in the names."""

    max_steps: int = 300  # optimizer steps
    per_device_batch_size: int = 32  # examples (pairs for DPO) per process per micro-batch
    grad_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; null disables clipping
    eval_every_steps: int = 50  # evaluate on the held-out split every N optimizer steps (0: only at the end)
    eval_batch_size: int = 64  # examples per process per evaluation batch
    log_every_steps: int = 10  # write averaged training metrics every N optimizer steps
    eval_at_start: bool = True  # evaluate before the first step, to show where training starts from
    save_final: bool = True  # save the trained model and tokenizer to <run dir>/final

    def __post_init__(self) -> None:
        for name in ("max_steps", "per_device_batch_size", "grad_accumulation_steps", "eval_batch_size",
                     "log_every_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"train.{name}={getattr(self, name)} must be at least 1.")
        if self.eval_every_steps < 0 or (self.max_grad_norm is not None and self.max_grad_norm <= 0):
            raise UserError("train.eval_every_steps must be >= 0 and train.max_grad_norm > 0 (or null).")


class _Mean:
    """Running weighted means of scalar metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            self.sums[key] += float(value) * weight
            self.weights[key] += weight

    def means(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}{k}": self.sums[k] / self.weights[k] for k in self.sums}


def _forever(loader: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    """Batches from `loader`, epoch after epoch (reshuffled each epoch)."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(model, algo, loader, accelerator) -> dict[str, float]:
    """Mean of the algorithm's evaluation metrics over the held-out split (summed across processes)."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    count = torch.zeros((), device=accelerator.device)
    for batch in tqdm(loader, desc="evaluating", leave=False, disable=not accelerator.is_main_process):
        rows = torch.tensor(float(batch["input_ids"].shape[0]), device=accelerator.device)
        for key, value in algo.evaluate(model, batch).items():
            sums[key] = sums.get(key, 0) + value.float() * rows
        count += rows
    model.train()
    totals = accelerator.reduce({**sums, "_count": count}, reduction="sum")
    return {f"eval/{k}": float(v / totals["_count"]) for k, v in totals.items() if k != "_count"}


def save_pretrained_atomically(model, tokenizer, folder: Path) -> None:
    """Write to a sibling folder, then swap it in: an interrupted save never replaces a good model."""
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old)
    else:
        os.replace(staging, folder)


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says; return the final metrics (held-out ``eval/*`` and last ``train/*``)."""
    # --- configuration -----------------------------------------------------------------------------------
    check_fields(OmegaConf.to_container(cfg.train), TrainSettings, "train")
    check_config(cfg)
    settings = TrainSettings(**cfg.train)
    run_dir = Path(cfg.output_dir)
    AcceleratorState._reset_state()  # each train() call gets the hardware its own config asks for
    accelerator = build(cfg.hardware)
    set_seed(cfg.seed)
    is_main = accelerator.is_main_process

    # --- components, each built from its config group ----------------------------------------------------
    with accelerator.main_process_first():  # e.g. the tiny model's warm start is built once
        policy = build(cfg.model)
    model, tokenizer = policy.model, policy.tokenizer
    algo = build(cfg.algo)
    data = build(cfg.data)
    with accelerator.main_process_first():
        splits = data.load(algo.columns, tokenizer)
        tokenized = splits.map(algo.tokenize, fn_kwargs={"tokenizer": tokenizer},
                               remove_columns=splits["train"].column_names, desc="tokenizing")
    if len(tokenized["train"]) < settings.per_device_batch_size:
        raise UserError(f"the training split has {len(tokenized['train'])} rows, fewer than "
                        f"train.per_device_batch_size={settings.per_device_batch_size}. Fix: lower the batch size.")
    algo.setup(model, tokenizer, accelerator)  # before prepare(): e.g. the reference copies the initial policy
    optimizer = build(cfg.optimizer)(param_groups(model))
    scheduler = build(cfg.scheduler)(optimizer)
    train_loader = DataLoader(tokenized["train"], batch_size=settings.per_device_batch_size, shuffle=True,
                              drop_last=True, collate_fn=algo.collate,
                              generator=torch.Generator().manual_seed(cfg.seed))
    eval_loader = DataLoader(tokenized["eval"], batch_size=settings.eval_batch_size, collate_fn=algo.collate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    # --- what is about to happen -------------------------------------------------------------------------
    accum = settings.grad_accumulation_steps
    global_batch = settings.per_device_batch_size * accelerator.num_processes * accum
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("run dir: %s", run_dir)
    log.info("effective batch size %d = %d per device x %d process(es) x %d accumulation step(s)",
             global_batch, settings.per_device_batch_size, accelerator.num_processes, accum)
    log.info("parameters: %s (%s trainable); %d training rows, %d held-out rows; device %s",
             f"{total:,}", f"{trainable:,}", len(tokenized["train"]), len(tokenized["eval"]), accelerator.device)
    logger = build(cfg.logger)
    if is_main:
        logger.start(str(run_dir), OmegaConf.to_container(cfg, resolve=True))

    def record(metrics: dict[str, float], step: int) -> None:
        if is_main:
            logger.log(metrics, step)

    final: dict[str, float] = {}
    if settings.eval_at_start:
        final = evaluate(model, algo, eval_loader, accelerator)
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
                # Gradients are all-reduced only on the last micro-batch of the step.
                with accelerator.no_sync(model) if micro < accum - 1 else nullcontext():
                    loss, metrics = algo.loss(model, batch)
                    accelerator.backward(loss / accum)
                window.add(metrics, 1.0 / accum)
                tokens += int(batch["attention_mask"].sum())
            grad_norm = None
            if settings.max_grad_norm is not None:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            window_steps += 1

            if step % settings.log_every_steps == 0 or step == settings.max_steps:
                elapsed = time.perf_counter() - window_start
                train_metrics = {**window.means("train/"), "train/lr": scheduler.get_last_lr()[0],
                                 "perf/tokens_per_s": tokens * accelerator.num_processes / elapsed,  # non-pad, all processes
                                 "perf/step_time_s": elapsed / window_steps}
                if grad_norm is not None:
                    train_metrics["train/grad_norm"] = float(grad_norm)
                record(train_metrics, step)
                final.update(train_metrics)
                bar.set_postfix(loss=f"{train_metrics['train/loss']:.4f}", refresh=False)
                window, tokens, window_steps, window_start = _Mean(), 0, 0, time.perf_counter()
            every = settings.eval_every_steps
            if (every and step % every == 0) or step == settings.max_steps:
                eval_metrics = evaluate(model, algo, eval_loader, accelerator)
                record(eval_metrics, step)
                final.update(eval_metrics)
                log.info("step %d: %s", step, _brief(eval_metrics))
        bar.close()

    # --- results -----------------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    if is_main:
        if settings.save_final:
            save_pretrained_atomically(accelerator.unwrap_model(model), tokenizer, run_dir / "final")
            log.info("saved the final model to %s", run_dir / "final")
        (run_dir / "summary.json").write_text(json.dumps(
            {"final": final, "train": asdict(settings), "seed": cfg.seed}, indent=2))
        logger.finish()
    return final


def _brief(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.4g}" for k, v in metrics.items())
