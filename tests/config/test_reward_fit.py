"""Rewards against the data they would score: a generated task's prompts are asked as a file's are."""

from __future__ import annotations

import pytest

from rlhf.config.checks import check_config
from rlhf.core.errors import UserError
from tests.conftest import compose_config


def test_the_embedded_tasks_reward_on_the_sums_task_is_refused_and_the_sums_reward_accepted(tmp_path):
    """Before, only data.path was asked: algo=grpo data=sums trained on exact_match (the prompt reversed), a reward
    of 0 for every completion."""
    with pytest.raises(UserError, match=r"^algo.reward_funcs: the algorithm trains on exact_match, the embedded "
                                        r"task's reward \(the prompt reversed\), but data.task \(SumsTask\) asks "
                                        r"other questions.*Fix: "):
        check_config(compose_config("algo=grpo", "data=sums", output_dir=tmp_path))
    with pytest.raises(UserError, match=r"^algo.reward_funcs: the algorithm trains on sum_answer, a reward for "
                                        r"another task's prompts .* but data.task \(ReverseTask\) asks other"):
        check_config(compose_config("algo=grpo", "algo/reward_funcs=sum_answer", output_dir=tmp_path))
    check_config(compose_config("algo=grpo", "data=sums", "algo/reward_funcs=sum_answer", output_dir=tmp_path))
    check_config(compose_config("algo=dpo", "data=sums", output_dir=tmp_path))  # no reward: nothing to refuse
