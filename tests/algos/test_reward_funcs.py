"""The reward guide's own files (docs/how-to/your-reward.md) as a user copies them, and an entry of the reward
functions that is not one (rlhf.algos.reward_funcs.functions_and_weights)."""

from __future__ import annotations

import pytest

from rlhf.algos.reward_funcs import functions_and_weights
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from tests.conftest import ROOT, compose_config
from tests.examples.pages import fenced_blocks

GUIDE = ROOT / "docs" / "how-to" / "your-reward.md"


def guide_block(language: str, names: str) -> str:
    """The guide's one ``language`` block whose first two lines name the file ``names``."""
    found = [code for _, code, _ in fenced_blocks(GUIDE.read_text(), (language,))
             if any(line.startswith(f"# {names}") for line in code.splitlines()[:2])]
    assert len(found) == 1, (names, len(found))
    return found[0]


def user_project(tmp_path, monkeypatch, yaml_text: str):
    """The guide's my_rewards.py (importable) and ``yaml_text`` as conf/algo/reward_funcs/mine.yaml in ``tmp_path``."""
    (tmp_path / "my_rewards.py").write_text(guide_block("python", "my_project/my_rewards.py"))
    (tmp_path / "conf" / "algo" / "reward_funcs").mkdir(parents=True)
    (tmp_path / "conf" / "algo" / "reward_funcs" / "mine.yaml").write_text(yaml_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return compose_config("algo=grpo", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "algo/reward_funcs=mine",
                          "algo/scale_rewards=none")


def test_the_guides_files_compose_into_its_two_weighted_functions(tmp_path, monkeypatch):
    cfg = user_project(tmp_path, monkeypatch, guide_block("yaml", "my_project/conf/algo/reward_funcs/mine.yaml"))
    algo = build(cfg.algo)
    assert list(algo.reward_funcs) == ["correct", "short"] and algo.reward_weights == [1.0, 0.1]
    assert algo.reward_funcs["correct"](prompts=["abc="], completions=["cba"]) == [1.0]
    assert algo.reward_funcs["short"](prompts=["abc=", "abc="], completions=["", "x" * 20]) == [1.0, 0.0]
    assert cfg.algo.scale_rewards._target_ == "rlhf.algos.advantages.no_scaling"


def test_a_package_header_below_a_comment_is_named_with_its_fix(tmp_path, monkeypatch):
    """Hydra reads ``# @package`` only above every other line: below the file's comment, the option's keys land one
    level down (algo.reward_funcs.reward_funcs), which was a DictConfig "not callable" at the first rollout."""
    lines = guide_block("yaml", "my_project/conf/algo/reward_funcs/mine.yaml").splitlines()
    header = next(line for line in lines if line.startswith("# @package"))
    swapped = "\n".join([line for line in lines if line != header][:1] + [header] +
                        [line for line in lines if line != header][1:])
    cfg = user_project(tmp_path, monkeypatch, swapped)
    assert set(cfg.algo.reward_funcs) == {"reward_funcs", "reward_weights"}
    with pytest.raises(UserError, match=r"^algo.reward_funcs.reward_funcs is a DictConfig, not a function .*the "
                                        r"file's `# @package algo` is not its first line.*Fix: move `# @package"):
        build(cfg.algo)


def test_an_entry_that_is_not_a_function_is_refused_naming_it():
    assert functions_and_weights({"a": len}, None, "algo") == ({"a": len}, None)
    with pytest.raises(UserError, match=r"^eval.reward_funcs.mine is a dict, not a function \(an entry without "
                                        r"_target_\). Fix: eval.reward_funcs.mine: \{_target_: my_module"):
        functions_and_weights({"mine": {"path": "x"}}, None, "eval")
