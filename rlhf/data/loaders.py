"""From tokenized splits to the batches a run trains and evaluates on, the same on any number of processes.

- :func:`tokenize_once`: each machine tokenizes once (its main process), the others load the result; with a cache
  folder, a run whose rows, tokenizer, algorithm settings and code an earlier run had loads its tokens instead
  (:mod:`rlhf.data.token_cache`);
- :func:`train_loader` and :class:`Batches`: training micro-batches epoch after epoch, resumable mid-epoch
  (an algorithm's default ``batch_source``; online algorithms make theirs by generating), collated in worker
  processes on a GPU (:func:`loader_workers`);
- :func:`eval_loader`: whole held-out batches dealt out to the processes in turn, each with its row count.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import torch
from datasets import DatasetDict, load_from_disk
from torch.utils.data import DataLoader

from rlhf.core import auto_choices
from rlhf.data import token_cache

if TYPE_CHECKING:
    from rlhf.core.train_state import TrainState

log = logging.getLogger(__name__)

def tokenize_once(splits: DatasetDict, algo, tokenizer, accelerator, cache: Path,
                  keep: str | Path | None = None) -> DatasetDict:
    """Tokenize with ``algo.tokenize`` on the main process of each machine; the other processes of the machine
    load its result from ``cache`` (removed once every process has it memory-mapped). With ``keep`` (a folder,
    ``data.cache_dir``), the result is kept there across runs, and every process of a later run with the same
    rows, tokenizer, algorithm settings and code loads it instead (:mod:`rlhf.data.token_cache`)."""
    def tokenize() -> DatasetDict:
        return splits.map(algo.tokenize, fn_kwargs={"tokenizer": tokenizer},
                          remove_columns=splits["train"].column_names, desc="tokenizing")

    if keep is not None:
        entry = token_cache.entry(keep, splits, algo, tokenizer)
        with accelerator.local_main_process_first():
            if accelerator.is_local_main_process:
                if entry.is_dir():
                    log.info("tokenized data: from the cache %s", entry)
                else:
                    token_cache.write(entry, tokenize)
            return load_from_disk(str(entry))
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
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # when empty
    return tokenized


def loader_workers(num_workers: int | None, cuda: bool) -> int:
    """Worker processes that collate training batches (``data.num_workers``): as set, else the choice of
    :data:`rlhf.core.auto_choices.CHOICES` for the device (none on a CPU, where a worker would take a core from the
    step's threads; none on a GPU until a GPU check measures workers faster)."""
    if num_workers is not None:
        return num_workers
    return auto_choices.pick("data.num_workers", "cuda" if cuda else "cpu")


def train_loader(dataset, batch_size: int, collate: Callable, seed: int, num_workers: int = 0,
                 pin_memory: bool = False) -> DataLoader:
    """Shuffled micro-batches of ``batch_size`` rows, the last partial one dropped; the strategy shards it over
    the processes (Accelerate's seedable sampler: the same permutation everywhere, each process its share).

    ``num_workers`` processes collate them ahead of the step (:func:`loader_workers`), kept from epoch to epoch; the
    order is the sampler's, drawn in this process, so it is the same with any count (tested), and a resumed run
    continues with the same batches. The workers are forked where the system can (Linux: they share the tokenized
    rows and the collate function, a bound method of the algorithm, without pickling it; under spawn it would be
    pickled, the algorithm's frozen models with it). ``pin_memory``: batches in page-locked memory, for copies to a
    GPU that do not make the host wait (the strategy moves them with ``non_blocking``)."""
    workers = {}
    if num_workers:
        fork = "fork" in multiprocessing.get_all_start_methods()
        workers = {"num_workers": num_workers, "persistent_workers": True,
                   "multiprocessing_context": "fork" if fork else None}
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=collate,
                      generator=torch.Generator().manual_seed(seed), pin_memory=pin_memory, **workers)


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
                if hasattr(self.loader, "set_epoch"):  # a plain DataLoader (no strategy) has none
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


def eval_loader(dataset, batch_size: int, collate: Callable, accelerator) -> DataLoader:
    """This process's share of the held-out split as ``(batch, rows)``: the batches one process would make, dealt
    out in turn.

    Whole batches, not rows, are dealt out, so every metric is the same mean of the same batch means on any number
    of processes; no row is repeated (a distributed sampler pads the last batch with duplicates, which a mean
    would count twice). Every process runs the same number of forward passes (under FSDP2 or ZeRO-3 each is a
    collective): one with fewer batches repeats the first with ``rows`` 0 (negative indices, see ``_Weighted``)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = [list(range(start, min(start + batch_size, len(dataset)))) for start in range(0, len(dataset), batch_size)]
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
