"""Bad values and options stop with one message, naming the key, the value, the allowed range and the fix,
before anything is built (``check_config``) — and, from the command line, before Hydra makes a run folder."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.config import command_line
from rlhf.config.checks import check_config, check_fields
from rlhf.core.errors import UserError
from rlhf.core.limits import Range, check_limits, check_run_dir, known_top_level, limits, show
from tests.conftest import CONF, ROOT, compose_config

OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml"))
SCHEDULERS = sorted(p.stem for p in (CONF / "scheduler").glob("*.yaml"))


def refused(*overrides: str, output_dir=None) -> str:
    """The message check_config gives for `overrides` (fails the test if it accepts them)."""
    cfg = compose_config(*overrides, output_dir=output_dir or ROOT / "outputs" / "unused")
    with pytest.raises(UserError) as error:
        check_config(cfg)
    return str(error.value)


def accepted(*overrides: str) -> None:
    check_config(compose_config(*overrides, output_dir=ROOT / "outputs" / "unused"))


# --- algorithms: ranges declared with @limits on the class or loss function ----------------------------------
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_dpo_beta_must_be_positive_and_finite(value):
    message = refused("algo=dpo", f"algo.beta={value}")
    assert message.startswith(f"algo.beta={value} ") and "> 0 (the KL penalty's strength" in message
    assert message.endswith("Fix: algo.beta=0.1")


def test_the_message_reads_as_one_sentence_with_the_fix():
    assert refused("algo.beta=-1.0") == ("algo.beta=-1.0 must be > 0 (the KL penalty's strength; 0.1-0.5 is common). "
                                         "Fix: algo.beta=0.1")


@pytest.mark.parametrize("value", ["2", "0.5", "-0.1"])
def test_label_smoothing_is_a_probability_below_one_half(value):
    assert f"algo.loss.label_smoothing={value} must be in [0, 0.5)" in refused(f"algo.loss.label_smoothing={value}")


def test_in_range_values_are_accepted():
    accepted("algo.beta=0.01", "algo.loss.label_smoothing=0.49", "algo.nll_weight=0", "optimizer.lr=1e-6")
    accepted("algo=sft", "algo.max_length=null", "algo.max_prompt_length=null")


def test_other_loss_weights_and_lengths_are_checked():
    assert "algo.nll_weight=-1 must be >= 0" in refused("algo.nll_weight=-1")
    assert "algo.max_length=0 must be a whole number >= 1" in refused("algo=sft", "algo.max_length=0")
    message = refused("algo=dpo", "algo.max_length=256")  # the default max_prompt_length=512 would fill it
    assert "algo.max_prompt_length=512 must be < algo.max_length=256" in message
    assert "Fix: algo.max_prompt_length=128" in message


# --- optimizers and schedulers: one set of limits in rlhf/optim.py, whatever the class -------------------------
@pytest.mark.parametrize(("option", "value"), [(o, v) for o in OPTIMIZERS for v in ("0", "inf")]
                         + [("adamw", "-0.001"), ("lion", "nan")])
def test_every_optimizer_refuses_a_learning_rate_that_is_not_positive_and_finite(option, value):
    message = refused(f"optimizer={option}", f"optimizer.lr={value}")
    assert message.startswith(f"optimizer.lr={value} ") and "> 0 (peak learning rate" in message
    default = OmegaConf.load(CONF / "optimizer" / f"{option}.yaml").lr  # the fix is the option's own default
    assert message.endswith(f"Fix: optimizer.lr={show(default)}")


def test_the_fix_for_a_learning_rate_is_the_chosen_optimizers_default():
    """SGD needs a learning rate far above Adam's: its fix is conf/optimizer/sgd.yaml's 0.03, not 1e-4."""
    assert refused("optimizer=sgd", "optimizer.lr=0") == "optimizer.lr=0 must be > 0 (peak learning rate). Fix: optimizer.lr=0.03"
    assert refused("optimizer=adamw", "optimizer.lr=0").endswith("Fix: optimizer.lr=0.0001")
    assert refused("optimizer=sgd", "optimizer.momentum=1").endswith("Fix: optimizer.momentum=0.9")


@pytest.mark.parametrize("option", OPTIMIZERS)
def test_every_optimizer_refuses_negative_weight_decay(option):
    assert "optimizer.weight_decay=-0.1 must be >= 0" in refused(f"optimizer={option}", "optimizer.weight_decay=-0.1")


@pytest.mark.parametrize("option", [o for o in OPTIMIZERS if "betas" in OmegaConf.load(CONF / "optimizer" / f"{o}.yaml")])
def test_betas_each_in_zero_one(option):
    message = refused(f"optimizer={option}", "optimizer.betas=[0.9,1.0]")
    default = show(list(OmegaConf.load(CONF / "optimizer" / f"{option}.yaml").betas))
    assert message == ("optimizer.betas[1]=1.0 must be in [0, 1) (decay rates of the moment estimates). "
                       f"Fix: optimizer.betas={default}")


def test_eps_and_momentum():
    assert "optimizer.eps=0 must be > 0" in refused("optimizer=adamw", "optimizer.eps=0")
    assert "optimizer.momentum=1 must be in [0, 1)" in refused("optimizer=sgd", "optimizer.momentum=1")
    accepted("optimizer=sgd", "optimizer.momentum=0")


@pytest.mark.parametrize(("option", "override", "message"), [
    ("cosine", "scheduler.num_warmup_steps=-1", "must be a whole number >= 0"),
    ("linear", "scheduler.num_warmup_steps=2.5", "expects int for 'num_warmup_steps'. Fix: e.g. scheduler.num_warmup_steps=0"),
    ("cosine", "scheduler.num_training_steps=-1", "must be a whole number >= 0"),
    ("cosine", "scheduler.num_cycles=0", "must be > 0"),
    ("step", "scheduler.step_size=0", "must be a whole number >= 1"),
    ("step", "scheduler.gamma=0", "must be in (0, 1]"),
    ("exponential", "scheduler.gamma=1.5", "must be in (0, 1]"),
])
def test_scheduler_limits(option, override, message):
    assert message in refused(f"scheduler={option}", override)


def test_a_null_with_a_meaning_still_needs_a_target_that_takes_it():
    """num_training_steps: null means the run's length for cosine (annotated int); StepLR has no such argument."""
    accepted("scheduler=cosine", "scheduler.num_training_steps=null")
    assert "has no argument 'num_training_steps'" in refused("scheduler=step", "+scheduler.num_training_steps=null")


