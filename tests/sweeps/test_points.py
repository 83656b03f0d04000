"""Sweeps: a failing point is recorded and the sweep goes on; the objective a job returns to Hydra."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlhf.algos.dpo import DPO
from rlhf.algos.grpo import GRPO
from rlhf.algos.kto import KTO
from rlhf.algos.reward import Reward
from rlhf.algos.sft import SFT
from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.reference import FrozenCopy
from rlhf.models.tokenizer import byte_tokenizer
from rlhf.sweeps.points import FAILED, objective_value, produced_metrics
from tests.conftest import FAST, ROOT, compose_config
from tests.test_train_cli import run

NAN = ["algo=sft", "algo._target_=tests.nonfinite_loss.NaNAt"]  # every training loss is NaN


def test_a_failing_point_is_recorded_and_the_sweep_goes_on_to_the_others(tmp_path):
    """Point 0 stops on a NaN loss (train.on_nonfinite=stop: a NonFinite error at run time), point 1 skips the NaN
    steps and finishes. Before failed points were caught, the first one ended the whole multirun. ~9 s."""
    out = run("-m", *NAN, "train.on_nonfinite=stop,skip", *FAST, f"hydra.sweep.dir={tmp_path}",
              "hydra.job.config.override_dirname.exclude_keys=[algo,algo._target_,"
              + ",".join(o.split("=")[0] for o in FAST) + "]")
    assert out.returncode == 1, out.stderr
    failed, finished = tmp_path / "0_train.on_nonfinite=stop", tmp_path / "1_train.on_nonfinite=skip"
    record = json.loads((failed / FAILED).read_text())
    assert record["error"] == "NonFinite" and "train.on_nonfinite=stop" in record["message"]
    assert not (failed / "summary.json").exists()
    assert (finished / "summary.json").is_file() and not (finished / FAILED).exists()
    closing = out.stderr.strip().splitlines()[-1]
    assert closing.startswith("1 of 2 points failed: 0_train.on_nonfinite=stop: step 1: the loss"), closing

    # The finished run reports every metric its algorithm declares (what an objective may name), and the job's
    # return value is the objective's metric among them.
    final = json.loads((finished / "summary.json").read_text())["final"]
    assert set(produced_metrics(SFT)) <= set(final), set(produced_metrics(SFT)) - set(final)
    cfg = OmegaConf.create({"objective": {"metric": "eval/exact_match", "direction": "maximize"}})
    assert objective_value(cfg, final) == final["eval/exact_match"] != final["eval/loss"]
    assert objective_value(OmegaConf.create({}), final) == final["eval/loss"]  # without an objective: as before


def test_an_objective_the_run_does_not_report_is_refused_before_the_sweep_starts(tmp_path, capsys):
    """What train.py -m runs before any point (the config callback's multirun check): one message, no folder."""
    from hydra import compose, initialize_config_dir

    from rlhf.config.checks import CheckBeforeRun
    from tests.conftest import CONF

    sweep_dir = tmp_path / "sweep"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["objective.metric=eval/accuracy", *FAST, f"hydra.sweep.dir={sweep_dir}"],
                      return_hydra_config=True)
    with pytest.raises(SystemExit) as stop:
        CheckBeforeRun().on_multirun_start(cfg)
    assert stop.value.code == 1 and not sweep_dir.exists()
    assert "objective.metric=eval/accuracy: runs of rlhf.algos.dpo.DPO do not report it" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "message"), [
    (["objective.metric=eval/exact_matc"], "Fix: objective.metric=eval/exact_match"),
    (["algo=reward", "objective.metric=eval/exact_match"], "runs of rlhf.algos.reward.Reward do not report it"),
    (["objective.direction=up"], "objective.direction='up' must be minimize or maximize"),
])
def test_the_objective_is_checked_with_the_config(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        check_config(compose_config(*overrides, *FAST, output_dir=tmp_path / "run"))
    check_config(compose_config("objective.metric=eval/exact_match", "objective.direction=maximize", *FAST,
                                output_dir=tmp_path / "run"))


class _FirstTokenReward(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=input_ids[:, :1].float())


def _evaluated(algo, rows, model=None):
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    tokenizer = byte_tokenizer() if model is not None else policy.tokenizer
    algo.setup(policy.model if model is None else None, tokenizer)
    batch = algo.collate([algo.tokenize(r, tokenizer) for r in rows])
    return set(algo.evaluate(model or policy.model, batch))


def test_each_algorithm_reports_the_metrics_it_declares_whatever_the_batch():
    """What check_objective accepts is what evaluations report (KTO: with desirable rows only, or undesirable)."""
    pairs = [{"prompt": "abc=", "chosen": "cba", "rejected": "cab"}]
    assert set(DPO.eval_metrics) <= _evaluated(DPO(beta=0.1, reference=FrozenCopy()), pairs)
    assert set(SFT.eval_metrics) <= _evaluated(SFT(), [{"prompt": "abc=", "completion": "cba"}])
    assert set(Reward.eval_metrics) <= _evaluated(Reward(), pairs, model=_FirstTokenReward())
    for label in (True, False):
        rows = [{"prompt": "abc=", "completion": "cba", "label": label}, {"prompt": "xy=", "completion": "yx",
                                                                           "label": label}]
        assert set(KTO.eval_metrics) <= _evaluated(KTO(reference=FrozenCopy()), rows)
    assert set(GRPO.eval_metrics) <= _evaluated(GRPO(max_completion_length=4), [{"prompt": "abc="}, {"prompt": "xy="}])


def test_an_online_algorithm_defaults_the_objective_to_its_held_out_reward(tmp_path):
    cfg = compose_config("algo=grpo", *FAST, output_dir=tmp_path / "run")
    assert (cfg.objective.metric, cfg.objective.direction) == ("eval/reward", "maximize")
    check_config(cfg)
    cfg = compose_config(*FAST, output_dir=tmp_path / "run")
    assert (cfg.objective.metric, cfg.objective.direction) == ("eval/loss", "minimize")


def test_the_sweep_summary_counts_the_failed_json_of_points_run_elsewhere(tmp_path, capsys):
    """Under submitit the points run in processes of their own: the sweep's process reads their folders."""
    from rlhf.sweeps import points as sweep

    for name, failed in (("0_a", False), ("1_b", True), ("2_c", False)):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        if failed:
            (tmp_path / name / FAILED).write_text(json.dumps({"error": "UserError", "message": "bad value"}))
    sweep.SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert capsys.readouterr().err.strip() == "1 of 3 points failed: 1_b: bad value"
    assert sweep.failed_points() == 1
    sweep._failures.clear()


@pytest.mark.serial
def test_a_point_whose_process_dies_is_a_failed_point_under_submitit(tmp_path, monkeypatch):
    """launcher=submitit_local, one point per batch: point 0 kills its own process (SIGKILL, as the out-of-memory
    killer does) at its first training step, point 1 (the next batch) trains. Before dead jobs were collected as
    failed points, submitit's UncompletedJobError ended the sweep after point 0: no closing line, point 1 never
    launched. Started from another working directory, with the packages (not the repository root) on the path:
    the jobs still load the launcher, which lives beside train.py. ~25 s (two jobs one after the other)."""
    path = tmp_path / "path"
    path.mkdir()
    for package in ("rlhf", "tests"):
        (path / package).symlink_to(ROOT / package)
    monkeypatch.setenv("PYTHONPATH", str(path))
    sweep_dir = tmp_path / "sweep"
    out = run("-m", "launcher=submitit_local", "algo=sft", "algo._target_=tests.dying_loss.DieAt", "+algo.call=0,null",
              "hydra.sweeper.max_batch_size=1", *FAST, f"hydra.sweep.dir={sweep_dir}",
              "hydra.job.config.override_dirname.exclude_keys=[launcher,algo,algo._target_,"
              + ",".join(o.split("=")[0] for o in FAST) + "]", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    dead, finished = sweep_dir / "0_+algo.call=0", sweep_dir / "1_+algo.call=null"
    record = json.loads((dead / FAILED).read_text())
    assert record["error"] == "ProcessDied", record
    assert record["message"].startswith("the process ended without a result: killed (out of memory?)"), record
    assert str(sweep_dir / ".submitit") in record["message"]  # where its log is
    assert (finished / "summary.json").is_file() and not (finished / FAILED).exists(), out.stderr[-3000:]
    closing = out.stderr.strip().splitlines()[-1]
    assert closing.startswith("1 of 2 points failed: 0_+algo.call=0: the process ended without a result"), closing


def test_the_reason_of_a_dead_point_is_the_line_of_its_log_that_names_the_trouble():
    """What a Slurm job killed at its first step (SIGKILL) left in its error log (measured), a segfault, and a log
    that names no trouble. Instant."""
    from rlhf.launch.sweep_launchers import last_log_line

    slurm = ("[2026-11-25 04:05:03,759][rlhf.run.loop][INFO] - step 0: eval/exact_match 0 | eval/loss 5.574\n"
             "training:   0%|          | 0/3 [00:00<?, ?it/s]srun: error: localhost: task 0: Killed\n"
             "srun: Force Terminated StepId=2.0\n")
    assert last_log_line(slurm) == "srun: error: localhost: task 0: Killed"
    segfault = "step 0: eval/loss 5.574\nFatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
    assert last_log_line(segfault) == "Fatal Python error: Segmentation fault"
    quiet = "step 0: eval/loss 5.574\rtraining:  33%|###3      | 1/3 [00:01<00:03,  1.52s/it, loss=5.5610]\n\n"
    assert last_log_line(quiet) == "step 0: eval/loss 5.574"
    assert last_log_line("") == ""


def test_the_generation_evaluation_metrics_are_objectives_only_with_it(tmp_path):
    """``objective.metric=eval/gen/kl`` is a metric the run reports with ``eval=generate``, and refused without it,
    with the fix named."""
    options = ("objective.metric=eval/gen/rewards/similarity", "objective.direction=maximize")
    check_config(compose_config("eval=generate", *options, output_dir=tmp_path))
    with pytest.raises(UserError, match="Fix: eval=generate"):
        check_config(compose_config(*options, output_dir=tmp_path))
    with pytest.raises(UserError, match="do not report it"):  # no win rate without greedy completions
        check_config(compose_config("eval=generate", "eval.greedy=false", "eval.win_rate=false",
                                    "objective.metric=eval/gen/win_rate", "objective.direction=maximize",
                                    output_dir=tmp_path))
