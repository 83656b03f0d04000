"""What a resume may change (rlhf/run/resume_check.py) and the command line of a resume (rlhf/run/folder.py
``resume_overrides``): pieces, without training. The runs that use them are in tests/run/test_checkpoint.py and
tests/launch/test_processes.py."""

from __future__ import annotations

import datasets
import pytest
import yaml

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.data.fingerprint import data_fingerprint
from rlhf.run import checkpoint
from rlhf.run import folder as run_folder
from rlhf.run.resume_check import NOT_OPTIMIZING, optimizing, recorded_config
from tests.conftest import ROOT, compose_config


class _Strategy:
    """What the record asks of a hardware strategy: what ``device: auto``, ``mixed_precision: auto`` (on a GPU with
    bf16) and ``num_processes: null`` mean here."""

    def __init__(self, cuda: bool = False, processes: int = 1, threads: int | None = None) -> None:
        self.cuda, self.processes, self.threads_settled = cuda, processes, threads
        self.mixed_precision = "bf16" if cuda else "no"

    def uses_cuda(self) -> bool:
        return self.cuda

    def processes_per_node(self) -> int:
        return self.processes


def _changed(a: list[str], b: list[str], strategy_a=None, strategy_b=None) -> set[str]:
    """The recorded keys that differ between the configs of overrides `a` and `b`."""
    x = recorded_config(compose_config(*a), strategy_a or _Strategy())
    y = recorded_config(compose_config(*b), strategy_b or _Strategy())
    return {k for k in x.keys() | y.keys() if x.get(k, "absent") != y.get(k, "absent")}


def test_the_hardware_that_shapes_the_training_is_recorded():
    """ZeRO stages, CPU against GPU, precision and the strategy's class differ in the record; the fields that only
    say where processes run do not, nor does `auto` against the device it means on this machine."""
    assert _changed(["hardware=zero1"], ["hardware=zero2"]) == {"hardware.stage"}
    assert "hardware.stage" in _changed(["hardware=zero2"], ["hardware=zero3"])
    assert {"hardware.device", "hardware.mixed_precision"} <= _changed(["hardware=cpu"], ["hardware=gpu"], None,
                                                                      _Strategy(cuda=True))
    assert _changed(["hardware=cpu"], ["hardware=cpu", "hardware.mixed_precision=bf16"]) == {
        "hardware.mixed_precision", "hardware.threads_per_process"}  # a CPU run in bf16 records its thread count
    assert "hardware._target_" in _changed(["hardware=cpu_ddp"], ["hardware=fsdp"], _Strategy(processes=2),
                                           _Strategy(processes=2))
    assert _changed(["hardware=auto"], ["hardware=cpu"]) == set()  # auto is the CPU on this (stub) machine
    assert _changed(["hardware=auto"], ["hardware=cpu"], _Strategy(cuda=True)) == {"hardware.device",
                                                                                 "hardware.mixed_precision"}
    # auto's bf16 on a GPU that has it is hardware=gpu's bf16: the same record
    assert _changed(["hardware=auto"], ["hardware=gpu"], _Strategy(cuda=True), _Strategy(cuda=True)) == set()
    where = ["hardware.timeout_s=60", "hardware.rdzv_endpoint=h:1",
             "train.log_every_steps=3", "train.eval_every_steps=5", "train.save_every_steps=7", "train.keep_last=9",
             "train.eval_batch_size=3", "logger=wandb", "resume=auto", "resume_changes=[seed]",
             "model.tiny.cache_dir=/elsewhere"]
    assert _changed([], where) == set()


def test_everything_else_is_compared():
    """The config is the list: every key of every group is recorded unless it is one of the few that cannot change
    the optimization (no list of keys that may change to keep up to date)."""
    recorded = recorded_config(compose_config("hardware=cpu"), _Strategy())
    for key in ("seed", "train.max_steps", "train.per_device_batch_size", "train.grad_accumulation_steps",
                "train.max_grad_norm", "optimizer.lr", "optimizer._target_", "scheduler._target_", "algo.beta",
                "data.path", "data.task.num_train", "model.tiny.hidden_size", "hardware.num_processes"):
        assert key in recorded, key
    assert not [k for k in recorded if not optimizing(k)]
    assert _changed(["seed=0"], ["seed=1", "train.max_grad_norm=0.5", "+optimizer.foreach=false"]) == {
        "seed", "train.max_grad_norm", "optimizer.foreach"}
    assert all(not optimizing(k) for k in NOT_OPTIMIZING)


