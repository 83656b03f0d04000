import dataclasses

import pytest
from omegaconf import OmegaConf

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from rlhf.run.train_settings import TrainSettings
from tests.conftest import CONF, compose_config


def settings(**changes) -> TrainSettings:
    """The shipped train: block of conf/config.yaml, with `changes`."""
    block = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml").train)
    return TrainSettings(**{**block, **changes})


def test_train_block_is_written_once_in_the_config():
    """The defaults live in conf/config.yaml only: every field there, none with a second default in the class."""
    block = OmegaConf.load(CONF / "config.yaml").train
    fields = dataclasses.fields(TrainSettings)
    assert [f.name for f in fields] == list(block)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)


def test_every_field_has_declared_limits_or_a_type_that_is_enough():
    declared = set(TrainSettings.__limits__)
    checked_elsewhere = {"eval_at_start", "save_final", "on_nonfinite", "profile_memory", "memory_check",
                         "nonfinite_on_device"}  # bools;
    # choices checked across fields
    assert declared | checked_elsewhere == {f.name for f in dataclasses.fields(TrainSettings)}


def test_check_config_applies_the_limits_without_adding_a_target(tmp_path):
    cfg = compose_config("train.max_grad_norm=null", output_dir=tmp_path)
    check_config(cfg)
    assert "_target_" not in cfg.train
    for override, message in [("train.eval_batch_size=0", "train.eval_batch_size=0 must be a whole number >= 1"),
                              ("train.per_device_batch_size=2.5", "train.per_device_batch_size=2.5 is a float"),
                              ("train.max_grad_norm=0", "train.max_grad_norm=0 must be > 0"),
                              ("train.num_epochs=2", "set exactly one of them"),
                              ("train.on_nonfinite=ignore", "is not one of ['skip', 'stop']"),
                              ("train.nonfinite_on_device=gpu", "expects bool or null"),
                              ("train.memory_check=maybe", "is not one of ['refuse', 'warn', 'off']")]:
        with pytest.raises(UserError) as refused:
            check_config(compose_config(override, output_dir=tmp_path))
        assert message in str(refused.value), override


def test_global_batch_size_derives_accumulation_and_refuses_what_does_not_fit():
    assert settings(per_device_batch_size=4, global_batch_size=16).accumulation_steps(2) == 2
    assert settings(per_device_batch_size=4, global_batch_size=16).accumulation_steps(1) == 4
    assert settings(per_device_batch_size=4, grad_accumulation_steps=3).accumulation_steps(2) == 3
    assert settings(per_device_batch_size=4).accumulation_steps(2) == 1
    with pytest.raises(UserError, match=r"global_batch_size=12 is not a multiple of .* 4 x 2 = 8"):
        settings(per_device_batch_size=4, global_batch_size=12).accumulation_steps(2)
    with pytest.raises(UserError, match=r"grad_accumulation_steps=3 disagrees with train.global_batch_size=16"):
        settings(per_device_batch_size=4, grad_accumulation_steps=3, global_batch_size=16).accumulation_steps(2)


def test_steps_come_from_max_steps_or_from_epochs():
    assert settings(max_steps=7).steps(micro_batches_per_epoch=100, accumulation=3) == 7
    epochs = settings(max_steps=None, num_epochs=3)
    assert epochs.steps(micro_batches_per_epoch=16, accumulation=2) == 24
    assert epochs.steps(micro_batches_per_epoch=5, accumulation=2) == 7  # 15 micro-batches: the last one left over
    with pytest.raises(UserError, match=r"train.num_epochs=1 is less than one optimizer step"):
        settings(max_steps=None, num_epochs=1).steps(micro_batches_per_epoch=1, accumulation=2)
