"""Trackers read back: what TensorBoard and offline W&B wrote, several loggers at once, and the W&B group that the
points of one sweep share."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf.telemetry.loggers import Loggers, TensorBoardLogger, sweep_group
from tests.conftest import FAST, ROOT


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the event files in ``folder``: tag -> [(step, value)], as its loader
    reads them (purges included)."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_text(folder: Path, tag: str) -> list[str]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")]


def wandb_records(path: Path):
    """The records of an offline W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each with a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def wandb_run(run_dir: Path) -> tuple[str, dict, dict[int, dict]]:
    """(group, config, history by step) of the one offline W&B run in ``run_dir``."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    group, config, history = None, {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            group = record.run.run_group
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    return group, config, history


def test_tensorboard_writes_scalars_and_the_config_and_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    """A resume from step 3 of a run stopped after step 5: TensorBoard shows steps 1-5 once each, 4 and 5 from the
    resumed run; the config is there as text (both attempts'). ~2 s."""
    run = str(tmp_path / "run")
    stopped = Loggers([TensorBoardLogger()])
    stopped.start(run, {"seed": 7, "optimizer": {"lr": 0.5}})
    for step in range(1, 6):
        stopped.log({"train/loss": float(step)}, step)
    # killed: no finish (the events are flushed at every log)
    resumed = Loggers([TensorBoardLogger()])
    resumed.start(run, {"seed": 7, "optimizer": {"lr": 0.5}}, resume_step=3)
    for step in (4, 5):
        resumed.log({"train/loss": 10.0 * step}, step)
    resumed.finish()
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert scalars == {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]}
    texts = tensorboard_text(tmp_path / "run" / "tensorboard", "config")
    assert len(texts) == 2 and all("seed: 7" in text and "lr: 0.5" in text for text in texts)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["train/loss"]) for row in lines] == [(s, v) for s, v in scalars["train/loss"]]

    fresh = Loggers([TensorBoardLogger()])  # a new run in the folder: a new record
    fresh.start(run, {"seed": 8})
    fresh.log({"train/loss": 0.25}, 1)
    fresh.finish()
    assert tensorboard_scalars(tmp_path / "run" / "tensorboard") == {"train/loss": [(1, 0.25)]}


def test_a_sweep_with_two_loggers_writes_both_and_its_points_share_a_wandb_group(tmp_path):
    """`python train.py -m logger=[wandb,tensorboard] seed=0,1` offline: each point has metrics.jsonl, TensorBoard
    scalars and an offline W&B run whose history and config match it, and both W&B runs are in the sweep's group. ~10 s."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "HOME": str(tmp_path),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *FAST, "train.max_steps=2",
                           "logger=[wandb,tensorboard]", "seed=0,1", f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    points = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(points) == 2 and not any("logger" in p.name for p in points)  # the loggers do not name the folders
    groups = set()
    for seed, point in enumerate(points):
        lines = [json.loads(line) for line in (point / "metrics.jsonl").read_text().splitlines()]
        losses = [(row["step"], row["train/loss"]) for row in lines if "train/loss" in row]
        assert [step for step, _ in losses] == [1, 2]
        scalars = tensorboard_scalars(point / "tensorboard")
        assert [step for step, _ in scalars["train/loss"]] == [1, 2]  # TensorBoard keeps float32 values
        assert all(abs(tb - jsonl) <= 1e-6 * abs(jsonl) for (_, tb), (_, jsonl) in zip(scalars["train/loss"], losses))
        assert "seed: " + str(seed) in tensorboard_text(point / "tensorboard", "config")[0]
        group, config, history = wandb_run(point)
        groups.add(group)
        assert config["seed"] == seed and config["output_dir"] == str(point) and "_target_" in config["optimizer"]
        assert [(step, history[step]["train/loss"]) for step, _ in losses] == losses
        assert history[0]["eval/loss"] == lines[0]["eval/loss"]
    assert groups == {str(sweep)}


def test_a_single_run_has_no_sweep_group():
    assert sweep_group() is None  # outside Hydra, and (checked by the sweep above) in a run that is not a sweep point
