"""What spawned test processes run, in a module of its own: a spawned process imports the module of its target, and
a test module's top level is heavy (test_dpo_losses composes every algorithm's config: seconds a process)."""

from __future__ import annotations

import datetime

import torch

from rlhf.algos import dpo_losses as L
from rlhf.ops.collectives import sum_over_every_process

BETA = 0.5


def bco_shard(step: int, rank: int | None, global_sum=None) -> L.PairLogps:
    """Step ``step``'s pairs of process ``rank`` (rank 0 holds 2 pairs, rank 1 holds 1), or of both (None)."""
    logps = torch.tensor([[-2.0, -5.0, -1.0], [-3.5, -0.5, -4.0]])[step]  # policy chosen; rejected = chosen - 2
    ref = torch.tensor([[-3.0, -4.0, -3.0], [-3.0, -2.0, -1.0]])[step]
    rows = slice(None) if rank is None else slice(0, 2) if rank == 0 else slice(2, 3)
    p, r = logps[rows], ref[rows]
    return L.PairLogps(p, p - 2, r, r + 1, torch.ones_like(p), torch.ones_like(p), global_sum=global_sum)


def bco_two_steps(rank: int, port: int, results) -> None:
    """Process ``rank`` of 2 (gloo): two steps of BCO's running mean on its shards, summed over both processes;
    ``results[rank]`` = (count, mean, each step's losses)."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=30))
    try:
        state: dict = {}
        losses = [L.bco_pair_loss(bco_shard(step, rank, sum_over_every_process), BETA, state,
                                  running_mean=True).tolist() for step in range(2)]
        results[rank] = (state["bco_reward_count"].item(), state["bco_reward_mean"].item(), losses)
    finally:
        torch.distributed.destroy_process_group()
