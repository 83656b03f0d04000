"""One process or several (DDP): the same optimization, the same evaluation, one run folder.

Tests marked ``serial`` start processes; they run alone, after the parallel tests (README's test command).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rlhf import train
from rlhf.core.errors import UserError
from rlhf.hardware import DataParallel, base, cpus, cpus_available, free_port
from rlhf.hardware import precision as precisions
from rlhf.hardware.precision import resolve_precision
from tests.conftest import FAST, ROOT, compose_config, fast_initial_model


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _params(run: Path) -> list[torch.Tensor]:
    return [p.detach() for p in AutoModelForCausalLM.from_pretrained(run / "final").parameters()]


def test_threads_never_exceed_the_cpus_of_the_job(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")  # what Slurm gave the job, whatever the node has
    assert cpus_available() == 4
    assert DataParallel(device="cpu").threads(local_processes=2) == 2
    assert DataParallel(device="cpu").threads(local_processes=8) == 1
    assert DataParallel(device="cpu", threads_per_process=3).threads(local_processes=2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the user (or a test runner): respected
    assert DataParallel(device="cpu").threads(local_processes=1) == 1
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 0.0)  # an idle machine
    assert DataParallel(device="cpu").threads(local_processes=1) == len(os.sched_getaffinity(0))


def test_cpus_busy_with_other_work_are_left_out_and_the_start_up_line_says_so(monkeypatch):
    """2 CPUs of which other work keeps ~2 busy: 1 thread, not 2 (measured 9x faster there: docs/threads/2026-11-27-busy-machine.md);
    16 CPUs, 2 processes, 4 busy: 6 each. An idle machine, an explicit choice, OMP_NUM_THREADS and a Slurm job are
    left as they were; the start-up line says what was left out (red before: 2 threads whatever the load)."""
    for name in ("OMP_NUM_THREADS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 1.8)
    strategy = DataParallel(device="cpu")
    assert strategy.threads(local_processes=1) == 1
    assert strategy._threads_why == (" (1.8 of the 2 CPUs were busy with other work as the run started: 1 thread(s) a "
                                     "process, not 2; hardware.threads_per_process sets it)")
    assert DataParallel(device="cpu", threads_per_process=2).threads(local_processes=1) == 2
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 0.3)  # background noise: rounds to 0
    assert DataParallel(device="cpu").threads(local_processes=1) == 2
    monkeypatch.setattr(cpus, "cpus_available", lambda: 16)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 4.2)
    assert DataParallel(device="cpu").threads(local_processes=2) == 6
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # the allocation's CPUs are the job's own
    assert DataParallel(device="cpu").threads(local_processes=2) == 8
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert DataParallel(device="cpu").threads(local_processes=2) == 3
    monkeypatch.setenv(cpus.THREADS_WHY, " (the launcher's reason)")  # a rank started by rlhf.launch.processes: its reason
    ranked = DataParallel(device="cpu")
    assert ranked.threads(local_processes=2) == 3 and ranked._threads_why == " (the launcher's reason)"


def test_busy_cpus_counts_a_cpu_kept_busy():
    """A busy loop pinned to one of this process's CPUs, this process's measurement restricted to that CPU: it is
    counted busy (Linux's /proc/stat), whatever else runs there (other work only adds to the count); on that CPU
    and one more, it still counts at least that one, and at most the two."""
    mine = sorted(os.sched_getaffinity(0))
    cpu = mine[-1]
    loop = subprocess.Popen([sys.executable, "-c", "import os, sys\n"
                             f"os.sched_setaffinity(0, {{{cpu}}})\nprint('spinning', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert loop.stdout.readline() == "spinning\n"
        try:
            os.sched_setaffinity(0, {cpu})
            alone = cpus.busy_cpus()
            os.sched_setaffinity(0, set(mine[-2:]))
            beside = cpus.busy_cpus()
        finally:
            os.sched_setaffinity(0, mine)
    finally:
        loop.kill()
        loop.wait()
    assert alone is not None and 0.75 <= alone <= 1 + 1e-6
    assert beside is not None and 0.75 <= beside <= len(mine[-2:]) + 1e-6


def test_auto_precision_is_bf16_where_the_hardware_has_bf16_matrix_units(monkeypatch):
    """hardware=auto's default: bf16 autocast on an Ampere-or-later GPU and on a CPU with bf16 matrix instructions
    (AVX-512 BF16, AMX), float32 on an older GPU and on a CPU without them; an explicit choice is kept everywhere,
    and the log says what auto meant."""
    for cpu_bf16, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(precisions, "cpu_has_bf16_matmul", lambda v=cpu_bf16: v)
        strategy = DataParallel(device="cpu", mixed_precision="auto")
        assert strategy.mixed_precision == expected
        assert strategy._precision_why == f" (auto: a CPU {'with' if cpu_bf16 else 'without'} bf16 matrix units)"
        assert DataParallel(device="cpu", mixed_precision="no").mixed_precision == "no"
        assert DataParallel(device="cpu", mixed_precision="no")._precision_why == ""
    assert resolve_precision("bf16", cuda=False) == "bf16" and resolve_precision("no", cuda=True) == "no"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, expected in (((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "no")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert DataParallel(device="auto", mixed_precision="auto").mixed_precision == expected
        assert DataParallel(device="cpu", mixed_precision="auto").mixed_precision == "no"  # the CPU's (patched: no)


def test_the_cpu_bf16_check_reads_torchs_own_checks(monkeypatch):
    """AVX-512 BF16 or AMX tiles: either is enough; a torch without the checks (or one that fails) means no."""
    for avx512_bf16, amx, expected in ((True, False, True), (False, True, True), (False, False, False)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert precisions.cpu_has_bf16_matmul() is expected
    def broken():
        raise RuntimeError("not compiled with CPU capability checks")

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", broken)
    assert precisions.cpu_has_bf16_matmul() is False
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert precisions.cpu_has_bf16_matmul() is False


def test_impossible_hardware_settings_are_clear_errors():
    with pytest.raises(UserError, match="hardware.device='tpu'"):
        DataParallel(device="tpu")
    with pytest.raises(UserError, match=r"hardware.mixed_precision=fp16 is not supported .* Fix: hardware.mixed_precision=bf16"):
        DataParallel(device="cuda", mixed_precision="fp16")  # built from Python: refused as from a config
    with pytest.raises(UserError, match="rdzv_endpoint"):
        DataParallel(num_nodes=2)
    with pytest.raises(UserError, match="node_rank=2"):
        DataParallel(num_nodes=2, node_rank=2, rdzv_endpoint="127.0.0.1:1")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees no GPU"):
            DataParallel(device="cuda").start()


def test_each_train_call_in_one_process_gets_the_hardware_it_asks_for(tmp_path, caplog, monkeypatch):
    """The precision the model's forward actually runs in (autocast, as Accelerate wraps it), not the echo of the
    config in the log, for calls of train() one after another in one process. SFT: the policy is the only model."""
    seen: list[tuple[bool, torch.dtype]] = []
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    caplog.set_level(logging.INFO, logger="rlhf")
    for precision in ("no", "bf16", "no"):
        seen.clear()
        train(compose_config(*FAST, "algo=sft", f"hardware.mixed_precision={precision}",
                             output_dir=tmp_path / precision))
        line = next(r.message for r in reversed(caplog.records) if r.message.startswith("hardware:"))
        words = "no mixed precision" if precision == "no" else (
            f"{precision} mixed precision (on a CPU, bf16 results depend on the thread count: "
            f"hardware.threads_per_process={torch.get_num_threads()} repeats them)")
        assert line.endswith(words) and "1 process(es) (one process) on cpu" in line, line  # no Accelerate enum (NO)
        assert seen, "the model's forward never ran"
        expected = (True, torch.bfloat16) if precision == "bf16" else False
        assert {(enabled, dtype) if enabled else False for enabled, dtype in seen} == {expected}, precision


def test_the_dpo_reference_goes_through_prepare_frozen_and_runs_in_the_policys_precision(tmp_path, monkeypatch):
    """The reference is prepared by the strategy (strategy.prepare_frozen): frozen, in eval mode, and under the
    same autocast as the policy; both models' forwards are seen, as two objects."""
    seen: dict[int, set] = {}
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
        seen.setdefault(id(self), set()).add((autocast, self.training, any(p.requires_grad for p in self.parameters())))
        return forward(self, *args, **kwargs)

    prepared = []
    prepare_frozen = DataParallel.prepare_frozen
    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    monkeypatch.setattr(DataParallel, "prepare_frozen", lambda self, m, **kw: prepared.append(m) or prepare_frozen(self, m, **kw))
    train(compose_config(*FAST, "algo=dpo", "hardware.mixed_precision=bf16", "train.eval_at_start=false",
                         output_dir=tmp_path))
    assert len(prepared) == 1 and id(prepared[0]) in seen, "the reference did not go through prepare_frozen"
    assert seen.pop(id(prepared[0])) == {(torch.bfloat16, False, False)}  # the reference: bf16, eval, frozen
    stored = {name: p.dtype for name, p in prepared[0].named_parameters()}  # its linear weights kept in bf16
    assert stored["model.layers.0.self_attn.q_proj.weight"] == stored["model.layers.0.mlp.down_proj.weight"] \
        == torch.bfloat16
    assert stored["model.embed_tokens.weight"] == stored["model.norm.weight"] == torch.float32  # the tied head too
    (policy,) = seen.values()
    assert {autocast for autocast, _, _ in policy} == {torch.bfloat16}
    assert (torch.bfloat16, True, True) in policy  # it trained

def test_compile_runs_the_compiled_policy_and_reference_and_trains_as_eager_does(tmp_path, monkeypatch):
    """hardware.compile=true: both models are compiled in place with torch's default backend, inductor (the
    compiler's graphs are made, a checkpoint's keys are the eager model's) and the run's losses match the eager
    run's to float32 rounding."""
    from torch._dynamo.utils import counters

    compiled = []
    compile_module = torch.nn.Module.compile

    def recorded(self, **options):
        compiled.append((type(self), options))
        return compile_module(self, **options)

    monkeypatch.setattr(torch.nn.Module, "compile", recorded)
    counters.clear()
    runs = {}
    for setting in ("false", "true"):
        runs[setting] = tmp_path / setting
        train(compose_config(*FAST, "algo=dpo", f"hardware.compile={setting}", "train.eval_at_start=false",
                             output_dir=runs[setting]))
    assert compiled == [(LlamaForCausalLM, {})] * 2  # the policy and the reference, torch's default backend
    assert counters["stats"]["unique_graphs"] > 0  # the compiler ran
    eager, fast = (_lines(runs[s]) for s in ("false", "true"))
    losses = [[line["train/loss"] for line in lines if "train/loss" in line] for lines in (eager, fast)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    for a, b in zip(_params(runs["false"]), _params(runs["true"])):  # loaded by key from the saved final model
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(UserError, match="hardware.compile=true is not built for FSDP2"):
        from rlhf.hardware.fsdp import FSDP2

        FSDP2(device="cpu", compile=True)


# --- several processes ---------------------------------------------------------------------------------------
# The keys compared at the end of the run, per algorithm. GRPO on the random-init FAST model: a graded reward (the
# exact match is 0 everywhere), the same prompts and the same sampling seeds on 2 processes as on 1.
ALGOS = {"sft": ([], ("train/loss", "eval/loss", "eval/exact_match")),
         "dpo": ([], ("train/loss", "eval/loss", "eval/exact_match")),
         "grpo": (["algo/reward_funcs=similarity", "algo.num_generations=4", "algo.max_completion_length=8",
                   "hardware.timeout_s=60"], ("train/loss", "train/reward", "eval/reward", "eval/completions/mean_length"))}


@pytest.mark.serial
@pytest.mark.parametrize("algo", list(ALGOS))
def test_two_processes_equal_one_process_with_accumulation(algo, tmp_path):
    """2 processes x 1 micro-batch and 1 process x 2 micro-batches: the same data, steps and evaluation."""
    extra, keys = ALGOS[algo]
    common = [*FAST, f"algo={algo}", *extra, "optimizer=sgd", "train.max_steps=4", "train.global_batch_size=8",
              "data.task.num_eval=15", "train.eval_batch_size=4"]  # 15 rows: the shards are 8 and 7 rows
    one = train(compose_config(*common, "hardware=cpu", output_dir=tmp_path / "one"))
    two = train(compose_config(*common, "hardware=cpu_ddp", output_dir=tmp_path / "two"))
    for a, b in zip(_params(tmp_path / "one"), _params(tmp_path / "two")):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    start_one, start_two = _lines(tmp_path / "one")[0], _lines(tmp_path / "two")[0]
    assert start_one["step"] == start_two["step"] == 0
    for key, value in start_one.items():  # evaluation on 2 processes = on 1 (no padded row counted twice)
        assert start_two[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for key in keys:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    log = (tmp_path / "two" / "train.log").read_text()
    assert "2 process(es)" in log and "global batch 8 = 4 per device x 2 process(es) x 1 accumulation" in log


def _cli(*args: str, cwd: Path, launcher: list[str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0"}
    command = [*(launcher or [sys.executable]), str(ROOT / "train.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.serial
def test_compile_under_ddp_trains_as_eager_ddp_does(tmp_path, monkeypatch):
    """hardware=cpu_ddp hardware.compile=aot_eager: each rank compiles its models (dynamo's graphs in every rank:
    the counters each rank reports) and the two processes train as eager DDP does, to float32 rounding. The backend
    is aot_eager: inductor's code generation is torch's own, tested on one process above, and would take 3 minutes
    here."""
    common = [*FAST, "algo=dpo", "hardware=cpu_ddp", "train.eval_at_start=false", "train.max_steps=3"]
    train(compose_config(*common, output_dir=tmp_path / "eager"))
    train(compose_config(*common, "hardware.compile=aot_eager", output_dir=tmp_path / "compiled"))
    assert "2 process(es) (DataParallel, DDP over CPUs)" in (tmp_path / "compiled" / "train.log").read_text()
    assert "models compiled (torch.compile)" in (tmp_path / "compiled" / "train.log").read_text()
    losses = [[line["train/loss"] for line in _lines(tmp_path / run) if "train/loss" in line]
              for run in ("eager", "compiled")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    for a, b in zip(_params(tmp_path / "eager"), _params(tmp_path / "compiled")):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.serial
def test_torchrun_with_default_hardware_is_real_ddp_in_one_run_folder(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-backend", "c10d"]
    out = _cli(*FAST, cwd=tmp_path, launcher=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl")]
    assert len(runs) == 1, runs
    folders = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert folders == runs, "every rank must use the one run folder"
    steps = [r["step"] for r in _lines(runs[0]) if "train/loss" in r]
    assert steps == [1, 2, 3]  # one line per step: not two copies training side by side
    log = (runs[0] / "train.log").read_text()
    assert "2 process(es) (DataParallel, DDP over CPUs)" in log and "global batch 8 = 4 per device x 2" in log
    assert log.count("run dir:") == 1


@pytest.mark.serial
def test_two_machines_simulated_on_loopback(tmp_path):
    """Two "machines" of one process each train as one process with 2 accumulation steps does (the same global
    batch of 8): their gradients are averaged over the network, not each machine training alone."""
    run_dir = tmp_path / "run"
    common = [*FAST, "optimizer=sgd", "scheduler=constant", "scheduler.num_warmup_steps=0", "train.global_batch_size=8"]
    args = [*common, "hardware=multinode", "hardware.device=cpu", "hardware.num_processes=1",
            "hardware.mixed_precision=no",  # float32, as hardware=cpu below (auto: bf16 on a CPU that has it)
            f"hardware.rdzv_endpoint=127.0.0.1:{free_port()}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    machines = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hardware.node_rank={rank}"],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in (0, 1)]
    outputs = [m.communicate(timeout=300) for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "2 process(es)" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in _lines(run_dir) if "train/loss" in r] == [1, 2, 3]
    train(compose_config(*common, "hardware=cpu", output_dir=tmp_path / "one"))
    initial = fast_initial_model()
    two, one = _params(run_dir), _params(tmp_path / "one")
    assert max(float((a - b).abs().max()) for a, b in zip(one, initial.parameters())) > 1e-3  # it trained
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


@pytest.mark.serial
def test_a_failing_rank_reports_its_own_error(tmp_path):
    out = _cli(*FAST, "hardware=cpu_ddp", "data.path=no_such_file.jsonl", f"hydra.run.dir={tmp_path / 'run'}",
               cwd=tmp_path)
    assert out.returncode == 1
    assert "data.path=no_such_file.jsonl: no such file" in out.stderr
    assert "Traceback" not in out.stderr.split("error: ")[-1]


@pytest.mark.serial
def test_two_slurm_nodes_simulated_on_loopback_find_each_other_from_slurms_environment(tmp_path):
    """What each node's task of `python train.py -m launcher=slurm hardware=multinode hardware.num_nodes=2` does,
    simulated on 127.0.0.1: the same command on both "nodes", with only Slurm's variables differing (SLURM_NODEID).
    They derive their ranks and the rendezvous (the job's first host, a port from the job id), train as one run,
    and only the first node writes the run folder's log."""
    run_dir = tmp_path / "run"
    port = free_port()
    while not 20000 <= port < 60000:
        port = free_port()
    job_id = port - 20000  # rlhf.launch.slurm.port_for_job(job_id) == port: a port known to be free
    args = [*FAST, "hardware=multinode", "hardware.device=cpu", "hardware.num_processes=1", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SUBMITIT_EXECUTOR": "slurm",
           "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "localhost"}
    env.pop("NODE_RANK", None), env.pop("RDZV_ENDPOINT", None)
    nodes = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path,
                              env={**env, "SLURM_NODEID": str(node)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for node in (0, 1)]
    outputs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert [r["step"] for r in _lines(run_dir) if "train/loss" in r] == [1, 2, 3]
    log = (run_dir / "train.log").read_text()
    assert "2 process(es)" in log and log.count("(2 machine(s) in all)") == 1, log  # node 1 logs to its stderr only
    assert "(2 machine(s) in all)" in outputs[1][1]


def test_under_bf16_a_frozen_copy_keeps_bf16_linear_weights_but_layers_shared_with_the_policy_stay_as_loaded():
    """prepare_frozen under bf16 stores a reference's linear weights in bf16 (the same products under autocast);
    a shared_layers reference holds the policy's own layers, which train with the policy and are saved with it:
    none of its weights change dtype."""
    from rlhf.embedded.tiny_model import TinySpec
    from rlhf.models.reference import FrozenCopy, SharedLayers

    torch.manual_seed(0)
    policy = TinySpec(hidden_size=16, num_layers=3, num_heads=2, intermediate_size=32, warm_start_steps=0).build().model
    strategy = DataParallel(device="cpu", mixed_precision="bf16")
    strategy.start()
    copied = strategy.prepare_frozen(FrozenCopy()(policy), name="copy")
    assert copied.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    shared = strategy.prepare_frozen(SharedLayers(num_shared_layers=1)(policy), name="shared")
    assert shared.model.layers[0] is policy.model.layers[0]
    assert {p.dtype for p in shared.parameters()} == {p.dtype for p in policy.parameters()} == {torch.float32}


def test_a_gathered_state_dict_keeps_one_name_of_a_tied_parameter():
    """A sharded strategy's gathered weights hold a tied output layer under both names, as separate tensors; the
    final model keeps the first name only, as an unsharded save writes it."""
    model = fast_initial_model()
    state = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in state  # tied: the embedding's parameter under a second name
    kept = base.without_tied_copies(model, state)
    assert sorted(kept) == sorted(name for name, _ in model.named_parameters())
    assert "lm_head.weight" not in kept and "model.embed_tokens.weight" in kept