def test_scheduler_options_pass_as_shipped():
    for option in SCHEDULERS:
        accepted(f"scheduler={option}", "scheduler.num_warmup_steps=0" if option in ("cosine", "linear") else "seed=0")


# --- NaN and infinity anywhere ------------------------------------------------------------------------------
@pytest.mark.parametrize("override", ["seed=nan", "optimizer.lr=inf", "model.tiny.warm_start_lr=nan",
                                      "data.eval_size=-inf"])
def test_nan_and_inf_are_refused_anywhere(override):
    key, value = override.split("=")
    assert refused(override).startswith(f"{key}={value} is not a finite number")


def test_train_settings_are_checked_first_by_their_limits():
    """The train block is checked before the components (whose values may derive from it), by the @limits that
    rlhf.run.train_settings.TrainSettings declares."""
    assert refused("train.max_grad_norm=inf") == (
        "train.max_grad_norm=inf is not a finite number; it must be > 0 (the gradient norm is clipped to this; null "
        "for no clipping). Fix: train.max_grad_norm=1.0")
    assert refused("train.max_steps=-5") == ("train.max_steps=-5 must be a whole number >= 0 (optimizer steps; 0 "
                                             "evaluates the starting model and stops). Fix: train.max_steps=300")
    assert refused("train.keep_last=0", "optimizer.lr=-1").startswith("train.keep_last=0 must be a whole number >= 1")


