"""rlhf/config/tuned_defaults.py: the defaults that differ from TRL's, the same in conf/, in the docs and in the
start-up warning for a model other than the embedded one."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlhf.config import tuned_defaults
from rlhf.config.tuned_defaults import DEFAULTS, markdown_table, warning
from rlhf.models.tokenizer import VOCAB_SIZE
from tests.conftest import CONF, ROOT, compose_config

_CASES = [(row, option, value) for row in DEFAULTS for option, value in row.ours.items()]


@pytest.mark.parametrize(("row", "option", "value"), _CASES,
                         ids=[f"{row.key}-{option or 'defaults'}" for row, option, _ in _CASES])
def test_each_default_in_the_table_is_what_conf_composes_to(row, option, value):
    """Red when a YAML's default changes and the table (hence the docs and the warning) does not."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[option] if option else [], return_hydra_config=True)
    if row.group:
        assert cfg.hydra.runtime.choices[row.key] == value
    else:
        assert OmegaConf.select(cfg, row.key, default="absent") == value


def test_the_docs_table_is_the_tables():
    page = (ROOT / "docs" / "coming_from_trl.md").read_text()
    start = page.index("<!-- generated from rlhf/config/tuned_defaults.py")
    generated = page[page.index("\n", start) + 1:page.index("<!-- end of the generated table -->")].strip()
    assert generated == markdown_table(), "docs/coming_from_trl.md: paste tuned_defaults.markdown_table() in"
    for row in DEFAULTS:  # every row, and every value of it
        for value in row.ours.values():
            assert f"| `{row.key}={tuned_defaults.show(value)}` |" in generated


DPO_ON_SMOLLM2 = ("defaults tuned on the embedded tiny model, not for model=smollm2-135m: algo.beta=0.3 (TRL DPOConfig: "
                  "0.1), optimizer.lr=1e-4 (TRL DPOConfig: 1e-6), scheduler.num_warmup_steps=10 (TRL: 0). Set them on "
                  "the command line, e.g. TRL's: algo.beta=0.1 optimizer.lr=1e-6 scheduler.num_warmup_steps=0 "
                  "(docs/coming_from_trl.md lists every default that differs from TRL's, and why)")


def test_another_model_with_the_tuned_defaults_gets_one_line_naming_each_with_trls_value():
    """The default DPO run on model=smollm2-135m names beta, the learning rate and the warmup; the docs show that
    line (red: no line, or one that names another set)."""
    cfg = compose_config("model=smollm2-135m")
    assert warning(cfg, ["model=smollm2-135m"], model="smollm2-135m") == DPO_ON_SMOLLM2
    assert DPO_ON_SMOLLM2 in (ROOT / "docs" / "coming_from_trl.md").read_text()
    assert warning(cfg, None, model="smollm2-135m") == DPO_ON_SMOLLM2  # from Python: the values alone decide
    assert warning(compose_config("model=tiny"), []) is None  # the model they were tuned on


def test_what_the_user_or_the_experiment_set_is_not_named(tmp_path):
    cfg = compose_config("model=smollm2-135m", "algo.beta=0.3", "optimizer.lr=1e-6")
    line = warning(cfg, ["model=smollm2-135m", "algo.beta=0.3", "+optimizer.lr=1e-6"], model="smollm2-135m")
    assert "algo.beta" not in line and "optimizer.lr" not in line  # 0.3 typed is the user's choice
    assert "scheduler.num_warmup_steps=10 (TRL: 0)" in line
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /algo: grpo\n"
                                                   "scheduler:\n  num_warmup_steps: 10\n")
    cfg = compose_config("model=smollm2-135m", "algo=grpo")
    line = warning(cfg, ["model=smollm2-135m", "experiment=mine"], model="smollm2-135m", folder=conf)
    assert line.split(": ", 1)[1].startswith("optimizer.lr=1e-4 (TRL GRPOConfig: 1e-6), "
                                             "algo.max_completion_length=16 (TRL GRPOConfig: 512).")
    assert warning(compose_config("model=smollm2-135m", "algo=grpo", "optimizer.lr=1e-6", "scheduler=step",
                                  "algo.max_completion_length=256"), None) is None


def test_a_default_equal_to_trls_for_the_algorithm_is_not_named():
    """The reward model's TRL learning rate is 1e-4 too; SFT's is 2e-5; algorithms TRL 1.16 lacks get only the
    TrainingArguments rows."""
    line = warning(compose_config("model=gpt2", "algo=reward"), [])
    assert "optimizer.lr" not in line and "not for openai-community/gpt2: " in line
    assert "optimizer.lr=1e-4 (TRL SFTConfig: 2e-5)" in warning(compose_config("model=gpt2", "algo=sft"), [])
    assert "optimizer.lr=3e-5 (TRL SFTConfig: 2e-5, for AdamW: pick one for this optimizer)" in warning(compose_config("model=gpt2", "algo=sft",
                                                                               "optimizer=lion"), [])
    assert warning(compose_config("model=gpt2", "algo=ppo"), []).split(": ", 1)[1].startswith(
        "scheduler.num_warmup_steps=10 (TRL: 0).")
    assert "algo.beta" not in warning(compose_config("model=gpt2", "algo=simpo"), [])  # the paper's, not tuned here


def test_the_embedded_model_is_told_by_its_spec_or_by_the_folder_a_run_of_it_saved(tmp_path):
    tiny = OmegaConf.to_container(compose_config().model, resolve=False)
    assert tuned_defaults.embedded_model(tiny)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    assert tuned_defaults.embedded_model({**tiny, "name_or_path": str(tmp_path)})  # <run>/final of the tiny model
    assert not tuned_defaults.embedded_model({**tiny, "name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert not tuned_defaults.embedded_model({**tiny, "name_or_path": str(tmp_path)})
    assert not tuned_defaults.embedded_model(OmegaConf.to_container(compose_config("model=smollm2-135m").model,
                                                                    resolve=False))


def test_trls_learning_rate_is_named_as_adamws_for_another_optimizer():
    """TRL's 1e-6 is AdamW's: with SGD or Lion it is no fix to copy (it was offered as one)."""
    cfg = compose_config("model=smollm2-135m", "optimizer=sgd")
    line = tuned_defaults.warning(cfg, ["model=smollm2-135m", "optimizer=sgd"], "smollm2-135m")
    assert "optimizer.lr=0.03 (TRL DPOConfig: 1e-6, for AdamW: pick one for this optimizer)" in line, line
    assert "optimizer.lr=1e-6" not in line
    only = ["model=smollm2-135m", "optimizer=lion", "algo.beta=0.1", "scheduler.num_warmup_steps=0"]
    line = tuned_defaults.warning(compose_config(*only), only, "smollm2-135m")
    assert line.endswith("optimizer.lr=3e-5 (TRL DPOConfig: 1e-6, for AdamW: pick one for this optimizer). Set "
                         "them on the command line (docs/coming_from_trl.md lists every default that differs from "
                         "TRL's, and why)"), line
