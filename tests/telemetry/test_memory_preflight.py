"""The memory preflight (rlhf/telemetry/memory_preflight.py): what sharding divides, the
reference's own bytes, the activation estimate against what autograd really keeps, and the measured peak."""

from __future__ import annotations

import functools

import pytest
import torch

from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy, SharedLayers
from rlhf.ops.completion_logps import completion_stats
from rlhf.telemetry.memory_preflight import (
    MB,
    PeakMemory,
    activation_bytes,
    held_bytes,
    measured_plan,
    unique_tensors,
)


def _tiny(layers: int = 3):
    torch.manual_seed(0)
    return TinySpec(hidden_size=32, num_layers=layers, num_heads=2, intermediate_size=64, warm_start_steps=0).build()


def test_plan_counts_each_part_and_sharding_divides_what_it_shards():
    model = _tiny().model
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    reference = FrozenCopy()(model)
    whole = measured_plan(model, {"reference": reference}, 8.0, frozenset(), processes=2, activations=100)
    assert (whole.weights, whole.gradients, whole.frozen, whole.activations) == (
        weights, sum(p.numel() * 4 for p in model.parameters()), weights, 100)
    assert whole.optimizer == 2 * whole.gradients  # 8 bytes against 4 per parameter
    sharded = measured_plan(model, {"reference": reference}, 8.0, frozenset({"weights", "gradients", "optimizer"}),
                            2, 100)
    assert (sharded.weights, sharded.gradients, sharded.optimizer) == (
        whole.weights // 2, whole.gradients // 2, whole.optimizer // 2)
    zero1 = measured_plan(model, {}, 8.0, frozenset({"optimizer"}), 2, 0)
    assert (zero1.weights, zero1.optimizer, zero1.frozen) == (whole.weights, whole.optimizer // 2, 0)
    assert whole.total == sum([whole.weights, whole.gradients, whole.optimizer, whole.frozen, whole.activations])


def test_shared_layers_count_only_the_layers_the_reference_does_not_share():
    model = _tiny().model
    copy_bytes = measured_plan(model, {"reference": FrozenCopy()(model)}, 0.0, frozenset(), 1, 0).frozen
    all_gradients = measured_plan(model, {}, 0.0, frozenset(), 1, 0).gradients
    shared = SharedLayers(num_shared_layers=2)(model)
    layer_bytes = held_bytes(unique_tensors(model.model.layers[0]))
    assert measured_plan(model, {"reference": shared}, 0.0, frozenset(), 1, 0).frozen == copy_bytes - 2 * layer_bytes
    # frozen layers train no more: no gradient, no optimizer state
    assert measured_plan(model, {}, 8.0, frozenset(), 1, 0).gradients == all_gradients - 2 * layer_bytes


def _saved_bytes(model, batch) -> int:
    """Bytes of the tensors autograd keeps for the backward pass (each storage once, parameters left out)."""
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        completion_stats(model, batch)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in saved.items() if pointer not in parameters)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_is_close_to_what_autograd_keeps(checkpointing):
    policy = _tiny(layers=4)
    model = policy.model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sequences, tokens = 16, 48
    ids = torch.randint(3, 200, (sequences, tokens))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids)}
    kept = _saved_bytes(model, batch)
    estimate = activation_bytes(model.config, sequences, tokens, 4, checkpointing)
    if checkpointing:  # autograd keeps each layer's input; the estimate adds the layer recomputed in the backward
        assert kept < estimate < 4 * kept, (estimate, kept)
    else:
        assert 0.67 * kept < estimate < 1.5 * kept, (estimate, kept)


def test_checkpointing_makes_the_estimate_smaller():
    config = _tiny().model.config
    assert activation_bytes(config, 8, 64, 4, True) < activation_bytes(config, 8, 64, 4, False) / 1.5


def test_peak_memory_sees_a_large_allocation_and_starts_over_for_each_run():
    """64 MB of fresh pages (an anonymous mapping, every page written): a tensor of that size may instead reuse
    pages the C allocator kept resident from earlier tests in this process (glibc raises its mmap threshold after
    large frees), which leaves the resident set, and so the peak, where it was."""
    import mmap

    first = PeakMemory(torch.device("cpu"))
    block = mmap.mmap(-1, 64 * MB)
    for offset in range(0, 64 * MB, mmap.PAGESIZE):
        block[offset] = 1
    assert first.mb() > 60
    block.close()
    second = PeakMemory(torch.device("cpu"))  # a second run in this process does not inherit the first's peak
    assert second.mb() < 30