# --- a list where one value belongs: a sweep written as a list ---------------------------------------------------
def test_list_for_a_scalar_points_to_multirun():
    assert refused("algo.beta=[0.1,0.2]") == ("algo.beta=[0.1, 0.2] is a list, but algo.beta takes one float. "
                                              "To sweep: python train.py -m algo.beta=0.1,0.2")
    # a third-party class without type hints: the shared limits say the same
    assert "To sweep: python train.py -m optimizer.lr=0.001,0.0001" in refused(
        "optimizer=adafactor", "optimizer.lr=[1e-3,1e-4]")
    with pytest.raises(UserError, match=r"train.max_steps=\[1, 2\] is a list, but train.max_steps takes one int"):
        check_fields({"max_steps": [1, 2]}, _Steps, "train")


class _Steps:
    def __init__(self, max_steps: int | None = 3) -> None: ...


# --- unknown top-level keys, from conf/config.yaml ------------------------------------------------------------
def test_a_mistyped_group_added_with_plus_is_refused_with_the_closest_name():
    assert refused("+optimiser=lion").endswith("Did you mean optimizer=lion?")
    assert refused("+optimiser=lion").startswith("optimiser is not a config group or key")
    assert refused("+sed=3").endswith("Did you mean seed=3?")
    message = refused("+foo=1")
    assert message.startswith("foo is not a config group or key") and "Fix: drop +foo=1." in message
    assert "Config groups: algo, data, eval, experiment, hardware" in message


def test_known_top_level_names_are_read_from_the_primary_config(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "defaults:\n  - _self_\n  - algo: dpo\n  - optional extra: null\n  - override hydra/help: rlhf\n"
        "seed: 0\ntrain:\n  max_steps: 1\n")
    assert known_top_level(tmp_path) == {"algo": "group", "extra": "group", "seed": "key", "train": "key"}
    real = known_top_level(CONF)
    assert {"algo", "optimizer", "scheduler", "experiment"} <= {k for k, kind in real.items() if kind == "group"}
    assert {"seed", "train", "output_dir"} <= set(real)


# --- the run folder -----------------------------------------------------------------------------------------
def test_a_run_folder_that_is_empty_the_current_folder_or_the_checkout_is_refused(tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"hydra.run.dir is empty, so the run would write into the current folder.*"
                                        r"Fix: leave hydra.run.dir at its default"):
        check_run_dir("", "hydra.run.dir")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="is the current folder"):
        check_run_dir(".", "hydra.run.dir")
    with pytest.raises(UserError, match="is the checkout"):
        check_run_dir(str(ROOT), "hydra.run.dir")
    check_run_dir(tmp_path / "run", "hydra.run.dir")
    assert "output_dir=" in refused(output_dir=ROOT)


