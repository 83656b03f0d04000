"""rlhf/config/trl_names.py and the command-line check that reads it: TRL's names get our key, before Hydra composes."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from rlhf.config.command_line import problem
from rlhf.config.trl_names import TRL_NAMES
from tests.conftest import ROOT, compose_config


def test_the_docs_table_is_the_table_the_messages_read():
    page = (ROOT / "docs" / "coming_from_trl.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_0-9]+)` \| (.+) \|$", page, re.M))
    assert {name: where.replace("`", "") for name, where in rows.items()} == TRL_NAMES


@pytest.mark.parametrize("name", sorted(TRL_NAMES))
def test_every_key_the_table_names_exists(name):
    """Each ``a.b=...`` in the table is a key of the config composed with the options the entry names beside it
    (``peft=lora``, ``algo=ppo``), and each ``group=option`` / ``a/b=option`` an option of that group: a renamed key
    makes the table lie (red when a key is renamed)."""
    where = TRL_NAMES[name]
    options = [f"{g}={o}" for g, o in re.findall(r"(?<![\w.])([a-z_/]+)=([a-z_0-9]+)\b", where)]
    for option in options:
        group, value = option.split("=")
        assert (ROOT / "conf" / group / f"{value}.yaml").is_file(), option
    keys = [k for k in re.findall(r"(?<![\w/])([a-z_]+(?:\.[a-z_0-9]+)+)=", where) if not k.startswith("hydra.")]
    algos = [o for o in options if o.startswith("algo=")]
    for key in keys:
        if key.count(".") == 1 and key.startswith("algo.") and not algos:  # a field of some algorithm
            from rlhf.config.command_line import _algo_fields, group_options

            assert any(key[5:] in _algo_fields(o, ROOT / "conf")[0] for o in group_options("algo")), (name, key)
            continue
        cfg = compose_config(*[o for o in options if "/" not in o.split("=")[0]])
        parent, _, leaf = key.rpartition(".")
        assert leaf in OmegaConf.select(cfg, parent), (name, key)


@pytest.mark.parametrize(("argv", "message"), [
    (["learning_rate=1e-5"], "learning_rate=1e-5: learning_rate is TRL's name; here: optimizer.lr=<value>."),
    (["train.num_train_epochs=3"], "train.num_train_epochs=3: train has no key 'num_train_epochs'. num_train_epochs "
                                   "is TRL's name; here: train.num_epochs=<value> train.max_steps=null."),
    (["train.max_step=3"], "train.max_step=3: train has no key 'max_step'. Did you mean train.max_steps=3?"),
    (["algo.loss_type=ipo"], "algo.loss_type=ipo: algo=dpo has no key loss_type. TRL's DPO loss_type is an algorithm "
                             "here, with its loss and defaults (conf/algo/ipo.yaml). Fix: algo=ipo"),
    (["+algo.loss_type=ipo"], "+algo.loss_type=ipo: algo=dpo has no key loss_type. TRL's DPO loss_type is an "
                              "algorithm here"),
    (["algo/loss_type=ipo"], "algo/loss_type=ipo: algo=dpo has no group algo/loss_type. TRL's DPO loss_type is an "
                             "algorithm here"),
    (["algo.loss_type=sigmoid"], "TRL's DPO loss_type is the algo/loss group here (the per-pair loss). Fix: "
                                 "algo/loss=sigmoid"),
    (["algo=grpo", "algo.loss_type=dapo"], "algo.loss_type=dapo: algo/loss_type is a config group. Fix: "
                                           "algo/loss_type=dapo (a slash, not a dot)"),
    (["experiment=grpo_reverse", "algo.loss_type=dapo"], "Fix: algo/loss_type=dapo"),
    (["algo=grpo", "algo/loss=dapo"], "algo/loss=dapo: algo/loss belongs to other algorithms; algo=grpo does not "
                                      "select it. Did you mean algo/loss_type=dapo?"),
    (["algo=sft", "algo.beta=0.1"], "algo.beta=0.1: algo=sft has no option 'beta' (its options: "
                                    "completion_logits_only, completion_only_loss"),
    (["algo.bta=0.1"], "Did you mean algo.beta=0.1?"),
    (["algo.reference=copy"], "Fix: algo/reference=copy (a slash, not a dot)"),
    # a group's node given a whole new value: Hydra's "not in struct" before
    (["algo=grpo", "algo.reward_funcs={mine: {_target_: my.f, _partial_: true}}"],
     "algo.reward_funcs is filled by its config group's options (algo/reward_funcs=<option>, conf/algo/reward_funcs/)"
     ", so a whole new value cannot replace it from the command line. Fix: add one entry, "
     "'+algo.reward_funcs.<name>=<value>', or put the entries in a YAML option of your own config folder"),
])
def test_trl_names_and_confusable_groups_get_the_projects_message(argv, message):
    found = problem(argv)
    assert found is not None and message in found, found


@pytest.mark.parametrize("argv", [["algo.beta=0.2"], ["algo=grpo", "algo/loss_type=dapo"], ["algo=ipo,dpo", "algo.beta=1"],
                                  ["algo=simpo", "algo.loss.gamma=1"], ["algo/reference=precomputed"],
                                  ["algo=grpo", "+algo.reward_funcs.mine={_target_: my.f}"], ["train.max_steps=3"],
                                  ["+algo.not_a_key_anywhere=1"], ["algo=grpo", "algo.reward_weights=null"],
                                  ["algo=grpo", "+algo.reward_funcs.mine._target_=my.f"], ["+algo/my_group=x"],
                                  ["-m", "experiment=grpo_reverse,rloo_reverse", "algo.num_generations=4"]])
def test_what_is_right_or_left_to_the_composed_check_passes(argv):
    assert problem(argv) is None