def test_the_data_fingerprint_depends_on_the_rows_not_on_how_they_are_stored(tmp_path):
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "mask": [[1, 1, 0], [1], [0, 1]]})
    fingerprint = data_fingerprint(rows)
    rows.save_to_disk(str(tmp_path / "saved"))
    assert data_fingerprint(datasets.load_from_disk(str(tmp_path / "saved"))) == fingerprint  # another process
    chunks = datasets.concatenate_datasets([rows.select([0]), rows.select([1, 2])])
    assert data_fingerprint(chunks) == fingerprint
    assert data_fingerprint(rows.select([0, 2, 1])) != fingerprint  # row order
    other = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "mask": [[1, 1, 0], [1], [0, 1]]})
    assert data_fingerprint(other) != fingerprint  # the same tokens, split into other rows


# --- the command line of a resume -------------------------------------------------------------------------------
def _record(folder, overrides, resumed_from=None):
    folder.mkdir(parents=True)
    (folder / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if resumed_from:
        (folder / run_folder.RESUMED_FROM).write_text(resumed_from)


def test_a_resume_re_applies_the_overrides_of_the_runs_last_checked_attempt(tmp_path, capsys):
    run = tmp_path / "run"
    hydra = run / ".hydra"
    _record(hydra, ["algo=sft", "+algo.call=1", "train.max_steps=10"])
    given = [f"hydra.run.dir={run}", "resume=auto"]
    argv = run_folder.resume_overrides(given)
    assert argv[:-1] == ["algo=sft", "+algo.call=1", "train.max_steps=10", *given]
    assert argv[-1].startswith("hydra.output_subdir=.hydra/attempt-")  # the original record is never overwritten
    assert "re-applying the run's overrides" in capsys.readouterr().err
    # An attempt that resumed (with a deliberate change), then one refused by the check: the first one counts, and
    # neither its resume nor its resume_changes carries over (each resume says its own).
    _record(hydra / "attempt-2024-01-01_00-00-00", ["algo=sft", "+algo.call=1", "train.max_steps=20",
                                                    "resume=auto", "resume_changes=[train.max_steps]"], "step_10")
    _record(hydra / "attempt-2024-01-02_00-00-00", ["algo=sft", "optimizer.lr=9", "resume=auto"])
    assert run_folder.resume_overrides(given)[:-1] == ["algo=sft", "+algo.call=1", "train.max_steps=20", *given]
    # Given again, a key wins over the recorded one; one the run added with + takes ++.
    argv = run_folder.resume_overrides([*given, "algo.call=2", "train.max_steps=30", "--cfg", "job"])
    assert argv[:-1] == ["--cfg", "job", "algo=sft", *given, "++algo.call=2", "train.max_steps=30"]
    # The overrides of the attempt that wrote the checkpoint resumed: the attempt above began at step 10, so it
    # wrote step 15 but not step 5; one that began at 15 and was stopped before its first checkpoint wrote nothing.
    for step in (5, 10, 15):
        folder = run / checkpoint.FOLDER / f"{checkpoint.PREFIX}{step:08d}"
        folder.mkdir(parents=True)
        (folder / checkpoint.META).write_text("{}")
    _record(hydra / "attempt-2024-01-03_00-00-00", ["algo=sft", "train.max_steps=99"], str(folder))
    assert "train.max_steps=20" in run_folder.resume_overrides(given)
    older = [f"hydra.run.dir={run}", f"resume={run / checkpoint.FOLDER / 'step_00000005'}"]
    assert run_folder.resume_overrides(older)[:-1] == ["algo=sft", "+algo.call=1", "train.max_steps=10", *older]
    for untouched in (["-m", *given], [f"hydra.run.dir={run}"], [f"hydra.run.dir={run}", "resume=null"],
                      [f"hydra.run.dir={tmp_path / 'new'}", "resume=auto"], ["resume=auto"]):
        assert run_folder.resume_overrides(untouched) == untouched


@pytest.mark.parametrize("value", ["5", "[1]"])
def test_resume_changes_is_a_list_of_keys(value):
    with pytest.raises(UserError, match=r"resume_changes=.* is not a list of config keys\. Fix: e\.g\. "):
        check_config(compose_config(f"resume_changes={value}", output_dir=ROOT / "outputs" / "unused"))
    check_config(compose_config("resume_changes=[train.max_steps,tokenized_data]", output_dir=ROOT / "outputs" / "x"))


def test_a_checkpoint_recorded_before_the_layer_packages_resumes_and_eval_may_change(tmp_path):
    """A record written before the modules moved names the tiny model and the reward functions by their old paths
    and has no eval key: the same run resumes from it, with eval=generate turned on (red without the old paths'
    translation, and with eval among the compared keys)."""
    import json

    from rlhf.run.resume_check import check_config as check_resume

    overrides = ["algo=grpo", "seed=3"]
    recorded = recorded_config(compose_config(*overrides), _Strategy())
    assert recorded["model.tiny._target_"] == "rlhf.embedded.tiny_model.TinySpec" and not any(
        k.startswith("eval") for k in recorded)
    old = {k: (v.replace("rlhf.embedded.tiny_model.", "rlhf.models.tiny.").replace("rlhf.algos.reward_funcs.",
                                                                                       "rlhf.rewards.")
               if k.endswith("_target_") else v) for k, v in recorded.items()}
    assert old != recorded and "rlhf.rewards.exact_match" in old.values()
    (tmp_path / checkpoint.CONFIG).write_text(json.dumps({"config": old, "tokenized_data": "x"}))
    check_resume(compose_config(*overrides, "eval=generate"), _Strategy(), tmp_path)
    with pytest.raises(UserError, match=r"seed \(checkpoint: 3, now: 4\)"):  # a real change is still refused
        check_resume(compose_config("algo=grpo", "seed=4"), _Strategy(), tmp_path)


def test_the_thread_count_of_a_bf16_cpu_run_is_recorded_kept_by_a_resume_and_checked(tmp_path, monkeypatch):
    """In bf16 on a CPU, 1 and 2 threads give different steps (benchmarks/threads_identical.py): the count such a run
    used is recorded (not in float32 nor on a GPU, where it changes nothing), a resume that is not told otherwise uses
    it whatever the load, saying so (and when it is more than the CPUs here give), and a different count is refused
    like any other change unless resume_changes lists it, naming OMP_NUM_THREADS where that set it; a checkpoint
    written before counts were recorded resumes unchecked (red: with the key among those that may change freely)."""
    import json

    from rlhf.hardware import cpus
    from rlhf.run.resume_check import check_config as check_resume
    from rlhf.run.resume_check import recorded_threads

    bf16 = ["hardware=cpu", "hardware.mixed_precision=bf16"]
    assert recorded_config(compose_config(*bf16), _Strategy(threads=2))["hardware.threads_per_process"] == 2
    assert "hardware.threads_per_process" not in recorded_config(compose_config("hardware=cpu"), _Strategy(threads=2))
    assert "hardware.threads_per_process" not in recorded_config(compose_config("hardware=gpu"),
                                                                 _Strategy(cuda=True, threads=2))
    recorded = recorded_config(compose_config(*bf16), _Strategy(threads=2))
    (tmp_path / checkpoint.CONFIG).write_text(json.dumps({"config": recorded, "tokenized_data": "x"}))
    assert recorded_threads(tmp_path) == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 2.0)  # a machine this busy would get 1 thread
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    assert cpus.choose_threads(None, 1)[0] == 1
    count, why = cpus.choose_threads(None, 1, resumed=recorded_threads(tmp_path))
    assert count == 2 and "the count of the bf16 run this resume continues" in why and "more than" not in why
    count, why = cpus.choose_threads(None, 2, resumed=2)  # 2 processes on 2 CPUs: 1 each would fit
    assert count == 2 and "more than the 2 CPU(s) here give each process" in why
    assert "hardware.threads_per_process=1 resume_changes=[hardware.threads_per_process]" in why
    assert cpus.choose_threads(3, 1, resumed=2)[0] == 3  # an explicit count is the user's
    check_resume(compose_config(*bf16), _Strategy(threads=2), tmp_path)
    with pytest.raises(UserError, match=r"hardware.threads_per_process \(checkpoint: 2, now: 1\)"):
        check_resume(compose_config(*bf16, "hardware.threads_per_process=1"), _Strategy(threads=1), tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(UserError, match=r"\(checkpoint: 2, now: 1, from OMP_NUM_THREADS=1: unset it to keep"):
        check_resume(compose_config(*bf16), _Strategy(threads=1), tmp_path)
    check_resume(compose_config(*bf16, "hardware.threads_per_process=1",
                                "resume_changes=[hardware.threads_per_process]"), _Strategy(threads=1), tmp_path)
    del recorded["hardware.threads_per_process"]  # an older checkpoint
    (tmp_path / checkpoint.CONFIG).write_text(json.dumps({"config": recorded, "tokenized_data": "x"}))
    assert recorded_threads(tmp_path) is None
    check_resume(compose_config(*bf16), _Strategy(threads=1), tmp_path)


def test_a_checkpoint_from_before_compile_auto_and_the_decoder_option_resumes_on_a_gpu(tmp_path):
    """A GPU run's record written when hardware.compile defaulted to false and algo.generation did not exist: the same
    run resumes with compiled layers, and from a record without the compile key at all (compiling
    computes the same functions: not compared, red with hardware.compile off NOT_OPTIMIZING); compiling may be turned
    on or off on purpose; a real change and another decoder are still refused."""
    import json

    from rlhf.run.resume_check import check_config as check_resume

    class Resolved(_Strategy):
        def __init__(self, compile, **kwargs) -> None:
            super().__init__(**kwargs)
            self.compile = compile

    overrides = ["algo=grpo", "seed=3", "hardware=auto"]
    gpu_then, gpu_now = Resolved(False, cuda=True), Resolved("layers", cuda=True)
    recorded = recorded_config(compose_config(*overrides), gpu_then)
    assert "hardware.compile" not in recorded and recorded["algo.generation"] == "auto"
    old = {k: v for k, v in recorded.items() if k != "algo.generation"}
    for record in ({**old, "hardware.compile": False}, old):  # as written then, and without the key
        (tmp_path / checkpoint.CONFIG).write_text(json.dumps({"config": record, "tokenized_data": "x"}))
        check_resume(compose_config(*overrides), gpu_now, tmp_path)
        check_resume(compose_config(*overrides, "hardware.compile=true"), Resolved(True, cuda=True), tmp_path)
        with pytest.raises(UserError, match=r"seed \(checkpoint: 3, now: 4\)"):
            check_resume(compose_config("algo=grpo", "seed=4", "hardware=auto"), gpu_now, tmp_path)
        with pytest.raises(UserError, match=r"algo.generation \(checkpoint: auto, now: static"):
            check_resume(compose_config(*overrides, "algo.generation=static"), gpu_now, tmp_path)


@pytest.mark.parametrize("added", [["algo/loss=dpo_forward_kl"], ["+optimizer.maximize=true"]])
def test_keys_a_resume_adds_are_a_change(tmp_path, added):
    """Another loss of the same target (its extra keys only) or a constructor argument the YAML does not list
    (+key=value): keys the checkpoint does not record, refused like any change."""
    import json

    from rlhf.run.resume_check import check_config as check_resume

    recorded = recorded_config(compose_config("algo=dpo"), _Strategy())
    (tmp_path / checkpoint.CONFIG).write_text(json.dumps({"config": recorded, "tokenized_data": "x"}))
    check_resume(compose_config("algo=dpo"), _Strategy(), tmp_path)
    with pytest.raises(UserError, match="the config differs from the checkpoint's"):
        check_resume(compose_config("algo=dpo", *added), _Strategy(), tmp_path)