# --- float16 on a CPU ---------------------------------------------------------------------------------------
def test_float16_on_a_cpu_is_refused_with_the_fix(monkeypatch):
    message = refused("hardware=cpu", "model.dtype=float16")
    assert message.startswith("model.dtype=float16 trains on the CPU here (hardware.device=cpu)")
    assert "Fix: model.dtype=float32 (add hardware.mixed_precision=bf16" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "hardware.device=auto and torch sees no GPU" in refused("hardware=auto", "model.dtype=float16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    accepted("hardware=auto", "model.dtype=float16")  # on a GPU it is the user's call
    accepted("hardware=cpu", "model.dtype=bfloat16")


# --- fp16, in every hardware option ------------------------------------------------------------------------------
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("option", HARDWARE)
def test_fp16_is_refused_by_every_hardware_option_pointing_to_bf16(option):
    """No strategy keeps fp16's loss scaler (updated on skipped steps, saved in checkpoints): one message, at check
    time, on any machine, whatever the option."""
    message = refused(f"hardware={option}", "hardware.mixed_precision=fp16")
    assert message.startswith("hardware.mixed_precision=fp16 is not supported by any hardware option: fp16 needs a "
                              "loss scaler")
    assert "Fix: hardware.mixed_precision=bf16" in message


def test_fp16_through_deepspeed_config_is_refused_too():
    message = refused("hardware=zero2", "+hardware.deepspeed_config.fp16.enabled=true")
    assert message.startswith("hardware.deepspeed_config.fp16.enabled=true is not supported: fp16 needs a loss scaler")
    assert message.endswith("Fix: leave fp16 out of hardware.deepspeed_config and set hardware.mixed_precision=bf16.")
    accepted("hardware=zero2", "hardware.mixed_precision=bf16", "+hardware.deepspeed_config.fp16.enabled=false")


# --- the machinery ---------------------------------------------------------------------------------------------
def test_range_describes_itself():
    assert Range(gt=0).describe() == "> 0"
    assert Range(ge=0, lt=1).describe() == "in [0, 1)"
    assert Range(gt=0, le=1).describe() == "in (0, 1]"
    assert Range(ge=1, integer=True).describe() == "a whole number >= 1"
    assert Range().describe() == "a finite number"
    assert not Range(gt=0).contains(math.inf) and Range(gt=0).contains(1e-12)


def test_limits_attach_ranges_and_checks_across_arguments():
    def both_or_none(values, where):
        if (values["a"] is None) != (values["b"] is None):
            raise UserError(f"{where}: a and b go together")

    @limits(both_or_none, a=Range(ge=0, meaning="a count", fix=1))
    def target(a: int | None = None, b: int | None = None): ...

    check_limits({"a": 2, "b": 1}, target, "x")
    with pytest.raises(UserError, match=r"^x.a=-1 must be >= 0 \(a count\). Fix: x.a=1$"):
        check_limits({"a": -1, "b": 1}, target, "x")
    with pytest.raises(UserError, match="a and b go together"):
        check_limits({"a": 2}, target, "x")  # b's default comes from the signature
    with pytest.raises(UserError, match=r"x.a='2' is not a number"):
        check_limits({"a": "2", "b": 1}, target, "x")


# --- from the command line: one message, exit 1, no run folder -----------------------------------------------
def _train(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (["hydra.run.dir="], "error: hydra.run.dir is empty, so the run would write into the current folder"),
    # the run folder Hydra makes is not where this run would write: output_dir is checked as the user gave it
    (["output_dir=", "hydra.run.dir=run"], "error: output_dir is empty, so the run would write into the current folder"),
    (["+optimiser=lion", "hydra.run.dir=run"], "error: optimiser is not a config group or key: +optimiser=lion would "
                                               "be ignored and the run would train with the defaults. Did you mean "
                                               "optimizer=lion?"),
    # Before Hydra composes: not Hydra's "To append to your config use +optimiser=lion", which trains the defaults
    (["optimiser=lion", "hydra.run.dir=run"], "error: optimiser is not a config group or key (optimiser=lion). Did "
                                              "you mean optimizer=lion?"),
    (["optimizer=lino", "hydra.run.dir=run"], "error: optimizer=lino: conf/optimizer/ has no option 'lino' (options: "
                                              f"{', '.join(OPTIMIZERS)}). Did you mean optimizer=lion?"),
    (["data.path=pairs.jsonl", "hydra.run.dir=run"], "error: data.path=pairs.jsonl has columns ['prompt', 'chosen'], "
                                                     "but this algorithm needs prompt/chosen/rejected"),
])
def test_train_py_refuses_before_hydra_makes_the_run_folder(args, message, tmp_path):
    """About 4 s each (the imports): nothing heavy loads, no folder is made."""
    pairs = tmp_path.parent / f"{tmp_path.name}-pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "p", "chosen": "a"}) + "\n")
    out = _train(*[a.replace("pairs.jsonl", str(pairs)) for a in args], cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert message.replace("pairs.jsonl", str(pairs)) in out.stderr and "Traceback" not in out.stderr
    assert "To append to your config" not in out.stderr and "Could not find" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # no .hydra/, train.log or run folder


# --- issue 19: values without a declared range, and inputs checked before anything loads -----------------------
@pytest.mark.parametrize(("override", "message"), [
    ("seed=abc", "seed='abc' is not a number; it must be a whole number in [0, 4294967296)"),
    ("seed=-1", "seed=-1 must be a whole number in [0, 4294967296) (seeds Python, NumPy and torch). Fix: seed=0"),
    ("seed=1.5", "seed=1.5 must be a whole number"),
    ("data.eval_size=0", "data.eval_size=0 must be > 0 (rows held out when data.eval_split is null: a fraction (< 1) "
                         "or a count). Fix: data.eval_size=0.05"),
    ("data.eval_size=-1", "data.eval_size=-1 must be > 0"),
    ("data.eval_size=1.5", "data.eval_size=1.5 is neither a fraction of the rows (< 1) nor a whole count of rows "
                           "(>= 1). Fix: data.eval_size=0.05 (5% of the rows) or data.eval_size=2 (rows)"),
    ("data.max_train_rows=0", "data.max_train_rows=0 must be a whole number >= 1"),
    ("data.seed=-3", "data.seed=-3 must be a whole number in [0, 4294967296)"),
])
def test_seed_and_the_held_out_size_have_ranges(override, message):
    assert refused(override).startswith(message)


def test_held_out_sizes_that_are_a_fraction_or_a_count_are_accepted():
    accepted("data.eval_size=0.5", "data.eval_size=3", "seed=4294967295")


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.evaluate_on=validation"], "data.evaluate_on=validation needs validation rows, and data.validation_size is "
                                      "null. Fix: data.validation_size=0.5"),
    (["data.evaluate_on=test"], "data.evaluate_on=test is not a split a run evaluates on. Fix: "
                                "data.evaluate_on=held_out"),
    (["data.validation_size=0"], "data.validation_size=0 must be > 0"),
    (["data.validation_size=2.5"], "data.validation_size=2.5 is neither a fraction of the held-out rows"),
])
def test_the_validation_split_is_checked_before_anything_loads(overrides, message):
    assert refused(*overrides).startswith(message)


