"""rlhf/data/loaders.py: held-out batches dealt out whole, and training batches that continue where they stopped."""

from __future__ import annotations

import itertools
import time

import torch

from rlhf.core.train_state import TrainState
from rlhf.data.loaders import Batches, eval_loader, train_loader


class _Rank:
    def __init__(self, rank: int, world: int) -> None:
        self.process_index, self.num_processes = rank, world

    @staticmethod
    def skip_first_batches(loader, n: int):
        return itertools.islice(loader, n, None)


def _collate(rows):
    return {"row": torch.tensor([r["row"] for r in rows])}


def test_eval_batches_are_dealt_whole_and_every_process_runs_as_many():
    dataset = [{"row": i} for i in range(10)]  # batches of 2: five batches for two processes
    shares = [list(eval_loader(dataset, 2, _collate, _Rank(rank, 2))) for rank in (0, 1)]
    assert [len(share) for share in shares] == [3, 3]  # rank 1 repeats a batch with weight 0
    counted = sorted(r for share in shares for batch, rows in share if rows for r in batch["row"].tolist())
    assert counted == list(range(10))  # each row once, with its weight
    assert [rows for _, rows in shares[1]] == [2.0, 2.0, 0.0]
    assert [batch["row"].tolist() for batch, _ in shares[0]] == [[0, 1], [4, 5], [8, 9]]


def test_batches_continue_mid_epoch_and_into_the_next():
    loader = train_loader([{"row": i} for i in range(6)], 2, _collate, seed=0)
    state = TrainState()
    whole = Batches(loader, state, _Rank(0, 1))
    seen = [whole.next()["row"].tolist() for _ in range(5)]  # 3 batches an epoch: into the second
    assert (state.epoch, state.batch_in_epoch) == (1, 2)
    resumed_state = TrainState(epoch=0, batch_in_epoch=2)
    loader = train_loader([{"row": i} for i in range(6)], 2, _collate, seed=0)
    resumed = Batches(loader, resumed_state, _Rank(0, 1))  # the loader's own seeded generator: the same order
    assert resumed.next()["row"].tolist() == seen[2]
    assert sorted(r for batch in seen[:3] for r in batch) == list(range(6))  # one epoch: every row once


def _slow_first(rows):
    """A batch with row 0 takes longer to collate: a worker that finishes the next batch first must wait its turn."""
    if any(r["row"] == 0 for r in rows):
        time.sleep(0.1)
    return _collate(rows)


def _ordered(loader, state: TrainState, accelerator, count: int) -> list[list[int]]:
    batches = Batches(loader, state, accelerator)
    return [batches.next()["row"].tolist() for _ in range(count)]


def test_worker_processes_collate_the_same_batches_in_the_same_order():
    """Through the strategy's prepared loader (Accelerate's seedable sampler, set_epoch, skip_first_batches): 2
    worker processes give the batches 0 workers give, over epochs and after a resume mid-epoch, and leave the global
    random state as they found it, as 0 workers do (a resumed run's dropout masks depend on it)."""
    from rlhf.hardware import DataParallel

    rows = [{"row": i} for i in range(10)]  # 5 batches of 2 an epoch
    seen = {}
    for workers in (0, 2):
        strategy = DataParallel(device="cpu", threads_per_process=1)
        accelerator = strategy.start(seed=3)
        loader = accelerator.prepare(train_loader(rows, 2, _slow_first, seed=3, num_workers=workers))
        assert loader.num_workers == workers
        torch.manual_seed(0)
        whole = _ordered(loader, TrainState(), accelerator, 12)  # into the third epoch
        resumed = _ordered(loader, TrainState(epoch=1, batch_in_epoch=2), accelerator, 5)
        seen[workers] = (whole, resumed, torch.get_rng_state())
    assert seen[2][:2] == seen[0][:2]
    assert seen[0][1] == seen[0][0][7:12]  # the resume continues with the very next batch
    assert sorted(r for batch in seen[2][0][:5] for r in batch) == list(range(10))  # each row once an epoch
    assert torch.equal(seen[2][2], seen[0][2])


def test_workers_unset_are_the_tables_choice_and_none_until_a_gpu_measures_them():
    from rlhf.core import auto_choices
    from rlhf.data.loaders import loader_workers

    assert (loader_workers(None, cuda=True), loader_workers(None, cuda=False)) == (0, 0)
    assert loader_workers(None, cuda=True) == auto_choices.pick("data.num_workers", "cuda")
    assert loader_workers(3, cuda=False) == 3 and loader_workers(0, cuda=True) == 0
