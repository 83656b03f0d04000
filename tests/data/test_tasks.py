import random

from rlhf.data.tasks import SEPARATOR, ReverseTask


def test_train_and_eval_strings_never_overlap_whatever_the_seed():
    a, b = ReverseTask(num_train=2000, num_eval=100, seed=1), ReverseTask(num_train=2000, num_eval=100, seed=2)
    assert not set(a.words("train")) & set(b.words("eval"))
    assert not set(a.words("eval")) & set(a.words("train"))
    assert len(set(a.words("train"))) == 2000


def test_rows_are_deterministic_and_answers_are_reversals():
    task = ReverseTask(num_train=50, num_eval=10)
    rows = task.rows("train", ("prompt", "chosen", "rejected"))
    assert rows == ReverseTask(num_train=50, num_eval=10).rows("train", ("prompt", "chosen", "rejected"))
    for row in rows:
        assert row["prompt"].endswith(SEPARATOR)
        assert row["chosen"] == row["prompt"][:-1][::-1]
        assert row["rejected"] != row["chosen"]
    assert task.reward([r["prompt"] for r in rows[:2]], [rows[0]["chosen"], rows[1]["rejected"]]) == [1.0, 0.0]


def test_corruptions_are_always_wrong_even_for_short_answers():
    rng = random.Random(0)
    for answer in ["a", "aa", "ab", "aba", "abc"]:
        for _ in range(100):
            assert ReverseTask.corrupt(answer, rng) != answer


def test_load_gives_the_requested_format():
    splits = ReverseTask(num_train=8, num_eval=4).load(("prompt", "completion"))
    assert splits["train"].column_names == ["prompt", "completion"] and len(splits["eval"]) == 4
    assert ReverseTask(num_train=8, num_eval=4).load(("prompt",))["train"].column_names == ["prompt"]