def test_a_run_folder_below_a_file_or_where_nothing_can_be_written_is_refused(tmp_path):
    """Tried for real, so it holds for root too (CI): below a regular file, a file itself, and /proc, where not
    even root can make a folder. Nothing is left behind by the try."""
    (tmp_path / "notes.txt").write_text("x")
    assert refused(output_dir=tmp_path / "notes.txt" / "run") == (
        f"output_dir={tmp_path}/notes.txt/run is below {tmp_path}/notes.txt, which is a file, not a folder. "
        "Fix: a folder you may write to, e.g. output_dir=outputs/my-run")
    assert refused(output_dir=tmp_path / "notes.txt").endswith("is a file, not a folder. Fix: a folder you may "
                                                               "write to, e.g. output_dir=outputs/my-run")
    with pytest.raises(UserError, match=r"^hydra.run.dir=/proc/rlhf-run/a: cannot write in /proc \("):
        check_run_dir("/proc/rlhf-run/a", "hydra.run.dir")
    check_run_dir(tmp_path / "new" / "run", "hydra.run.dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_data_path_is_checked_before_anything_loads(tmp_path):
    """A missing file, and a folder named like a data file that holds none, are refused by the config check (before
    the run folder and the model); a folder of data files named so is a dataset folder, and loads."""
    (tmp_path / "rows.jsonl").mkdir()
    (tmp_path / "rows.jsonl" / "notes.txt").write_text("x")
    assert refused(f"data.path={tmp_path}/rows.jsonl") == (
        f"data.path={tmp_path}/rows.jsonl is a folder, not a .jsonl file, and holds no .csv, .json, .jsonl or "
        ".parquet file. Fix: point data.path at the data file itself.")
    assert refused(f"data.path={tmp_path}/none.jsonl").startswith(f"data.path={tmp_path}/none.jsonl: no such file")
    (tmp_path / "rows.jsonl" / "part-0.jsonl").write_text(json.dumps(_PAIR) + "\n")
    accepted(f"data.path={tmp_path}/rows.jsonl")


_PAIR = {"prompt": "p", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_a_data_file_without_a_needed_column_is_refused_before_anything_loads(tmp_path, suffix):
    """Read from the file's first row (a header), so in about a millisecond; the fix names the missing column."""
    import pandas as pd

    path = tmp_path / f"pairs{suffix}"
    rows = [{"prompt": f"p{i}", "chosen": "a"} for i in range(3)]
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        getattr(pd.DataFrame(rows), "to_csv" if suffix == ".csv" else "to_parquet")(path, index=False)
    assert refused("algo=dpo", f"data.path={path}") == (
        f"data.path={path} has columns ['prompt', 'chosen'], but this algorithm needs prompt/chosen/rejected or "
        "chosen/rejected. Fix: add a 'rejected' column (the worse answer of each pair); or, if the data has them under "
        "other names, name them: data.columns={rejected:<its name>}.")
    accepted("algo=sft", "data.path=" + str(_write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}])))


