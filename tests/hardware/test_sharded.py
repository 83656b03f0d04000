"""Sharded strategies on 2 CPU processes: the partitioning is real (of the policy and of DPO's reference), training
equals DDP, one whole model is saved.

The serial tests share one launch: 2 spawned processes (1 thread each) run every configuration below one after the
other through the loop (``rlhf.run.loop.train``), so the start of a process pair (imports, process group, the first
data: 15-30 s on 2 cores) is paid once instead of per option (each run then takes about 1 s). Each run reports,
from both ranks, the ``hardware:`` line its strategy wrote: what that process holds. ZeRO-3 runs last: DeepSpeed replaces ``torch.nn.functional.linear`` for the rest of the
process (its "memory-efficient linear").

The settings make the comparisons able to fail: DPO with beta=3 from a random init has a gradient norm of ~5, so
clipping at 0.5 is active, and DeepSpeed's own default (clip at 1.0) would also change the result of a run asked
for no clipping; 2 micro-batches per step exercise ``accumulate(sync)``; the cosine warmup schedule changes the lr
every step, so a scheduler that DeepSpeed's optimizer ignored would show; the resumed runs go on for 4 steps and
over an epoch boundary, with dropout on; bf16 runs are compared by their updates, which are far smaller than the
weights.

The same pair also resumes a DDP run, watching every ``torch.load`` of each resume (all weights-only), and runs
DDP, FSDP2 and ZeRO-2 with one rank unable to write from step 2 on (``*_full_disk``, tests/full_disk.py): each
ends on both ranks with the checkpoint-failure message (a UserError, which the pair catches and goes on), so a
hang or a traceback there fails every test of the file. Their cost: about 3.5 s of the pair's time (6 runs of
about 0.6 s).

Every run is DPO, so its reference goes through ``strategy.prepare_frozen``: FSDP2 and ZeRO-3 shard it, and each
line also says what the process holds of it. The ``*_refmodel`` runs (``algo/reference=model``, the ``ddp`` run's
final model: a reference unlike the policy) add about 3.6 s (0.5 s each for DDP and FSDP2, 2.6 s for ZeRO-3).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.hardware import FSDP2, ZeRO, free_port
from rlhf.run import checkpoint
from tests.conftest import FAST, assert_equal_trees, compose_config, fast_initial_model, installed

HAS_DEEPSPEED = installed("deepspeed")  # RLHF_TESTS_REQUIRE_EXTRAS=1 (CI): run, and fail if it is missing
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed not installed: pip install 'rlhf[deepspeed]'")

CLIP = 0.5
COMMON = [*FAST, "data.task.num_eval=17", "algo.beta=3.0", "optimizer=sgd", "train.max_steps=3", "train.global_batch_size=16",
          "hardware.timeout_s=120",  # 4 per device x 2 processes x 2 micro-batches; a stuck collective fails fast
          "train.save_every_steps=2", "optimizer.momentum=0.9"]  # a checkpoint to resume from; optimizer state
RESUMED = "_resumed"  # a run named <run>_resumed continues <run> from its step-2 checkpoint
# Resumed runs go on for 4 steps past their step-2 checkpoint and over the epoch boundary (64 rows, 16 a step: 4
# steps an epoch), with attention dropout on, so that the data position and the random state must come back too.
RESUME = ["train.max_steps=6", "train.keep_last=null", "model.tiny.attention_dropout=0.1"]
ZERO3 = ["hardware=zero3", "hardware.param_persistence_threshold=0"]  # 0: else every parameter stays whole
FULL_DISK = "_full_disk"  # a run <strategy>[_rank<r>]_full_disk: rank r (1 unless named) cannot write from step 2 on


def full_disk(rank: int = 1) -> list[str]:
    """The run's step-1 checkpoint is written; from step 2's last micro-batch (call 3: 2 micro-batches a step) rank
    `rank` cannot write (tests/full_disk.py), so its step-2 checkpoint fails there, in the strategy's real save.
    Rank 0 keeps room to append its metrics and log lines (under 4 kB by then); its first checkpoint file is
    larger (DeepSpeed's model states: the 18,656 parameters alone are 75 kB)."""
    room = 16_384 if rank == 0 else 0
    return ["algo._target_=tests.full_disk.FullDiskFrom", "+algo.call=3", f"+algo.rank={rank}",
            f"+algo.limit_bytes={room}", "train.save_every_steps=1", "train.keep_last=null", "hardware.timeout_s=60"]


FUSED = "_fused"  # a run <strategy>_fused has algo.fused_output_layer=true: it must train as "ddp" does
REF_MODEL = "_refmodel"  # a run <strategy>_refmodel has algo/reference=model: the "ddp" run's final/ (not its policy)

RUNS: dict[str, list[str]] = {  # name -> overrides, in the order they run
    "ddp": ["hardware=cpu_ddp", f"train.max_grad_norm={CLIP}"],
    "ddp_noclip": ["hardware=cpu_ddp", "train.max_grad_norm=null"],
    "fsdp": ["hardware=fsdp", f"train.max_grad_norm={CLIP}"],
    f"ddp{REF_MODEL}": ["hardware=cpu_ddp", f"train.max_grad_norm={CLIP}"],
    f"fsdp{REF_MODEL}": ["hardware=fsdp", f"train.max_grad_norm={CLIP}"],
    "fsdp_long": ["hardware=fsdp", f"train.max_grad_norm={CLIP}", *RESUME],
    "fsdp_long_resumed": ["hardware=fsdp", f"train.max_grad_norm={CLIP}", *RESUME],
    "ddp_bf16": ["hardware=cpu_ddp", "hardware.mixed_precision=bf16", f"train.max_grad_norm={CLIP}"],
    "fsdp_bf16": ["hardware=fsdp", "hardware.mixed_precision=bf16", f"train.max_grad_norm={CLIP}"],
    "ddp_long": ["hardware=cpu_ddp", f"train.max_grad_norm={CLIP}", *RESUME],
    "ddp_long_resumed": ["hardware=cpu_ddp", f"train.max_grad_norm={CLIP}", *RESUME],
    f"ddp{FULL_DISK}": ["hardware=cpu_ddp", *full_disk()],
    f"fsdp{FULL_DISK}": ["hardware=fsdp", *full_disk()],
    # the output layer answers with log-probabilities (rlhf.ops.output_layer); tied embeddings, as the tiny model
    f"ddp{FUSED}": ["hardware=cpu_ddp", f"train.max_grad_norm={CLIP}", "algo.fused_output_layer=true"],
    f"fsdp{FUSED}": ["hardware=fsdp", f"train.max_grad_norm={CLIP}", "algo.fused_output_layer=true"],
}
if HAS_DEEPSPEED:
    RUNS |= {
        "zero1": ["hardware=zero1", f"train.max_grad_norm={CLIP}"],
        "zero2": ["hardware=zero2", f"train.max_grad_norm={CLIP}"],
        "zero2_noclip": ["hardware=zero2", "train.max_grad_norm=null"],
        f"zero2{FULL_DISK}": ["hardware=zero2", *full_disk()],
        f"zero2_rank0{FULL_DISK}": ["hardware=zero2", *full_disk(rank=0)],
        **{f"{stage}_long{end}": [f"hardware={stage}", f"train.max_grad_norm={CLIP}", *RESUME]
           for stage in ("zero1", "zero2") for end in ("", RESUMED)},
        "zero3": [*ZERO3, f"train.max_grad_norm={CLIP}"],
        f"zero3{REF_MODEL}": [*ZERO3, f"train.max_grad_norm={CLIP}"],
        "zero3_long": [*ZERO3, f"train.max_grad_norm={CLIP}", *RESUME],
        "zero3_long_resumed": [*ZERO3, f"train.max_grad_norm={CLIP}", *RESUME],
        "zero3_noclip": [*ZERO3, "train.max_grad_norm=null"],
        f"zero3{FUSED}": [*ZERO3, f"train.max_grad_norm={CLIP}", "algo.fused_output_layer=true"],
        # a checkpoint at the last step: its fp32 master weights show the update that the bf16 final/ rounds away
        "zero3_bf16": [*ZERO3, "hardware.mixed_precision=bf16", f"train.max_grad_norm={CLIP}", "train.save_every_steps=3"],
    }
SHARDED = [name for name in RUNS
           if not name.startswith("ddp") and not name.endswith(("_bf16", "_long", RESUMED, FULL_DISK))]
BF16 = [name for name in RUNS if not name.startswith("ddp") and name.endswith("_bf16")]
RESUMES = [name.removesuffix(RESUMED) for name in RUNS if name.endswith(RESUMED) and not name.startswith("ddp")]
FULL_DISKS = [name for name in RUNS if name.endswith(FULL_DISK)]
HOLDS = re.compile(r"this process holds ([\d,]+) of ([\d,]+) parameter elements")
STEPS = re.compile(r"its optimizer steps ([\d,]+) of ([\d,]+) trainable elements")
REFERENCE = re.compile(r"; reference: this process holds ([\d,]+) of ([\d,]+) frozen parameter elements \(\d+%\), "
                       r"([\d,]+) bytes")


def _number(text: str) -> int:
    return int(text.replace(",", ""))


# --- the launch shared by the serial tests ---------------------------------------------------------------------
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _watching_loads(calls: list[tuple[str, object]]):
    """Every ``torch.load`` in the block, as (the file's name, the ``weights_only`` it was given)."""
    original = torch.load

    def load(f, *args, **kwargs):  # a file by its name, a stream (FSDP2's reads) by its type
        calls.append((Path(f).name if isinstance(f, (str, os.PathLike)) else type(f).__name__,
                      kwargs.get("weights_only")))
        return original(f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "load", load)
        patch.setattr(torch.serialization, "load", load)
        yield


def _run_all(runs: dict[str, dict], env: dict[str, str]) -> dict[str, str]:
    """One rank: train every run in turn; return each run's ``hardware:`` line as this rank logged it, and under
    ``seconds:<run>`` how long the run took, ``error:<run>`` the message that stopped it (a UserError), and
    ``loads:<run>`` its every ``torch.load``."""
    os.environ.update(env)
    from rlhf.core.instantiate import build
    from rlhf.run import folder as run_folder
    from rlhf.run import loop
    from tests import full_disk

    logging.basicConfig(level=logging.WARNING)
    lines = _Lines()
    logger = logging.getLogger("rlhf")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    described = {}
    for name, container in runs.items():
        start, seen = time.perf_counter(), len(lines.messages)
        cfg = OmegaConf.create(container)
        loads: list[tuple[str, object]] = []
        try:
            strategy = build(cfg.hardware)
            with _watching_loads(loads):
                loop.train(cfg, strategy, run_folder.prepare(Path(cfg.output_dir), cfg.get("resume")))
            described[f"share:{name}"] = strategy.frozen_share()  # predicted; the line says what it holds
        except UserError as error:
            described[f"error:{name}"] = str(error)
        finally:
            full_disk.restore()
        described[f"loads:{name}"] = loads
        described[f"seconds:{name}"] = f"{time.perf_counter() - start:.1f}"
        described[f"fused:{name}"] = any(m.startswith("the output layer computes the token log-probabilities")
                                         for m in lines.messages[seen:])
        described[name] = next(m for m in reversed(lines.messages) if m.startswith("hardware:"))
    return described


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[int, dict[str, str]]]:
    """Every run of RUNS on one pair of processes: the runs' root folder and each rank's ``hardware:`` lines."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    root = tmp_path_factory.mktemp("sharded")
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "RLHF_CACHE": str(root / "cache")}
    def resume(name: str) -> list[str]:
        return [f"resume={root / name.removesuffix(RESUMED) / 'checkpoints' / 'step_00000002'}"] if name.endswith(
            RESUMED) else []

    def reference_model(name: str) -> list[str]:  # the ddp run, which runs first, wrote its final/ by then
        return ["algo/reference=model", f"algo.reference.name_or_path={root / 'ddp' / 'final'}"] if name.endswith(
            REF_MODEL) else []

    containers = {name: OmegaConf.to_container(
        compose_config(*COMMON, *overrides, *resume(name), *reference_model(name),
                       f"model.tiny.cache_dir={root / 'cache'}",
                       output_dir=root / name), resolve=True) for name, overrides in RUNS.items()}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="sharded", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=None))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # the children's threads from their first import on
        described = elastic_launch(config, _run_all)(containers, env)
    logging.getLogger(__name__).info("seconds per run (rank 0): %s",
                                     {name: described[0][f"seconds:{name}"] for name in RUNS})
    return root, described


def _model(run: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(run / "final")  # in this process: fresh relative to the workers


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _reference(name: str) -> str:
    """The DDP run that the sharded run `name` must equal."""
    return next((f"ddp{end}" for end in ("_noclip", REF_MODEL) if name.endswith(end)), "ddp")


# --- (a) the partitioning is real ------------------------------------------------------------------------------
@pytest.mark.serial
@pytest.mark.parametrize("name", SHARDED + BF16)
def test_each_process_holds_its_share(name, runs):
    _, described = runs
    for rank in (0, 1):
        line = described[rank][name]
        here, whole = map(_number, HOLDS.search(line).groups())
        assert whole == 18_656, line  # the FAST model (tied embeddings counted once)
        if name.startswith(("fsdp", "zero3")):  # parameters (and with them all the rest) split
            assert 0.45 <= here / whole <= 0.55, line
        else:  # ZeRO-1/2: whole parameters, the optimizer steps (and keeps states for) half of them
            assert here == whole, line
        if name.startswith("zero"):
            stepped, trainable = map(_number, STEPS.search(line).groups())
            assert trainable == whole and 0.45 <= stepped / trainable <= 0.55, line
    for rank in (0, 1):  # DDP claims no sharding: the patterns above cannot match a replica's line
        assert not HOLDS.search(described[rank]["ddp"])


@pytest.mark.serial
@pytest.mark.parametrize("name", ["ddp", f"ddp{REF_MODEL}"] + SHARDED + BF16)
def test_each_process_holds_its_share_of_the_reference(name, runs):
    """FSDP2 and ZeRO-3 shard the DPO reference (algo/reference=copy, or =model) like the policy: each process holds
    half of its parameters; DDP and ZeRO-1/2 a whole copy. The strategy's prediction (frozen_share, for the memory
    preflight) is what the process then holds, and the start-up line says it with the bytes."""
    _, described = runs
    for rank in (0, 1):
        line = described[rank][name]
        here, whole, size = map(_number, REFERENCE.search(line).groups())
        assert whole == 18_656, line
        if name.startswith(("fsdp", "zero3")):
            assert 0.45 <= here / whole <= 0.55, line
        else:
            assert here == whole, line
        assert described[rank][f"share:{name}"] == pytest.approx(here / whole, abs=0.05), line
        # DeepSpeed's bf16 keeps the model in bf16, the reference too; FSDP2 keeps fp32 and computes in bf16
        assert size == here * (2 if name == "zero3_bf16" else 4), line


FIRST_LOSS_TOLERANCE = 1e-6  # relative, float32: sharding may reorder sums (seen: 0.0, bit-identical, on CPU)


@pytest.mark.serial
@pytest.mark.parametrize("name", [name for name in SHARDED if name.startswith(("fsdp", "zero3"))])
def test_a_sharded_reference_gives_the_unsharded_first_step_loss(name, runs):
    """The first step's loss and implicit rewards (which read the reference's log-probabilities) under FSDP2 and
    ZeRO-3, whose reference is sharded, equal DDP's with a whole reference, within float32 rounding. With
    algo/reference=model the reference differs from the policy (the loss is far from log 2), so a reference that
    computed something else would show."""
    root, _ = runs
    first, expected = (next(r for r in _metrics(root / run) if "train/loss" in r) for run in (name, _reference(name)))
    assert first["step"] == expected["step"] == 1
    for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected"):
        assert first[key] == pytest.approx(expected[key], rel=FIRST_LOSS_TOLERANCE, abs=1e-7), key
    if name.endswith(REF_MODEL):
        assert abs(expected["train/loss"] - math.log(2)) > 0.01 and abs(expected["train/rewards/chosen"]) > 0.01


# --- (b) the same training as DDP ------------------------------------------------------------------------------
@pytest.mark.serial
def test_the_comparisons_can_fail(runs):
    """Clipping is active at CLIP and DeepSpeed's default 1.0 would clip too: a wrong mapping would show."""
    root, _ = runs
    norms = [r["train/grad_norm"] for r in _metrics(root / "ddp") if "train/grad_norm" in r]
    assert len(norms) == 3 and min(norms) > 1.0, norms
    clipped, free = _model(root / "ddp"), _model(root / "ddp_noclip")
    assert max((a - b).abs().max() for a, b in zip(clipped.parameters(), free.parameters())) > 1e-3


