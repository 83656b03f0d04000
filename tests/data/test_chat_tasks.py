import random

import pytest

from rlhf.algos.reward_funcs import exact_match, score, sum_answer
from rlhf.core.errors import UserError
from rlhf.data.chat_tasks import SumsTask, first_number
from rlhf.data.encoding import CHAT, FORMAT_COLUMN
from rlhf.data.source import DataSource
from rlhf.models.tokenizer import byte_tokenizer

PREF = ("prompt", "chosen", "rejected")


def _question(row) -> str:
    return row["prompt"][-1]["content"]


def test_held_out_questions_never_appear_in_training_in_either_order_whatever_the_seed():
    one, other = SumsTask(num_train=3000, num_eval=200, seed=1), SumsTask(num_train=3000, num_eval=200, seed=2)
    held_out = {frozenset(p) for p in other.pairs("eval")}  # unordered pairs: 37 + 48 and 48 + 37 are one
    trained = {frozenset(p) for p in one.pairs("train")}
    assert not held_out & trained
    assert len(set(one.pairs("train"))) == 3000 and len(set(one.pairs("eval"))) == 200
    # the worked examples before every question are training questions too
    shown = one.examples()[0::2]
    assert all(not one.is_eval(*map(int, t["content"].split("? ")[0].removeprefix("What is ").split(" + ")))
               for t in shown)


def test_rows_are_deterministic_conversations_whose_answer_is_the_sum():
    rows = SumsTask(num_train=40, num_eval=8).rows("train", ("prompt", "completion"))
    assert rows == SumsTask(num_train=40, num_eval=8).rows("train", ("prompt", "completion"))
    assert rows != SumsTask(num_train=40, num_eval=8, seed=1).rows("train", ("prompt", "completion"))
    for row in rows:
        assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "user", "assistant", "user"]  # 2 shots
        assert row["completion"][0]["role"] == "assistant"
        assert int(row["completion"][0]["content"]) == SumsTask.answer(row["prompt"])
    assert SumsTask(shots=0, num_train=4, num_eval=2).rows("eval", ("prompt",))[0]["prompt"][0]["role"] == "user"


def test_rejected_answers_are_plausible_slips_never_the_sum():
    rng = random.Random(0)
    for a, b in [(0, 0), (5, 5), (10, 10), (37, 48), (99, 99), (11, 0)]:
        for _ in range(200):
            wrong = SumsTask.corrupt(a, b, rng)
            assert wrong != a + b and wrong >= 0
            assert abs(wrong - (a + b)) in (1, 10) or sorted(str(wrong)) == sorted(str(a + b)) or \
                wrong == (a % 10 + b % 10) % 10 + 10 * ((a // 10 + b // 10) % 10)  # a carry dropped
    rows = SumsTask(num_train=200, num_eval=8).rows("train", PREF)
    assert all(r["chosen"] != r["rejected"] and r["rejected"][0]["role"] == "assistant" for r in rows)


def test_the_reward_reads_the_first_whole_number_of_the_reply_against_the_last_question():
    prompt = [{"role": "user", "content": "What is 3 + 4? Reply with the number only."},
              {"role": "assistant", "content": "7"},
              {"role": "user", "content": "What is 37 + 48? Reply with the number only."}]
    rendered = byte_tokenizer().apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    replies = ["85", " 85\n", "The answer is 85.", "58", "84", "85 + 1 = 86", "37 + 48 = 85", "", "eighty-five"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert sum_answer([rendered] * len(replies), replies) == expected  # as online algorithms hand prompts over
    assert SumsTask.reward([prompt] * len(replies), replies) == expected  # as message lists
    assert first_number("It is 1,085.") == 1085 and first_number("none") is None
    assert sum_answer(["abc="], ["cba"]) == [None]  # not this task's prompt: the reward does not apply
    reward, per_function = score({"sum_answer": sum_answer}, None, [rendered, rendered], ["85", "86"])
    assert reward.tolist() == [1.0, 0.0] and per_function.shape == (2, 1)


def test_the_reward_fits_only_this_tasks_prompts():
    assert sum_answer.fits_prompt("What is 1 + 2? Reply with the number only.")
    assert not sum_answer.fits_prompt("abc=") and not sum_answer.fits_prompt("What is love?")
    assert not exact_match.fits_prompt("What is 1 + 2? Reply with the number only.")


@pytest.mark.parametrize("columns", [("prompt", "completion"), PREF, ("prompt",), ("prompt", "completion", "label")])
def test_the_rows_go_through_the_data_layer_with_the_chat_template(columns):
    splits = DataSource(task=SumsTask(num_train=12, num_eval=4)).load(columns, byte_tokenizer())
    rows_per_question = 2 if "label" in columns else 1  # unpaired rows: a desirable and an undesirable one per pair
    assert len(splits["train"]) == 12 * rows_per_question and len(splits["eval"]) == 4 * rows_per_question
    row = splits["eval"][0]
    assert row[FORMAT_COLUMN] == CHAT and row["prompt"].endswith("Reply with the number only.\n<|assistant|>\n")
    answer = str(SumsTask.answer(row["prompt"]))
    for column in set(columns) & {"completion", "chosen"}:
        assert row[column] == row["prompt"] + answer + "\n"  # the whole conversation, the answer last
    if "rejected" in columns:
        assert row["rejected"].startswith(row["prompt"]) and row["rejected"] != row["chosen"]


def test_too_many_questions_for_the_range_is_refused_naming_the_fix():
    with pytest.raises(UserError, match="num_eval=107 or less"):
        SumsTask(min_operand=1, max_operand=30, eval_one_in=8).pairs("eval")
    with pytest.raises(UserError, match="min_operand"):
        SumsTask(min_operand=5, max_operand=4)
