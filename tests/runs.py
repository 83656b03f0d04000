"""Runs as a user starts them, and the comparison of an interrupted-and-resumed run with an uninterrupted one.

Shared by the checkpoint and signal tests: the parameters and the optimizer state bit for bit, every metric but
``perf/*`` (timings) as exact floats, and the summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.run import checkpoint
from tests.conftest import FAST, ROOT, assert_equal_trees, compose_config

# Long enough that a kill lands between a checkpoint and the end; small enough for seconds.
RUN = [*(o for o in FAST if not o.startswith(("train.max_steps", "data.task.num_train", "train.log_every"))),
       "data.task.num_train=48", "train.max_steps=40", "train.save_every_steps=10", "train.keep_last=null",
       "train.log_every_steps=3", "train.eval_every_steps=7", "model.tiny.attention_dropout=0.1"]


def start(run: Path, *overrides: str, wait: bool = True, env: dict | None = None) -> subprocess.Popen:
    """``train.py`` with RUN and `overrides` into `run`, in its own session; waited for (and asserted to succeed)."""
    command = [sys.executable, "train.py", *RUN, *overrides, f"hydra.run.dir={run}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    if wait:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
    return process


def metrics(run: Path) -> list[dict]:
    """Every logged line without perf/* (timings), values as exact floats. A line of timings only (a checkpoint's
    perf/checkpoint_time_s) is left out: a run killed right after a checkpoint may not have written it."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: float(v).hex() for k, v in line.items() if not k.startswith("perf/")} for line in lines]
    return [line for line in kept if set(line) != {"step"}]


def assert_same_run(a: Path, b: Path, last_step: int, processes: int = 1) -> None:
    """Run `b` (interrupted and resumed) ended exactly as run `a` (uninterrupted): parameters, the last checkpoint's
    optimizer, scheduler and every rank's own state (data position, counters, random generators), the metrics and
    the summary."""
    left, right = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert left.keys() == right.keys()
    assert all(torch.equal(left[k], right[k]) for k in left), "parameters differ"
    folder = f"{checkpoint.FOLDER}/{checkpoint.PREFIX}{last_step:08d}"
    for name in ("optimizer.pt", "scheduler.pt", *(f"rank_{rank}.pt" for rank in range(processes))):
        x, y = (torch.load(r / folder / name, weights_only=True) for r in (a, b))
        if name.startswith("rank_"):
            for entry in (x, y):
                entry["rng"].pop("python")  # tuples of ints
                entry["train"]["last"] = {k: v for k, v in entry["train"]["last"].items() if not k.startswith("perf/")}
            assert x["train"] == y["train"], name
        assert_equal_trees(x, y, name)
    assert metrics(a) == metrics(b)
    assert summary(a) == summary(b)


def summary(run: Path) -> dict:
    """summary.json without perf/* (timings) and the machine's load (``load``), the final metrics as exact floats."""
    summary = json.loads((run / "summary.json").read_text())
    summary.pop("load", None)  # what other work did on the machine meanwhile, as perf/busy_cpus_other
    summary["final"] = {k: float(v).hex() for k, v in summary["final"].items() if not k.startswith("perf/")}
    return summary


def uninterrupted(run: Path, *overrides: str) -> None:
    """The reference run, in this process (the same config as the command line's; no interpreter start-up)."""
    train(compose_config(*RUN, *overrides, output_dir=run))


# Two processes with their own data shards and accumulation: the SIGKILL and the stop-signal tests compare with one
# uninterrupted run of these settings (the session fixture ``two_process_reference``).
TWO_PROCESSES = ["algo=dpo", "hardware=cpu_ddp", "train.per_device_batch_size=2", "train.grad_accumulation_steps=2"]
