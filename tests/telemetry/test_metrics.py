"""rlhf/telemetry/metrics.py: sums over processes, including processes that hold different metric keys."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.core.train_state import TrainState
from rlhf.hardware import free_port
from rlhf.ops.collectives import any_process, sum_over_processes
from rlhf.telemetry.metrics import evaluate, window_means


class _Processes:
    """What the helpers use of an Accelerator, over a gloo process group."""

    device = torch.device("cpu")
    is_main_process = True

    def __init__(self, world: int) -> None:
        self.num_processes = world

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        dist.all_reduce(tensor)
        return tensor


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        processes = _Processes(world)
        # Rank 0 logged "kl" in its window, rank 1 did not; rank 1 alone logged "clip".
        state = TrainState()
        state.window_sums.update({"loss": 1.0 + rank, **({"kl": 0.5} if rank == 0 else {"clip": 3.0})})
        state.window_weights.update({"loss": 1.0, **({"kl": 1.0} if rank == 0 else {"clip": 2.0})})
        results[rank] = {
            "sums": sum_over_processes({"a": 1.0, f"only_{rank}": 2.0}, processes),
            "window": window_means(state, "train/", processes),
            "flags": any_process({"nonfinite": rank == 1, "stop": False}, processes),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.serial
def test_processes_with_different_keys_agree_on_the_union_instead_of_hanging():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(2, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        assert results[rank]["sums"] == {"a": 2.0, "only_0": 2.0, "only_1": 2.0}
        # loss: (1 + 2) / 2; kl: 0.5 / 1 (rank 1 adds nothing); clip: 3 / 2
        assert results[rank]["window"] == {"train/clip": 1.5, "train/kl": 0.5, "train/loss": 1.5}
        assert results[rank]["flags"] == {"nonfinite": True, "stop": False}


def test_one_process_returns_its_own_values():
    one = _Processes(1)
    assert sum_over_processes({"b": torch.tensor(2.5), "a": 1}, one) == {"a": 1.0, "b": 2.5}
    state = TrainState()
    state.window_sums.update({"loss": 3.0})
    state.window_weights.update({"loss": 2.0})
    assert window_means(state, "train/", one) == {"train/loss": 1.5}


class _Scores:
    """An algorithm whose held-out metric is the batch's mean."""

    def evaluate(self, model, batch):
        return {"mean": batch["x"].float().mean()}


def test_evaluation_leaves_the_random_numbers_of_training_as_they_were():
    loader = torch.utils.data.DataLoader([{"x": torch.tensor(i)} for i in range(8)], batch_size=4, shuffle=True)
    rows = ((batch, len(batch["x"])) for batch in loader)  # drawing the loader's seed uses torch's generator
    model = torch.nn.Linear(1, 1)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert evaluate(model, _Scores(), rows, _Processes(1)) == {"eval/mean": 3.5}
    assert torch.equal(torch.get_rng_state(), before)
