"""Checkpoints and exact resume (rlhf/run/checkpoint.py, rlhf/run/folder.py and the loop's use of them).

The kill-and-resume tests run ``train.py`` as a user would, SIGKILL it after a checkpoint while it is still
training, resume it with ``resume=auto``, and compare with an uninterrupted run of the same seed: the final
parameters and the optimizer state bit for bit, and every metric but ``perf/*`` (compared as exact floats).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.core.errors import UserError
from rlhf.core.train_state import TrainState
from rlhf.run import checkpoint
from rlhf.run import folder as run_folder
from rlhf.telemetry.loggers import JsonlLogger
from tests.conftest import FAST, ROOT, compose_config
from tests.runs import TWO_PROCESSES, assert_same_run, start, uninterrupted


# --- pieces --------------------------------------------------------------------------------------------------------
def test_train_state_round_trips_through_a_weights_only_load(tmp_path):
    state = TrainState(step=7, epoch=1, batch_in_epoch=3, nonfinite_steps=1, window_steps=2, window_tokens=99)
    state.window_sums["loss"] += 1.25
    state.window_weights["loss"] += 2.0
    state.last["eval/loss"] = 0.5
    torch.save({"train": state.to_dict(), "rng": checkpoint.rng_state()}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    back = TrainState.from_dict(loaded["train"])
    assert back == state and back.window_sums["unseen"] == 0.0  # still a defaultdict


def test_random_generators_are_restored():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = checkpoint.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    checkpoint.set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def _as_if_saved_on_a_gpu(path: Path, only: torch.Tensor | None = None) -> None:
    """Write ``path`` again as a GPU run writes it: every tensor (or only ``only``) recorded as saved on cuda:0, the
    way ``torch.save`` records each tensor's device (``torch.serialization.location_tag``)."""
    obj = torch.load(path, weights_only=True) if only is None else {"on_device": only, "on_cpu": torch.ones(2)}
    tag = torch.serialization.location_tag

    def on_gpu(storage) -> str:
        return "cuda:0" if only is None or storage.data_ptr() == only.untyped_storage().data_ptr() else tag(storage)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", on_gpu)
        torch.save(obj, path)


def test_a_file_loads_each_tensor_onto_the_reading_process(tmp_path):
    """A tensor saved on a GPU goes to the reading process's device (here "meta", a device this machine has), one
    saved on the CPU (a random generator's state) stays there."""
    from rlhf.core.file_io import load_torch

    _as_if_saved_on_a_gpu(tmp_path / "f.pt", only=torch.zeros(3))
    loaded = load_torch(tmp_path / "f.pt", torch.device("meta"))
    assert loaded["on_device"].device.type == "meta" and loaded["on_device"].shape == (3,)
    assert loaded["on_cpu"].device.type == "cpu" and loaded["on_cpu"].tolist() == [1.0, 1.0]


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu(fast_config, tmp_path):
    """Every file a resume reads with torch.load, written again as a GPU run writes it: a plain torch.load on a
    machine without a GPU refuses it; the resume reads each tensor onto this process's device (the random
    generators' states onto the CPU) and ends as the uninterrupted run did."""
    train(fast_config("train.save_every_steps=2"))  # 3 steps, a checkpoint at step 2
    folder = tmp_path / "run" / checkpoint.FOLDER / f"{checkpoint.PREFIX}{2:08d}"
    for name in ("optimizer.pt", "scheduler.pt", "rank_0.pt"):
        _as_if_saved_on_a_gpu(folder / name)
    if not torch.cuda.is_available():  # what a resume without map_location met
        with pytest.raises(RuntimeError, match="CUDA device but torch.cuda.is_available"):
            torch.load(folder / "rank_0.pt", weights_only=True)
    train(compose_config(*FAST, "train.save_every_steps=2", f"resume={folder}", output_dir=tmp_path / "resumed"))
    whole, resumed = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("run", "resumed"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_bf16_resume_keeps_the_thread_count_of_its_run_whatever_the_load(fast_config, tmp_path, monkeypatch,
                                                                           caplog):
    """bf16 steps on a CPU depend on the thread count: a run started with 1 CPU resumes with 1 thread where it now has
    2, which a fresh run would use, and says why; it ends as the uninterrupted run did (red: the count chosen again).
    """
    from rlhf.hardware import cpus

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "cpus_available", lambda: 1)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 0.0)
    bf16 = ["hardware.mixed_precision=bf16", "train.save_every_steps=2"]
    train(fast_config(*bf16))  # 3 steps at 1 thread, a checkpoint at step 2
    folder = tmp_path / "run" / checkpoint.FOLDER / f"{checkpoint.PREFIX}{2:08d}"
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    caplog.set_level(logging.INFO, logger="rlhf")
    train(compose_config(*FAST, *bf16, f"resume={folder}", output_dir=tmp_path / "resumed"))
    assert "1 thread(s) each (the count of the bf16 run this resume continues" in caplog.text
    whole, resumed = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("run", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def _fake_checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    folder = run / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / checkpoint.META).write_text(json.dumps({"format": checkpoint.FORMAT, "step": step}))
    return folder


