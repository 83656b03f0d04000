"""``python train.py algo=dpo optimizer=muon`` as a run: the partition in the start-up lines and in the run folder,
its counts the model's; a run stopped at a checkpoint and resumed ends as the uninterrupted one, bit for bit
(weights and optimizer state; the metrics lines differ by the shorter run's own final evaluation)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.run import checkpoint
from tests.conftest import FAST, assert_equal_trees, compose_config

RUN = [*FAST, "algo=dpo", "optimizer=muon", "scheduler=constant", "train.eval_at_start=false",
       "train.eval_every_steps=0", "train.save_every_steps=2", "train.keep_last=null", "train.log_every_steps=1"]


def test_a_muon_run_records_its_partition_and_resumes_bit_for_bit(tmp_path, caplog):
    """Red when partition.json is not written, when its counts are not the model's, or when a resumed run's Muon
    or AdamW state is not the one saved (its momentum restarted)."""
    with caplog.at_level("INFO", logger="rlhf.run.components"):
        train(compose_config(*RUN, "train.max_steps=4", output_dir=tmp_path / "whole"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer partition"))
    assert "muon: hidden matrices 7 tensor(s)" in line and "adamw: biases, norms and vectors" in line
    record = json.loads((tmp_path / "whole" / "partition.json").read_text())
    weights = load_file(tmp_path / "whole" / "final" / "model.safetensors")  # the tied output layer saved once
    assert sum(part["parameters"] for part in record["parts"]) == sum(w.numel() for w in weights.values())
    assert sorted(n for part in record["parts"] for n in part["names"]) == sorted(weights)
    train(compose_config(*RUN, "train.max_steps=2", output_dir=tmp_path / "resumed"))
    train(compose_config(*RUN, "train.max_steps=4", "resume=auto", "resume_changes=[train.max_steps]",
                         output_dir=tmp_path / "resumed"))
    left, right = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("whole", "resumed"))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left), "parameters differ"
    last = f"{checkpoint.FOLDER}/{checkpoint.PREFIX}{4:08d}/optimizer.pt"  # both rules' state, every group
    x, y = (torch.load(tmp_path / r / last, weights_only=True) for r in ("whole", "resumed"))
    assert {g["rule"] for g in x["param_groups"]} == {"muon", "adamw"} and len(x["state"]) == len(left)
    assert_equal_trees(x, y, "optimizer.pt")