def test_a_json_file_whose_first_row_lacks_a_column_is_read_whole_before_it_is_refused(tmp_path):
    rows = [{"prompt": "p", "chosen": "a"}, {"prompt": "p", "chosen": "a", "rejected": "b"}]
    accepted("algo=dpo", f"data.path={_write_jsonl(tmp_path / 'late.jsonl', rows)}")  # row 1 is a bad row, later
    assert "Fix: algo=dpo for such data" in refused("algo=sft", f"data.path={_write_jsonl(tmp_path / 'p.jsonl', [_PAIR])}")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_missing_local_model_is_refused_before_anything_loads(tmp_path):
    assert refused(f"model.name_or_path={tmp_path}/no/final").startswith(
        f"model.name_or_path={tmp_path}/no/final: no such folder")
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    assert refused(f"model.name_or_path={tmp_path}/run").endswith(f"Fix: model.name_or_path={tmp_path}/run/final")


# --- the command line, before Hydra composes: the project's message, not Hydra's ----------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (["optimiser=lion"], "optimiser is not a config group or key (optimiser=lion). Did you mean optimizer=lion?"),
    (["trian.max_steps=3"], "trian is not a config group or key (trian.max_steps=3). Did you mean train.max_steps=3?"),
    (["optimizer=lino"], f"optimizer=lino: conf/optimizer/ has no option 'lino' (options: {', '.join(OPTIMIZERS)}). "
                         "Did you mean optimizer=lion?"),
    (["-m", "optimizer=sgd,lino"], "optimizer=lino: conf/optimizer/ has no option 'lino'"),
    (["hardware=zzz"], "hardware=zzz: conf/hardware/ has no option 'zzz' (options: auto, "),
    (["algo=dpo", "optimizer=lion", "hydra.run.dir=x", "+foo=1", "experiment=null", "--cfg", "job", "seed=1"], None),
    (["--config-name=other", "optimiser=lion"], None),  # another primary config: Hydra's business
    (["logger=wandb", "logger.mode=offline"], "logger.mode: each logger option sits under its own key "
                                              "(logger.<option>.<field>), so that several can be chosen at once "
                                              "(logger=[a,b]). Fix: logger.wandb.mode=offline."),
    (["logger=[wandb,tensorboard]", "logger.wandb.mode=offline", "optimizer.lr=0.1"], None),
    (["algo=simpo", "eval=generate", "algo/reward_funcs@eval=exact_match"], None),
    (["experiment=optimizer_comparison", "search.adamw=optimizer.lr=1e-5,1e-4"],
     "search.adamw=optimizer.lr=1e-5,1e-4: a sweep's grids and settings live under hydra.sweeper. Fix: "
     "\"hydra.sweeper.search.adamw='optimizer.lr=1e-5,1e-4'\""),  # a group placed under eval
    (["eval=generate", "algo/reward_funcs@eval=exact_matc"], "algo/reward_funcs@eval=exact_matc: conf/algo/reward_funcs/ "
                                                             "has no option 'exact_matc'"),
])
def test_the_command_line_is_checked_before_hydra(args, message):
    found = command_line.problem(args, CONF)
    assert found == message if message is None else found.startswith(message), found