def test_resume_choices(tmp_path):
    run = tmp_path / "run"
    assert checkpoint.resolve(None, run) is None and checkpoint.resolve("auto", run) is None
    _fake_checkpoint(run, 10)
    newest = _fake_checkpoint(run, 20)
    _fake_checkpoint(run, 30, complete=False)  # an interrupted save: never picked
    (run / checkpoint.FOLDER / ".tmp-step_00000040").mkdir()
    assert checkpoint.resolve("auto", run) == newest
    assert checkpoint.resolve(str(newest), run) == newest
    with pytest.raises(UserError, match=r"already holds checkpoints \(newest: step_00000020\).*resume=auto"):
        checkpoint.resolve(None, run)
    with pytest.raises(UserError, match="is a run folder, not a checkpoint"):
        checkpoint.resolve(str(run), tmp_path / "other")
    with pytest.raises(UserError, match="not a complete checkpoint"):
        checkpoint.resolve(str(run / checkpoint.FOLDER / "step_00000030"), run)
    with pytest.raises(UserError, match="no such checkpoint"):
        checkpoint.resolve(str(tmp_path / "nothing"), run)


def test_replace_folder_swaps_in_a_complete_folder(tmp_path):
    target, staging = tmp_path / "final", tmp_path / "final.tmp"
    staging.mkdir()
    (staging / "a").write_text("1")
    checkpoint.replace_folder(staging, target)
    staging.mkdir()
    (staging / "a").write_text("2")
    checkpoint.replace_folder(staging, target)
    assert (target / "a").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_metrics_file_is_cut_back_to_the_checkpoint_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 2, 4, 6))
                                             + '{"step": 8, "x"')  # the last line cut short by a kill
    logger = JsonlLogger()
    logger.start(str(tmp_path), {}, resume_step=4)
    logger.log({"x": 6.0}, 6)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 2, 4, 6]
    JsonlLogger().start(str(tmp_path), {})  # a new run: a new file
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_run_folder_lock_refuses_a_second_run_and_is_freed_by_a_killed_one(tmp_path):
    with run_folder.claim(tmp_path):
        child = subprocess.run([sys.executable, "-c", (
            "from rlhf import run_folder; import sys\n"
            f"with run_folder.claim({str(tmp_path)!r}): pass")], capture_output=True, text=True, cwd=ROOT)
        assert child.returncode != 0 and f"PID {os.getpid()}" in child.stderr and "is writing the run folder" in child.stderr
    holder = subprocess.Popen([sys.executable, "-c", (
        "from rlhf import run_folder; import time\n"
        f"with run_folder.claim({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    with run_folder.claim(tmp_path):  # the kernel dropped the dead run's lock
        pass


def test_a_new_run_clears_the_previous_runs_results(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    assert run_folder.prepare(tmp_path, None) is None
    run_folder.clear_previous_results(tmp_path)
    assert (tmp_path / "final").exists() and not (tmp_path / "summary.json").exists()  # the model stays in place
    assert run_folder.prepare(tmp_path, "auto") is None  # an unfinished run (no summary.json): it starts
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds a finished run \(summary.json\)"):
        run_folder.prepare(tmp_path, "auto")


# --- kill and resume, as a user runs it ------------------------------------------------------------------------------
def _kill_after_checkpoint(process: subprocess.Popen, run: Path, step: int, pids=None) -> None:
    """SIGKILL the run (or the given PIDs) once the checkpoint of `step` is complete, while it still trains."""
    meta = run / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}" / checkpoint.META
    deadline = time.time() + 240
    while not meta.exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.005)
    for pid in (pids() if pids else [process.pid]):
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert not (run / "final").exists(), "the run ended before the kill: make it longer"


# GRPO: 3 passes over each rollout, so that the checkpoint at step 20 (40 micro-batches) lands inside a rollout's
# buffer; a graded reward, so that the random-init model learns from its first rollout.
# PPO: the same, with the state only it has: the critic (part of the model), the running score statistics and the
# adaptive KL coefficient (part of the algorithm's state).
ONLINE = {"grpo": ["algo/reward_funcs=similarity", "algo.num_generations=4", "algo.max_completion_length=8",
                   "algo.num_iterations=3"],
          "ppo": ["algo/reward_funcs=similarity", "algo.num_generations=4", "algo.max_completion_length=8",
                  "algo.num_ppo_epochs=3", "algo/kl_controller=adaptive", "algo.score_norm=true"]}


@pytest.mark.parametrize("algo", ["sft", "dpo", "dpo_bf16", "grpo", "ppo"])
def test_sigkill_then_resume_equals_an_uninterrupted_run(algo, tmp_path):
    """``dpo_bf16``: under bf16 autocast (hardware=auto's choice on a CPU with bf16 units), whose frozen reference
    keeps bf16 weights, rebuilt at the resume."""
    algo, _, precision = algo.partition("_")
    overrides = [f"algo={algo}", "optimizer=lion", "train.grad_accumulation_steps=2", *ONLINE.get(algo, []),
                 *([f"hardware.mixed_precision={precision}"] if precision else [])]
    uninterrupted(tmp_path / "whole", *overrides)
    killed = start(tmp_path / "killed", *overrides, wait=False)
    _kill_after_checkpoint(killed, tmp_path / "killed", 20)
    if algo == "dpo":  # a new run into it is refused, the folder untouched
        refused = start(tmp_path / "killed", *overrides, wait=False)
        assert refused.wait(timeout=120) == 1 and "resume=auto" in refused.stderr.read()
    start(tmp_path / "killed", *overrides, "resume=auto")
    assert_same_run(tmp_path / "whole", tmp_path / "killed", 40)


def _ranks(parent: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.serial
def test_sigkill_of_a_two_process_run_then_resume_equals_an_uninterrupted_run(tmp_path, two_process_reference):
    """SIGKILL of the run's own process (as `kill -9` or the OOM killer would): its ranks die with it (they would
    otherwise train on and write the folder), and resuming continues both ranks' state exactly."""
    killed = start(tmp_path / "killed", *TWO_PROCESSES, wait=False)
    ranks = []
    _kill_after_checkpoint(killed, tmp_path / "killed", 20, pids=lambda: ranks.extend(_ranks(killed.pid)) or [killed.pid])
    assert len(ranks) == 2
    deadline = time.time() + 10
    while any(_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their killed parent"
    start(tmp_path / "killed", *TWO_PROCESSES, "resume=auto")
    assert_same_run(two_process_reference, tmp_path / "killed", 40, processes=2)


@pytest.mark.parametrize("damage, message", [
    ({"processes": 2}, r"written by 2 process\(es\) and this run has 1: .* "
                       r"Fix: resume with hardware\.num_processes=2\.$"),
    ({"strategy": "FSDP2"}, r"written by the FSDP2 strategy and this run uses DataParallel: .* "
                            r"Fix: resume with the hardware option that wrote it\.$"),
    ("rank_0.pt", r"has no rank_0\.pt: the checkpoint is incomplete\. Fix: resume from an older one "
                  r"\(resume=<run dir>/checkpoints/step_<N>\)\.$"),
    ({"format": 0}, r"another version of rlhf \(checkpoint format 0, this one reads 1\)\. "
                    r"Fix: resume with the version that wrote it\.$"),
], ids=["processes", "strategy", "rank-file", "format"])
def test_a_checkpoint_this_run_cannot_continue_is_refused(damage, message, fast_config, tmp_path):
    """A checkpoint of another process count, strategy or format, or without this rank's file: one error that says
    what to change, raised before the resumed run writes any metric."""
    train(fast_config("train.save_every_steps=1"))
    folder = checkpoint.latest(tmp_path / "run")
    if isinstance(damage, dict):
        meta = json.loads((folder / checkpoint.META).read_text())
        (folder / checkpoint.META).write_text(json.dumps({**meta, **damage}))
    else:
        (folder / damage).unlink()
    with pytest.raises(UserError, match=message) as refused:
        train(compose_config(*FAST, f"resume={folder}", output_dir=tmp_path / "resumed"))
    assert str(refused.value).startswith(str(folder)) and not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_a_failed_save_keeps_the_previous_checkpoint_and_the_metrics(fast_config, tmp_path, monkeypatch):
    """A disk that fills up during the step-2 checkpoint: one clear error, step 1's checkpoint and the metrics stay."""
    import errno

    from rlhf.hardware.base import DataParallel

    original, calls = DataParallel.save_state, []

    def full_disk(self, model, optimizer, folder):
        calls.append(folder)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, model, optimizer, folder)

    monkeypatch.setattr(DataParallel, "save_state", full_disk)
    with pytest.raises(UserError, match=r"could not write the checkpoint of step 2 .*No space left.*kept"):
        train(fast_config("train.save_every_steps=1"))
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000001"]
    assert not list((run / checkpoint.FOLDER).glob(".tmp-*"))  # the partial one is gone
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
    assert not (run / "final").exists()


def test_a_save_refused_at_its_last_small_files_ends_the_same_way(fast_config, tmp_path, monkeypatch):
    """The disk fills up after the large files, while meta.json is written and synced: the same one message, the
    partial checkpoint removed, the previous one kept (on every rank alike: the outcome is agreed on)."""
    import errno

    original, calls = checkpoint._fsync_tree, []

    def full_disk(folder):
        calls.append(folder)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(folder)

    monkeypatch.setattr(checkpoint, "_fsync_tree", full_disk)
    with pytest.raises(UserError, match=r"could not write the checkpoint of step 2 .*No space left.*kept"):
        train(fast_config("train.save_every_steps=1"))
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000001"]
    assert not list((run / checkpoint.FOLDER).glob(".tmp-*")) and not (run / "final").exists()


def test_a_resume_reads_every_file_weights_only(fast_config, tmp_path, monkeypatch):
    """Every torch.load of a one-process resume passes weights_only=True: loading a checkpoint runs no code. (The
    same for DDP, FSDP2 and ZeRO, DeepSpeed's own loads included: tests/hardware/test_sharded.py.)"""
    train(fast_config("train.save_every_steps=2"))  # a checkpoint at step 2 of 3
    calls, original = [], torch.load

    def load(f, *args, **kwargs):
        calls.append((Path(f).name if isinstance(f, (str, os.PathLike)) else type(f).__name__,
                      kwargs.get("weights_only")))
        return original(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(torch.serialization, "load", load)
    train(fast_config("train.save_every_steps=2", "resume=auto"))
    assert {"optimizer.pt", "scheduler.pt", "rank_0.pt"} <= {name for name, _ in calls}, calls
    assert [(name, flag) for name, flag in calls if flag is not True] == [], calls


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; the tied embedding under both its names (each writer keeps only one of them)."""
    tensors = load_file(path)
    tied = ("lm_head.weight", "model.embed_tokens.weight")
    for name, other in (tied, tied[::-1]):
        if name not in tensors and other in tensors:
            tensors[name] = tensors[other]
    return tensors


def test_only_the_newest_keep_last_checkpoints_stay(fast_config, tmp_path):
    """keep_last=2 of 3 checkpoints: the oldest is removed, and each kept one is whole and holds its own step."""
    train(fast_config("train.save_every_steps=1", "train.keep_last=2"))
    run = tmp_path / "run"
    kept = checkpoint.complete(run)
    assert [p.name for p in kept] == ["step_00000002", "step_00000003"]
    for folder in kept:
        step = checkpoint.step_of(folder)
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json", "meta.json", "model.safetensors", "optimizer.pt", "rank_0.pt", "scheduler.pt"], folder.name
        assert checkpoint.read_meta(folder)["step"] == step
        assert torch.load(folder / "rank_0.pt", weights_only=True)["train"]["step"] == step
        assert torch.load(folder / "scheduler.pt", weights_only=True)["last_epoch"] == step
        optimizer = torch.load(folder / "optimizer.pt", weights_only=True)  # AdamW counts its steps per parameter
        assert {float(s["step"]) for s in optimizer["state"].values()} == {step}, folder.name
    final, newest, older = (_weights(f / "model.safetensors") for f in (run / "final", kept[1], kept[0]))
    assert final.keys() == newest.keys() == older.keys()
    assert all(torch.equal(final[k], newest[k]) for k in final), "the step-3 checkpoint is not the final model"
    assert not all(torch.equal(final[k], older[k]) for k in final), "the step-2 checkpoint holds the final model"


def _fake_checkpoints(run: Path, steps: list[int]) -> list[Path]:
    folders = []
    for step in steps:
        folder = run / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"
        (folder / "sharded").mkdir(parents=True)
        for name in ("model.safetensors", "sharded/0.distcp", "rank_0.pt"):
            (folder / name).write_bytes(b"x")
        (folder / checkpoint.META).write_text(json.dumps({"format": checkpoint.FORMAT, "step": step}))
        folders.append(folder)
    return folders


def test_a_kill_while_pruning_never_leaves_a_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    """The deletion of an old checkpoint is cut short after its first file: the folder is no longer listed (so
    resume=auto or an explicit resume cannot pick a half-deleted one), and the next prune finishes removing it."""
    run = tmp_path / "run"
    oldest, _, newest = _fake_checkpoints(run, [1, 2, 3])
    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        first = next(p for p in sorted(Path(path).rglob("*")) if p.is_file())
        first.unlink()
        raise KeyboardInterrupt  # the kill, mid-deletion

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(run, keep_last=2, written=newest)
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000002", "step_00000003"]
    with pytest.raises(UserError, match="no such checkpoint"):
        checkpoint.resolve(str(oldest), run)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    checkpoint.prune(run, keep_last=2, written=newest)
    assert sorted(p.name for p in (run / checkpoint.FOLDER).iterdir()) == ["step_00000002", "step_00000003"]


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    """A resume from step 2 of a folder that still holds steps 5 and 6 writes step 3: keep_last=2 must not remove
    the checkpoint it just wrote, whatever the newer ones left there."""
    run = tmp_path / "run"
    folders = _fake_checkpoints(run, [2, 3, 5, 6])
    checkpoint.prune(run, keep_last=2, written=folders[1])
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000003", "step_00000005", "step_00000006"]


def test_every_folder_of_a_checkpoint_is_synced_before_it_counts(tmp_path, monkeypatch):
    """Nested folders (sharded/, DeepSpeed's global_step*/) hold entries too: each is fsynced, not only the top."""
    (folder,) = _fake_checkpoints(tmp_path, [1])
    (folder / "global_step1" / "zero").mkdir(parents=True)
    synced = []
    real = checkpoint._fsync_dir
    monkeypatch.setattr(checkpoint, "_fsync_dir", lambda path: synced.append(Path(path)) or real(path))
    checkpoint._fsync_tree(folder)
    assert set(synced) == {folder, folder / "sharded", folder / "global_step1", folder / "global_step1" / "zero"}
    assert synced[-1] == folder  # the top last, once everything below it is on disk


# --- a resume that cannot mix runs -------------------------------------------------------------------------------
def _logged_steps(run: Path, checkpoints: bool = False) -> list[int]:
    """The steps of metrics.jsonl's lines: training and evaluation lines, or (``checkpoints``) the lines of the
    checkpoints' seconds."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["step"] for line in lines if ("perf/checkpoint_time_s" in line) == checkpoints]


def test_checkpoints_by_time_after_the_minutes_pass_since_the_last_one_and_beside_a_step_interval(fast_config,
                                                                                                    monkeypatch):
    """train.save_every_minutes=2 on a clock that moves a minute each time the loop reads it (once before the run
    and once per step, once more after each checkpoint): checkpoints at steps 2, 4 and 6; with
    train.save_every_steps=3 as well, at 2, 3, 5 (two minutes after the one at 3) and 6. Every checkpoint resumes
    like any other (the same code writes it)."""
    from rlhf.run import loop

    def run(*overrides: str) -> list[str]:
        minutes = iter(range(1000))
        monkeypatch.setattr(loop, "_clock", lambda: 60.0 * next(minutes))
        train(fast_config("train.max_steps=6", "train.keep_last=null", "train.save_final=false",
                          "train.save_every_minutes=2", *overrides))
        folder = Path(fast_config().output_dir) / checkpoint.FOLDER
        names = sorted(p.name for p in folder.glob("step_*"))
        shutil.rmtree(folder, ignore_errors=True)
        return names

    assert run() == ["step_00000002", "step_00000004", "step_00000006"]
    assert run("train.save_every_steps=3") == ["step_00000002", "step_00000003", "step_00000005", "step_00000006"]
    assert run("train.save_every_minutes=0") == []


def test_a_resume_from_an_older_checkpoint_sets_the_newer_branch_aside(fast_config, tmp_path, caplog):
    """Checkpoints 2 and 4, then a resume from 2 that writes 3 (keep_last=1): step 4 and the metrics after step 2
    go to checkpoints/abandoned-<time>/, so keep_last keeps 3 (not the stale 4) and resume=auto continues 3. A
    branch into another folder leaves the source folder as it is."""
    train(fast_config("train.max_steps=4", "train.save_every_steps=2", "train.keep_last=null"))
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    step_2 = run / checkpoint.FOLDER / "step_00000002"
    shorter = ["train.max_steps=3", "resume_changes=[train.max_steps]", "train.save_every_steps=3", f"resume={step_2}"]
    train(compose_config(*FAST, *shorter, output_dir=tmp_path / "branch"))
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000002", "step_00000004"]
    assert [p.name for p in (run / checkpoint.FOLDER).iterdir() if p.name.startswith("abandoned")] == []
    with caplog.at_level(logging.INFO, logger="rlhf"):
        train(fast_config(*shorter, "train.keep_last=1"))
    (aside,) = (run / checkpoint.FOLDER).glob(f"{run_folder.ABANDONED}*")
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000003"]
    assert checkpoint.resolve("auto", run) == run / checkpoint.FOLDER / "step_00000003"
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_00000004"]
    assert (aside / "metrics.jsonl").read_text().splitlines() == [x for x in lines if json.loads(x)["step"] > 2]
    assert _logged_steps(run) == [0, 1, 2, 3, 3]  # the branch that goes on: its own lines after step 2
    assert _logged_steps(run, checkpoints=True) == [2, 3]
    (said,) = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert "step_00000004" in said and str(aside) in said


def test_a_resume_that_would_change_the_optimization_is_refused_naming_each_key(fast_config, tmp_path):
    """Each change of what shapes the training is refused, naming the key with both values, before the resumed run
    writes anything; what cannot change the optimization may change, and a change listed in resume_changes is
    made."""
    train(fast_config("train.save_every_steps=3"))
    run = tmp_path / "run"
    before = (run / "metrics.jsonl").read_text()
    for overrides, said in [
        (["seed=1", "optimizer.lr=0.01"], ["in 2 keys: optimizer.lr (checkpoint: 0.0001, now: 0.01); seed "
                                           "(checkpoint: 0, now: 1).", "resume_changes=[optimizer.lr,seed]"]),
        (["hardware.mixed_precision=bf16"], ["hardware.mixed_precision (checkpoint: no, now: bf16)"]),
        (["hardware=fsdp"], ["hardware._target_ (checkpoint: rlhf.hardware.DataParallel, now: "
                             "rlhf.hardware.fsdp.FSDP2)", "hardware.num_processes (checkpoint: 1, now: 2)"]),
        (["train.max_steps=4"], ["train.max_steps (checkpoint: 3, now: 4)", "stretches cosine and linear schedules",
                                 f"`python train.py hydra.run.dir={run} resume=auto` alone re-applies"]),
        (["train.max_steps=4", "resume_changes=[train.max_step]"], ["resume_changes lists train.max_step, which is "
                                                                    "not a key", "Did you mean train.max_steps?"]),
    ]:
        with pytest.raises(UserError) as refused:
            train(fast_config("resume=auto", *overrides))
        assert str(refused.value).startswith(f"resume from {run / checkpoint.FOLDER / 'step_00000003'}: ")
        assert all(text in str(refused.value) for text in said), (overrides, str(refused.value))
    assert (run / "metrics.jsonl").read_text() == before and [p.name for p in checkpoint.complete(run)] == [
        "step_00000003"]
    train(fast_config("resume=auto", "train.log_every_steps=2", "train.eval_batch_size=4", "hardware.timeout_s=60",
                      "train.keep_last=5", "train.eval_every_steps=1", "model.tiny.cache_dir=" + str(tmp_path / "c"),
                      "train.max_steps=4", "resume_changes=[train.max_steps]"))
    assert _logged_steps(run)[-2:] == [4, 4]


def test_a_resume_on_other_training_rows_is_refused(tmp_path):
    """The data file changed in place (same config): refused, naming the fingerprints; allowed when listed."""
    rows = tmp_path / "rows.jsonl"

    def write(chosen: str) -> None:
        rows.write_text("".join(json.dumps({"prompt": f"{i:03d}=", "chosen": f"{i:03d}"[::-1] + chosen,
                                            "rejected": "x"}) + "\n" for i in range(80)))

    def config(*overrides: str):
        return compose_config(*FAST, f"data.path={rows}", "train.save_every_steps=3", *overrides,
                              output_dir=tmp_path / "run")

    write("")
    train(config())
    write("!")
    with pytest.raises(UserError, match=r"the tokenized training data differs from the checkpoint's \(tokenized_data "
                                        r"[0-9a-f]{16}, now [0-9a-f]{16}\).*resume_changes=\[tokenized_data\]"):
        train(config("resume=auto"))
    train(config("resume=auto", "train.max_steps=4", "resume_changes=[train.max_steps,tokenized_data]"))
    assert _logged_steps(tmp_path / "run")[-2:] == [4, 4]


def test_an_attempt_killed_before_its_first_checkpoint_is_set_aside_with_one_line(fast_config, tmp_path, caplog):
    """The same command again into the folder of an attempt that logged metrics but saved no checkpoint (here: one
    that ran to its end with save_final off, then lost its summary.json as a kill would): its logs go to
    checkpoints/abandoned-<time>/ and one line says what was found (red before: replaced without a word)."""
    import logging

    cfg = fast_config("train.save_final=false", "train.save_every_minutes=0")
    train(cfg)
    first = (tmp_path / "run" / "metrics.jsonl").read_text()
    (tmp_path / "run" / "summary.json").unlink()
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        train(cfg)
    [aside] = (tmp_path / "run" / "checkpoints").glob("abandoned-*")
    assert (aside / "metrics.jsonl").read_text() == first
    lines = [r.getMessage() for r in caplog.records if "earlier attempt" in r.getMessage()]
    assert lines == [f"this folder holds an earlier attempt that stopped without a checkpoint to resume from at step 3: "
                     f"its logs are set aside in {aside}, and this run starts at step 1"]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0


def test_only_the_runs_own_logs_are_set_aside_and_a_line_cut_by_a_kill_is_read(tmp_path):
    """A kill can cut the last line; the user's own .jsonl data beside the logs stays where it is."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/loss": 1.0}\n{"step": 4, "train/lo')
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "completion": "x"}\n')
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    run_folder.set_aside_earlier_attempt(tmp_path)
    [aside] = (tmp_path / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "samples.jsonl"]
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["pairs.jsonl"]
