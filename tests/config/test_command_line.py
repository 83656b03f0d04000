"""rlhf/config/command_line.py: an option from the user's own config folder (``hydra.searchpath``) is accepted wherever
the package's are, ``@`` placements included, and a misspelt one is named as it was typed."""

from __future__ import annotations

import pytest

from rlhf.config.checks import check_config
from rlhf.config.command_line import problem, search_folders
from rlhf.core.errors import UserError
from tests.conftest import compose_config

ARITH = """# @package algo
reward_funcs:
  arith:
    _target_: builtins.len
    _partial_: true
reward_weights: null
"""


def test_a_reward_option_of_ones_own_folder_is_accepted_for_eval_and_training(tmp_path, monkeypatch):
    mine = tmp_path / "my_conf"
    (mine / "algo" / "reward_funcs").mkdir(parents=True)
    (mine / "algo" / "reward_funcs" / "arith.yaml").write_text(ARITH)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"prompt": "{i}+{i}=", "chosen": "{2 * i}", "rejected": "0"}}\n' for i in range(4)))
    monkeypatch.chdir(tmp_path)  # Hydra reads a relative file:// search path from the current folder
    search = "hydra.searchpath=[file://my_conf]"
    (tmp_path / "x").mkdir()
    assert search_folders([search, "+hydra.searchpath=['file://x']"]) == [mine.relative_to(tmp_path),
                                                                        tmp_path.relative_to(tmp_path) / "x"]
    assert search_folders(["hydra.searchpath=[file://x,pkg://y]"]) is None  # not a folder here: left to Hydra
    assert problem(["hydra.searchpath=[pkg://y]", "optimizer=mine"]) is None
    evaluated = ["algo=dpo", "eval=generate", search, "algo/reward_funcs@eval=arith", f"data.path={pairs}"]
    assert problem(evaluated) is None
    assert problem(["algo=grpo", search, "algo/reward_funcs=arith"]) is None
    message = problem(["algo=dpo", "eval=generate", search, "algo/reward_funcs@eval=arihh"])
    assert message.startswith("algo/reward_funcs@eval=arihh: conf/algo/reward_funcs/ nor my_conf/algo/reward_funcs/ "
                              "has no option 'arihh'") and "Did you mean algo/reward_funcs@eval=arith?" in message
    # composed, the run's own reward passes the check that refuses the embedded task's on this file
    check_config(compose_config(*[a.replace(search, "hydra.searchpath=[file://" + str(mine) + "]") for a in evaluated],
                                output_dir=tmp_path / "run"))
    with pytest.raises(UserError, match="the embedded task's reward"):
        check_config(compose_config("algo=dpo", "eval=generate", f"data.path={pairs}", output_dir=tmp_path / "run"))


def test_a_misspelt_algorithm_lists_algorithms_only_and_a_dashed_flag_gets_its_override():
    """``algo=dop``: the algorithms, not the files of algo/'s sub-groups (loss/..., reward_funcs/...), before the
    hint; ``--learning_rate 5e-6`` (argparse's style) gets the override it means, through TRL's names where it is one;
    ``train.epochs=3`` the key and the default length it replaces (red: sub-groups listed; Hydra's usage text)."""
    message = problem(["algo=dop"])
    assert message.endswith("Did you mean algo=dpo?") and ", dpo," in message
    assert "loss/" not in message and "reward_funcs/" not in message and "kl_estimator/" not in message
    assert problem(["--learning_rate", "5e-6"]) == (
        "--learning_rate 5e-6: overrides are written key=value, without dashes (Hydra's command line). Fix: "
        "optimizer.lr=5e-6 (learning_rate is TRL's name)")
    assert problem(["--train.max_steps=10"]).endswith("Fix: train.max_steps=10")
    assert problem(["--cfg", "job", "-m", "algo=dpo", "--"]) is None  # Hydra's own flags
    assert problem(["--lr", "5e-6"]).startswith("--lr 5e-6: overrides are written key=value, without dashes "
                                                "(Hydra's command line). Fix: lr=5e-6, but lr is not a config group")
    assert problem(["train.epochs=3"]).endswith("Did you mean train.num_epochs=3 train.max_steps=null?")
    assert problem(["train.epochs=3", "train.max_steps=null"]).endswith("Did you mean train.num_epochs=3?")