def test_a_later_sweep_point_counts_what_the_first_paid_once_for_the_process(monkeypatch):
    """Points of an in-process sweep are measured against the size before the first point: memory the first point
    left in the process (64 MB of pages still held, like library code paged in) counts for a later point as it did
    for the first, where a plain run started now does not see it. Red when a sweep point starts from its own size
    (the second point of an in-process sweep read a third of the first's peak)."""
    import mmap

    from rlhf.telemetry import memory_preflight

    monkeypatch.setattr(memory_preflight, "_FIRST_SWEEP_POINT", [])
    first = PeakMemory(torch.device("cpu"), sweep_point=True)
    kept = mmap.mmap(-1, 64 * MB)
    for offset in range(0, 64 * MB, mmap.PAGESIZE):
        kept[offset] = 1
    assert first.mb() > 60
    later = PeakMemory(torch.device("cpu"), sweep_point=True)
    alone = PeakMemory(torch.device("cpu"))
    assert later.mb() > 60 and alone.mb() < 30
    leaked = mmap.mmap(-1, 64 * MB)  # what a later point leaves is not added to the points after it
    for offset in range(0, 64 * MB, mmap.PAGESIZE):
        leaked[offset] = 1
    third = PeakMemory(torch.device("cpu"), sweep_point=True)
    assert 60 < third.mb() < 100
    kept.close()
    leaked.close()