@pytest.mark.serial
@pytest.mark.parametrize("name", SHARDED)
def test_training_equals_ddp(name, runs):
    root, _ = runs
    reference = _reference(name)
    for a, b in zip(_model(root / reference).parameters(), _model(root / name).parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    ours, theirs = _metrics(root / name), _metrics(root / reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for mine, ref in zip(ours, theirs):
        for key in ("train/loss", "train/lr", "train/grad_norm", "eval/loss", "eval/logps/chosen"):
            if key in ref:  # the norm before clipping, as the strategy reports it (absent without clipping)
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-5), (mine["step"], key)
            else:
                assert key not in mine, (mine["step"], key)


@pytest.mark.serial
def test_the_output_layer_answers_with_log_probabilities_on_every_strategy_and_trains_as_ddp(runs):
    """algo.fused_output_layer=true: the output layer computed the log-probabilities on both ranks (and only where
    asked), inside the layer's own forward, so DDP, FSDP2 and ZeRO-3 (which gather its sharded, tied weight there)
    train as the plain DDP run does."""
    root, described = runs
    fused = [name for name in RUNS if name.endswith(FUSED)]
    assert {"ddp_fused", "fsdp_fused"} <= set(fused)
    for rank in (0, 1):
        assert all(described[rank][f"fused:{name}"] for name in fused), described[rank]
        assert not any(described[rank][f"fused:{name}"] for name in RUNS if name not in fused)
    for name in fused:
        for a, b in zip(_model(root / "ddp").parameters(), _model(root / name).parameters(), strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        for mine, ref in zip(_metrics(root / name), _metrics(root / "ddp"), strict=True):
            for key in ("train/loss", "train/grad_norm", "eval/loss", "eval/logps/chosen", "eval/exact_match"):
                if key in ref:
                    assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-5), (name, mine["step"], key)


# --- (d) exact resume from each rank's shards ------------------------------------------------------------------
SHARDS = {"fsdp": "sharded/*.distcp", "zero": "zero/state/*optim_states.pt"}  # one file per rank


def _optimizer_state(folder: Path, tmp_path: Path) -> dict:
    """The optimizer state a checkpoint holds, gathered from every rank's file, as plain tensors and values."""
    if (folder / "sharded").is_dir():  # FSDP2: torch.distributed.checkpoint, read without a process group
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = tmp_path / f"{folder.parent.parent.name}.pt"
        dcp_to_torch_save(folder / "sharded", whole)
        return torch.load(whole, weights_only=True)["optimizer"]
    from rlhf.hardware.zero_files import WeightsOnlyEngine  # DeepSpeed's files, read as a resume reads them

    return {f.name: WeightsOnlyEngine().load(str(f))["optimizer_state_dict"]
            for f in sorted((folder / "zero" / "state").glob("*optim_states.pt"))}


def _without_timings(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if not k.startswith("perf/")}


def _without_timing_lines(lines: list[dict]) -> list[dict]:
    """Each line without perf/*; a line of timings only (a checkpoint's perf/checkpoint_time_s) left out."""
    return [line for line in map(_without_timings, lines) if set(line) != {"step"}]


@pytest.mark.serial
@pytest.mark.parametrize("name", RESUMES)
def test_resume_from_the_shards_equals_the_uninterrupted_run(name, runs, tmp_path):
    """<name>_resumed loaded <name>'s step-2 checkpoint (each rank its shards of the model and of SGD's momentum)
    and trained steps 3-6, into the second epoch, with attention dropout on: the same parameters, optimizer state,
    per-rank state (data position, random generators) and metrics as the uninterrupted run, bit for bit."""
    root, _ = runs
    whole, resumed = root / name, root / (name + RESUMED)
    assert len(list((whole / "checkpoints" / "step_00000002").glob(SHARDS[name[:4]]))) == 2
    for a, b in zip(_model(whole).parameters(), _model(resumed).parameters(), strict=True):
        assert torch.equal(a, b)
    last = Path("checkpoints") / "step_00000006"
    assert_equal_trees(_optimizer_state(whole / last, tmp_path), _optimizer_state(resumed / last, tmp_path),
                        "optimizer")
    for rank in (0, 1):
        x, y = (torch.load(run / last / f"rank_{rank}.pt", weights_only=True) for run in (whole, resumed))
        for entry in (x, y):
            entry["rng"].pop("python")  # tuples of ints, compared below
            entry["train"]["last"] = _without_timings(entry["train"]["last"])
        assert (x["train"]["epoch"], x["train"]["batch_in_epoch"]) == (1, 4)  # 8 micro-batches an epoch, 2 a step
        assert_equal_trees(x, y, f"rank_{rank}.pt")
    ours = _without_timing_lines(_metrics(resumed))
    assert [r["step"] for r in ours] == [3, 4, 5, 6, 6]  # train lines, the final evaluation; nothing before 3
    assert ours == [r for r in _without_timing_lines(_metrics(whole)) if r["step"] >= 3]


# A strategy's own files: DDP's optimizer, FSDP2's non-tensor entries (the optimizer's hyperparameters, pickled;
# torch's planner reads them with weights_only=False), DeepSpeed's optimizer partitions (DeepSpeed's engine too).
OWN_FILES = {"ddp": "optimizer.pt", "fsdp": "BytesIO", "zero": "optim_states.pt"}


@pytest.mark.serial
@pytest.mark.parametrize("name", [name for name in RUNS if name.endswith(RESUMED)])
def test_a_resume_reads_every_file_weights_only(name, runs):
    """Every torch.load of a resumed run, on each rank, DeepSpeed's own included (rlhf's checkpoint engine), passes
    weights_only=True: loading a checkpoint runs no code. The strategy's own files are among those watched."""
    _, described = runs
    own = next(file for prefix, file in OWN_FILES.items() if name.startswith(prefix))
    for rank in (0, 1):
        loads = described[rank][f"loads:{name}"]
        assert {f"rank_{rank}.pt", "scheduler.pt"} <= {file for file, _ in loads}, loads
        assert any(own in file for file, _ in loads), loads
        assert [(file, flag) for file, flag in loads if flag is not True] == [], loads


# --- (e) a write that fails on one rank --------------------------------------------------------------------------
@pytest.mark.serial
@pytest.mark.parametrize("name", FULL_DISKS)
def test_a_write_that_fails_on_one_rank_stops_every_rank_with_the_message_and_keeps_the_checkpoints(name, runs):
    """Rank r cannot write during the step-2 checkpoint (inside DDP's, FSDP2's or DeepSpeed's real save): every
    rank ends with the one-process message (no hang, no traceback), the failing rank naming its error; step 1's
    checkpoint and the metrics up to step 2 are kept, the partial one is removed, no final/ is written."""
    root, described = runs
    run, failing = root / name, 0 if "_rank0" in name else 1
    for rank in (0, 1):
        message = described[rank].get(f"error:{name}")
        assert message is not None, f"rank {rank} did not stop"
        assert re.fullmatch(rf"could not write the checkpoint of step 2 in {re.escape(str(run / 'checkpoints'))} "
                            r"\(.+\); the previous checkpoints and the metrics are kept\. Fix: free disk space \(or "
                            r"lower train\.keep_last\), then resume=auto\.", message, re.S), message
    assert "on another rank" not in described[failing][f"error:{name}"]
    assert [p.name for p in checkpoint.complete(run)] == ["step_00000001"]
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial one is gone
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 2
    assert not (run / "final").exists()


# --- (c) one whole model that loads anywhere -------------------------------------------------------------------
@pytest.mark.serial
@pytest.mark.parametrize("name", SHARDED)
def test_final_model_is_whole_and_computes_what_ddp_computes(name, runs):
    root, _ = runs
    model, reference = _model(root / name), _model(root / _reference(name))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters()) == 18_656
    assert sorted(p.name for p in (root / name / "final").glob("*.safetensors")) == ["model.safetensors"]
    from safetensors import safe_open

    def stored(run: str) -> list[str]:  # the tensors final/ stores: a tied output layer once (red before: FSDP2)
        with safe_open(root / run / "final" / "model.safetensors", "pt") as f:
            return sorted(f.keys())

    assert stored(name) == stored(_reference(name)) and "lm_head.weight" not in stored(name)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    # The run's own last evaluation (computed by the sharded model in the workers) is DDP's too.
    final, expected = (json.loads((root / n / "summary.json").read_text())["final"] for n in (name, _reference(name)))
    for key in ("eval/loss", "eval/logps/chosen", "eval/logps/rejected", "eval/rewards/margins"):
        # abs 1e-5: rewards are beta x differences of float32 log-probs of about -40 (seen: up to 3e-6)
        assert final[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key


@pytest.mark.serial
@pytest.mark.parametrize("name", BF16)
def test_bf16_trains_like_ddp_with_autocast(name, runs):
    """bf16 on CPU processes too: FSDP2's MixedPrecisionPolicy and DeepSpeed's bf16 against Accelerate's autocast.

    Not bit-equal (different rounding points), and the whole movement of the weights in 3 steps is about 1e-4 per
    element, so the updates (final minus initial) are compared, relatively, tensor by tensor. FSDP2 keeps (and
    saves) fp32 parameters. DeepSpeed keeps the model in bf16: its fp32 master weights (read from the step-3
    checkpoint) start from the initial weights rounded to bf16, and final/ holds them rounded to bf16 again.
    Seen: at most 3.0% (FSDP2) and 2.6% (ZeRO-3) of a tensor's update; the gate is 10%."""
    root, _ = runs
    model, reference = _model(root / name), _model(root / "ddp_bf16")
    assert model.dtype == (torch.float32 if name.startswith("fsdp") else torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 18_656
    initial = {k: v.detach() for k, v in fast_initial_model().named_parameters()}
    start = initial  # where the compared run's parameters start
    if name.startswith("fsdp"):
        trained = dict(model.named_parameters())
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        trained = get_fp32_state_dict_from_zero_checkpoint(
            str(root / name / "checkpoints" / "step_00000003" / "zero"), tag="state")
        for key, saved in model.named_parameters():
            assert torch.equal(saved, trained[key].to(torch.bfloat16)), key  # final/ = the master weights in bf16
        start = {k: v.to(torch.bfloat16).float() for k, v in initial.items()}
    for key, ref in reference.named_parameters():
        expected, update = ref.detach() - initial[key], trained[key].detach().float() - start[key]
        assert expected.norm() > 0, key
        error = float((update - expected).norm() / expected.norm())
        assert error < 0.1, f"{key}: the update differs from DDP's by {error:.1%}"
    final, expected = (json.loads((root / n / "summary.json").read_text())["final"] for n in (name, "ddp_bf16"))
    for key in ("eval/loss", "eval/logps/chosen", "eval/logps/rejected"):
        assert final[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-3), key


# --- options and refusals, no processes ------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["fsdp", "zero1", "zero2", "zero3"])
def test_options_build_and_start_two_cpu_processes_without_gpu(option):
    if option.startswith("zero") and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed not installed")
    strategy = build(compose_config(f"hardware={option}").hardware)
    assert isinstance(strategy, FSDP2 if option == "fsdp" else ZeRO)
    if not torch.cuda.is_available():
        assert strategy.processes_per_node() == 2  # num_processes: null means 2 on a machine without GPU
    assert build(compose_config(f"hardware={option}", "hardware.num_processes=3").hardware).processes_per_node() == 3


@pytest.mark.parametrize("option, share", [("cpu_ddp", 1.0), ("fsdp", 0.5), ("zero1", 1.0), ("zero2", 1.0),
                                           ("zero3", 0.5)])
def test_each_option_predicts_the_share_of_a_frozen_model_each_process_holds(option, share):
    if option.startswith("zero") and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed not installed")
    assert build(compose_config(f"hardware={option}", "hardware.num_processes=2").hardware).frozen_share() == share
    if share < 1:
        assert build(compose_config(f"hardware={option}", "hardware.num_processes=4").hardware).frozen_share() == 0.25


@needs_deepspeed
def test_deepspeed_config_follows_the_loop():
    strategy = build(compose_config("hardware=zero3", "train.max_grad_norm=0.25").hardware)
    settings = strategy.deepspeed_settings(micro_batch_size=4)
    assert settings["gradient_clipping"] == 0.25
    assert settings["gradient_accumulation_steps"] == 1  # the loop accumulates and divides the loss itself
    assert settings["train_micro_batch_size_per_gpu"] == 4 and settings["zero_allow_untested_optimizer"]
    assert settings["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 100_000}
    unclipped = build(compose_config("hardware=zero2", "train.max_grad_norm=null").hardware)
    assert unclipped.deepspeed_settings(4)["gradient_clipping"] == 0.0  # not DeepSpeed's default 1.0
    assert "stage3_param_persistence_threshold" not in unclipped.deepspeed_settings(4)["zero_optimization"]
    extra = ZeRO(stage=2, deepspeed_config={"zero_optimization": {"overlap_comm": True}, "bf16": {"enabled": True}})
    assert extra.deepspeed_settings(4)["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert extra.deepspeed_settings(4)["bf16"] == {"enabled": True}
    with pytest.raises(UserError, match="train.max_grad_norm=1.0 but hardware.max_grad_norm=0.25"):
        strategy.clip_gradients(model=None, max_grad_norm=1.0)


@needs_deepspeed
def test_zero_refuses_a_deepspeed_checkpoint_engine_other_than_its_own():
    """A checkpoint writer chosen in deepspeed_config would load with weights_only=False and could strand the ranks
    on a failed write: refused with the fix (the engine DeepSpeed builds by default is replaced)."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from rlhf.hardware.zero_files import WeightsOnlyEngine

    with pytest.raises(UserError, match=r"selects DeepSpeed's object for checkpoints.* Fix: leave the checkpoint"):
        ZeRO._use_own_checkpoint_engine(SimpleNamespace(checkpoint_engine=object(), _config=None))
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine(), _config=None)
    ZeRO._use_own_checkpoint_engine(engine)
    assert isinstance(engine.checkpoint_engine, WeightsOnlyEngine)


def test_zero_without_deepspeed_says_how_to_install_it(monkeypatch):
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    with pytest.raises(UserError, match=r"hardware=zero3 needs DeepSpeed.*pip install 'rlhf\[deepspeed\]'"):
        build(compose_config("hardware=zero3").hardware)
    from rlhf.hardware.zero import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails
    with pytest.raises(UserError, match=r"needs DeepSpeed.*pip install 'rlhf\[deepspeed\]'"):
        import_deepspeed(cuda=False)


def test_impossible_sharded_settings_are_clear_errors():
    with pytest.raises(UserError, match="mixed_precision=fp16 is not supported"):
        FSDP2(device="cpu", mixed_precision="fp16")
    if HAS_DEEPSPEED:
        with pytest.raises(UserError, match="hardware.stage=4"):
            ZeRO(stage=4)
        for fp16 in ({"mixed_precision": "fp16"}, {"deepspeed_config": {"fp16": {"enabled": True}}}):
            with pytest.raises(UserError, match="fp16.* is not supported"):
                ZeRO(stage=2, **fp16)



def test_fsdp_on_one_process_shards_over_a_group_of_one_and_trains_as_one_process_does(tmp_path):
    """hardware=fsdp hardware.num_processes=1 (the sharded path on a single GPU): the losses and log-probabilities
    of hardware=cpu, step for step (red while one process was refused)."""
    import json

    from rlhf import train
    from tests.conftest import FAST, compose_config

    common = [*FAST, "algo=dpo", "train.max_steps=3", "train.log_every_steps=1", "train.eval_at_start=false",
              "train.eval_every_steps=0", "train.save_final=false"]
    logged = {}
    for name, hardware in (("plain", ["hardware=cpu"]), ("fsdp", ["hardware=fsdp", "hardware.num_processes=1"])):
        train(compose_config(*common, *hardware, output_dir=tmp_path / name))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logged[name] = [v for r in rows if "train/loss" in r for v in (r["train/loss"], r["train/logps/chosen"])]
    assert len(logged["plain"]) == 6
    assert logged["fsdp"] == pytest.approx(logged["plain"], rel=1e-6)