def test_a_strategy_that_stores_bf16_weights_and_a_float32_master_copy_counts_them():
    from rlhf.hardware import ZeRO
    from rlhf.hardware.holding import StoredPrecision
    from rlhf.telemetry.memory_preflight import plan

    precision = ZeRO(stage=3, mixed_precision="bf16").stored_precision()
    assert precision == StoredPrecision(weight_bytes=2, master_bytes=4, optimizer_dtype=torch.float32)
    assert ZeRO(stage=3).stored_precision() == StoredPrecision()
    stored = plan(weights=4000, trainable=1000, gradient_width=4, frozen=0, optimizer_bytes=8.0,
                  sharded=frozenset({"optimizer"}), processes=2, activations=0, precision=precision, parameters=1000)
    assert (stored.weights, stored.gradients, stored.optimizer) == (2000, 2000, (8 + 4) * 1000 // 2)


def test_the_preflight_of_a_run_counts_gradient_checkpointing_as_the_model_has_it():
    import types

    import datasets

    from rlhf.algos.dpo import DPO
    from rlhf.hardware import DataParallel
    from rlhf.run.components import preflight

    policy = _tiny()
    algo = DPO()
    algo.setup(policy.model, policy.tokenizer)
    rows = datasets.Dataset.from_list([algo.tokenize({"prompt": "abcdef=", "chosen": "fedcba", "rejected": "abcdef"},
                                                     policy.tokenizer)] * 4)
    strategy = DataParallel(device="cpu")
    strategy.accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    settings = types.SimpleNamespace(per_device_batch_size=4)  # what the preflight reads of train:
    make_optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    whole = preflight(policy.model, algo, rows, make_optimizer, strategy, settings)
    policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = preflight(policy.model, algo, rows, make_optimizer, strategy, settings)
    # 4 pairs, each one sequence around its shared prompt (algo.shared_prompt): the prompt's first 6 tokens, then
    # each branch: the prompt's last token and 6 + EOS of its answer
    assert algo.shares_prompt and len(rows[0]["chosen_input_ids"]) == 14
    assert whole.activations == activation_bytes(policy.model.config, 4, 6 + 8 + 8, 4, False)
    assert checkpointed.activations < whole.activations and checkpointed.weights == whole.weights


def test_the_preflight_of_an_online_run_counts_prompts_times_completions_with_their_tokens():
    import types

    import datasets

    from rlhf.algos.grpo import GRPO
    from rlhf.hardware import DataParallel
    from rlhf.run.components import preflight

    policy = _tiny()
    algo = GRPO(num_generations=8, steps_per_generation=2, max_completion_length=16)
    algo.setup(policy.model, policy.tokenizer)
    rows = datasets.Dataset.from_list([algo.tokenize({"prompt": "abcdef="}, policy.tokenizer)] * 4)
    strategy = DataParallel(device="cpu")
    strategy.accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    settings = types.SimpleNamespace(per_device_batch_size=4)  # 4 prompts x 8 completions, in 2 micro-batches
    memory = preflight(policy.model, algo, rows, functools.partial(torch.optim.AdamW, lr=1e-3), strategy, settings)
    prompt_tokens = len(rows[0]["prompt_ids"])
    assert memory.activations == activation_bytes(policy.model.config, 16, prompt_tokens + 16, 4, False)


@pytest.mark.parametrize("rows_per_tile", [64, 8])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-products"])
def test_what_the_output_layer_holds_is_what_the_preflight_counts(monkeypatch, bf16, rows_per_tile):
    """The torch operations of the output layer that answers with log-probabilities
    (:class:`~rlhf.ops.linear_logps_torch.LinearLogSoftmaxTorch`, what it runs on a CPU and by default on a GPU), 64
    rows, a [512, 64] weight, float32 products or bfloat16 ones (autocast's) from float32 weights, in one tile or
    eight: the most bytes torch allocated at once over its forward and backward passes is what
    :func:`output_layer_held` predicts, from 0.88 to 1.01 of it. In eight-row tiles, where the weight's gradient is
    most of the peak, red without its float32 accumulator (predicted 0.27 and 0.61 of the peak), as the estimate
    before it was (three float32 tiles: 0.27 and 0.17)."""
    from rlhf.ops import linear_logps_torch
    from rlhf.telemetry.memory_preflight import output_layer_held
    from tests.ops.live_bytes import LiveBytes

    rows, vocab, width = 64, 512, 64
    monkeypatch.setattr(linear_logps_torch, "LINEAR_TILE_BYTES_CPU", rows_per_tile * vocab * 4)
    assert linear_logps_torch.tile_shape(rows, vocab, torch.device("cpu")) == (rows_per_tile, vocab)
    torch.manual_seed(0)
    h = torch.randn(rows, width, requires_grad=True)
    w = (torch.randn(vocab, width) / 8).requires_grad_()
    tokens, g = torch.randint(vocab, (rows,)), torch.randn(rows)
    with LiveBytes() as seen:
        logps = linear_logps_torch.LinearLogSoftmaxTorch.apply(h, w, None, tokens, False, True,
                                                               torch.bfloat16 if bf16 else torch.float32, 1.0)[0]
        (logps * g).sum().backward()
    predicted = output_layer_held(rows, vocab, width, torch.device("cpu"), product_bytes=2 if bf16 else 4,
                                  weight_bytes=4, hidden_bytes=4, trains=True, triton=False)
    assert 0.85 < seen.peak / predicted < 1.1, (seen.peak, predicted)


def test_the_preflight_counts_an_answering_output_layer_in_place_of_the_logits():
    """A tapped output layer (algo.fused_output_layer=true on a CPU): :func:`output_layer_bytes` is
    :func:`output_layer_held` at the model's shapes, and replaces the logits' three float32 values per token in the
    activation estimate; a layer that computes logits answers None."""
    from rlhf.ops.output_layer import tap_output_layer
    from rlhf.telemetry.memory_preflight import output_layer_bytes, output_layer_held

    cpu, untapped, fused = torch.device("cpu"), _tiny().model, _tiny().model
    tap_output_layer(fused, True)
    config = fused.config
    tokens = 2 * 3  # few rows: the backward pass's weight gradient, not the forward's tiles, is the peak
    assert output_layer_bytes(untapped, cpu, tokens, 4) is None
    auto = _tiny().model
    tap_output_layer(auto, "auto")  # answers on a GPU only (rlhf/core/auto_choices.py)
    assert output_layer_bytes(auto, cpu, tokens, 4) is None and output_layer_bytes(auto, torch.device("cuda"), tokens, 4)
    held = output_layer_bytes(fused, cpu, tokens, 2)
    assert held == output_layer_held(tokens, config.vocab_size, config.hidden_size, cpu, 2, 4, 4, True, False)
    assert held > config.vocab_size * config.hidden_size * 4  # the weight's float32 gradient accumulator at least
    fused.get_output_embeddings().weight.requires_grad_(False)  # a frozen output layer keeps no accumulator
    assert output_layer_bytes(fused, cpu, tokens, 2) == held - config.vocab_size * config.hidden_size * 4
    whole = activation_bytes(config, 2, 3, 4, False)
    assert activation_bytes(config, 2, 3, 4, False, output_layer=held) == whole - tokens * 3 * config.vocab_size * 4 + held


def test_a_prediction_above_what_the_process_can_have_names_the_largest_part_and_the_fixes():
    from rlhf.telemetry.memory_preflight import MemoryPlan, check_fits

    plan = MemoryPlan(weights=100 * MB, gradients=100 * MB, optimizer=200 * MB, frozen=0, activations=700 * MB)
    assert check_fits(plan, 100 * MB, 1000 * MB, "the system's available memory", 1, ["a"]) is None  # 1,100 fit
    assert check_fits(plan, 100 * MB, None, "", 1, ["a"]) is None  # unknown: no verdict
    message = check_fits(plan, 100 * MB, 1000 * MB, "the system's available memory", 2, ["fix a", "fix b"])
    assert message == ("memory per process, predicted 1,100.0 MB, is more than this process can have: 600.0 MB "
                       "(100.0 MB held now and 1,000.0 MB more: the system's available memory, shared by 2 "
                       "processes here). The largest part: activations 700.0 MB. Fix, in order: fix a; fix b")


def test_what_this_machine_has_left_is_read_from_the_system():
    from rlhf.telemetry.memory_preflight import available_bytes

    available, where = available_bytes(torch.device("cpu"))
    assert 0 < available < 2**50
    assert where == "the system's available memory" or where.startswith("what the memory limit of cgroup /")


def test_the_cgroups_limit_is_read_in_the_processs_own_cgroup_v1_or_v2(tmp_path):
    from rlhf.telemetry.cgroups import cgroup_left as _cgroup_left

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job_7/step_0\n0::/job_7/step_0\n")
    v1 = tmp_path / "memory" / "job_7" / "step_0"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{8 * 2**30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 * 2**30}\n")
    assert _cgroup_left(str(proc), str(tmp_path)).left == 6 * 2**30  # v1 at the process's own path
    (tmp_path / "memory.max").write_text(f"{4 * 2**30}\n")  # v2 at the mount's root (a container's own cgroup)
    (tmp_path / "memory.current").write_text(f"{3 * 2**30}\n")
    assert _cgroup_left(str(proc), str(tmp_path)).left == 2**30  # the tighter of the two
    (tmp_path / "memory.max").write_text("max\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit, in either's words
    assert _cgroup_left(str(proc), str(tmp_path)) is None


GIB = 2**30
UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 writes for no limit


def _slurm_tree(root, version: int, job_limit: int, job_used: int) -> str:
    """A fake cgroup tree under ``root`` as Slurm lays one out for job 7, step 0, with the limit on the job's cgroup
    only and the process in the step's leaf: cgroup v1's memory controller (``/slurm/uid_0/job_7/step_0/task_0``,
    an unlimited task and step) or v2 (``/system.slice/slurmstepd.scope/job_7/step_0/user/task_0``, ``max`` below
    the job); every level uses what the job uses. Returns the text of ``/proc/self/cgroup``."""
    if version == 1:
        path, base, files = "/slurm/uid_0/job_7/step_0/task_0", root / "memory", (
            "memory.limit_in_bytes", "memory.usage_in_bytes")
        unlimited = UNLIMITED_V1
        line = f"4:memory:{path}\n2:cpu,cpuacct:{path}\n"
    else:
        path, base, files, unlimited = ("/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", root,
                                        ("memory.max", "memory.current"), "max")
        line = f"0::{path}\n"
    parts = path.strip("/").split("/")
    for depth in range(len(parts) + 1):
        folder = base.joinpath(*parts[:depth])
        folder.mkdir(parents=True, exist_ok=True)
        if depth or version == 1:  # v2's root cgroup has no memory.max
            limit = job_limit if parts[depth - 1:depth] == ["job_7"] else unlimited
            (folder / files[0]).write_text(f"{limit}\n")
            (folder / files[1]).write_text(f"{job_used}\n")
    proc = root / "proc_self_cgroup"
    proc.write_text(line)
    return str(proc)


@pytest.mark.parametrize("version", [1, 2])
def test_a_slurm_jobs_limit_is_seen_from_the_task_cgroup_below_it(tmp_path, version):
    """Slurm limits the job's cgroup and runs the process in a leaf below without a limit of its own: the limit is
    found among the ancestors (what is left: 6 GiB less the 1 GiB used). Red when only the process's own cgroup and
    the root are read (None: no limit seen)."""
    from rlhf.telemetry.cgroups import cgroup_left as _cgroup_left

    proc = _slurm_tree(tmp_path, version, job_limit=6 * GIB, job_used=GIB)
    found = _cgroup_left(proc, str(tmp_path))
    job = "/slurm/uid_0/job_7" if version == 1 else "/system.slice/slurmstepd.scope/job_7"
    assert found is not None and (found.left, found.limit, found.path) == (5 * GIB, 6 * GIB, job)
    assert "hydra.launcher.mem_gb" in found.describe() and job in found.describe()
    # page cache the kernel can drop (memory.stat's inactive files, e.g. a dataset read once) is not counted as used
    folder = (tmp_path / "memory" if version == 1 else tmp_path).joinpath(*job.strip("/").split("/"))
    key = "total_inactive_file" if version == 1 else "inactive_file"
    (folder / "memory.stat").write_text(f"anon 1\n{key} {GIB // 2}\nactive_file 5\n")
    assert _cgroup_left(proc, str(tmp_path)).left == 5 * GIB + GIB // 2


@pytest.mark.parametrize("version", [1, 2])
def test_a_slurm_job_whose_limit_leaves_too_little_is_refused_before_its_first_step(monkeypatch, tmp_path, version):
    """The machine has 64 GiB available, the job's cgroup (above the process's) 0.2 MB left of its 6 GiB: the run stops
    before its first step, naming the job's cgroup, its limit and how to ask Slurm for more. Red when the ancestors
    are not read (the node's 64 GiB let it run)."""
    from rlhf import train
    from rlhf.core.errors import UserError
    from rlhf.run import components
    from rlhf.telemetry import cgroups, memory_preflight
    from tests.conftest import FAST, compose_config

    proc = _slurm_tree(tmp_path / "cgroup", version, job_limit=6 * GIB, job_used=6 * GIB - 200 * 2**10)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {128 * 2**20} kB\nMemAvailable: {64 * 2**20} kB\n")
    monkeypatch.setattr(cgroups, "PROC_CGROUP", proc)
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(memory_preflight, "MEMINFO", str(meminfo))
    monkeypatch.setattr(components, "resident_bytes", lambda: 0)  # nothing of the run held yet
    job = "/slurm/uid_0/job_7" if version == 1 else "/system.slice/slurmstepd.scope/job_7"
    with pytest.raises(UserError, match=rf"(?s)is more than this process can have: .* 0\.2 MB more: what the memory "
                                        rf"limit of cgroup {job} leaves: memory\.\w+ 6,144\.0 MB, 6,143\.8 MB in use; "
                                        r"a Slurm job gets more with hydra\.launcher\.mem_gb .*Fix, in order: "):
        train(compose_config(*FAST, "train.max_steps=1", output_dir=tmp_path / "run"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"train/loss"' not in metrics.read_text()  # no step was taken


def _short_of_memory(monkeypatch, megabytes: float = 1.0) -> None:
    from rlhf.run import components

    monkeypatch.setattr(components, "available_bytes", lambda device: (int(megabytes * MB), "faked for the test"))
    monkeypatch.setattr(components, "resident_bytes", lambda: 0)  # nothing of the run held yet


def test_a_run_predicted_not_to_fit_stops_before_its_first_step_with_the_fixes(monkeypatch, tmp_path, caplog):
    """Faked: 1 MB left on this machine. train.memory_check=refuse (the default) stops before any step with the
    largest part and the fixes in order; warn runs and says so; off does not look."""
    import logging
    import math

    from rlhf import train
    from rlhf.core.errors import UserError
    from tests.conftest import FAST, compose_config

    _short_of_memory(monkeypatch)
    run = ("algo=grpo", "algo.max_completion_length=8", "train.max_steps=1")
    with pytest.raises(UserError, match=r"(?s)memory per process, predicted [\d,.]+ MB, is more than this process can "
                                        r"have: .* MB more: faked for the test\)\. The largest part: \w+ [\d,.]+ MB\. "
                                        r"Fix, in order: train.per_device_batch_size=2 train.grad_accumulation_steps=2 "
                                        r"\(the same global batch\); model.gradient_checkpointing=true .*; "
                                        r"algo.max_completion_length=4; a sharded strategy .*"
                                        r"Or train.memory_check=warn to run anyway"):
        train(compose_config(*FAST, *run, output_dir=tmp_path / "refuse"))
    metrics = tmp_path / "refuse" / "metrics.jsonl"
    assert not metrics.exists() or '"train/loss"' not in metrics.read_text()  # no step was taken
    for mode in ("warn", "off"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhf.run.components"):
            out = train(compose_config(*FAST, *run, f"train.memory_check={mode}", output_dir=tmp_path / mode))
        assert math.isfinite(out["train/loss"])
        said = [r.getMessage() for r in caplog.records if "is more than this process can have" in r.getMessage()]
        assert len(said) == (mode == "warn"), said
