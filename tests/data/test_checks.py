import pytest

from rlhf.core.errors import UserError
from rlhf.data.checks import (
    MISSING,
    Origin,
    RowProblem,
    check_on_bad_row,
    check_rows,
    conversation_problem,
    row_problem,
    settle,
    value_problem,
)

PREF = ("prompt", "chosen", "rejected")
CSV = Origin("data.path=d.csv", header=True)
JSONL = Origin("data.path=d.jsonl")


def chat(*turns):
    return [{"role": role, "content": content} for role, content in turns]


@pytest.mark.parametrize(("value", "problem"), [
    (MISSING, "is missing"),
    (None, "is null"),
    ("", "is empty"),
    (" \n\t", "is empty (only whitespace)"),
    (3, "is a number, not text or a list of messages"),
    (True, "is true/false, not text or a list of messages"),
    ({"a": 1}, "is an object, not text or a list of messages"),
    ([], "is an empty list of messages"),
    (["hi"], "has message 1 that is a string, not a {role, content} object"),
])
def test_each_kind_of_bad_field_is_named(value, problem):
    assert value_problem(value, "chosen")[0] == problem


def test_good_fields_pass_and_fixed_kinds_are_enforced():
    assert value_problem("None", "prompt") is None  # the text "None" is text, not a null
    assert value_problem(chat(("user", "hi")), "prompt") is None
    assert value_problem("hi", "messages")[0] == "is text, not a list of messages"
    assert value_problem(chat(("user", "hi")), "text")[0] == "is a list, not text"


@pytest.mark.parametrize(("messages", "problem"), [
    (chat(("user", "hi"), ("bot", "hello")), "has message 2 with unknown role 'bot'"),
    ([{"content": "hi"}], "has message 1 without a role"),
    ([{"from": "human", "value": "hi"}], "has message 1 without a role (it has 'from': ShareGPT style)"),
    (chat(("user", "")), "has message 1 (user) without content"),
    ([{"role": "user"}], "has message 1 (user) without content"),
    ([{"role": "user", "content": None}], "has message 1 (user) without content"),
    ([{"role": "user", "content": 5}], "has message 1 (user) whose content is a number, not text"),
])
def test_conversations_with_unknown_roles_or_no_content_are_bad(messages, problem):
    assert conversation_problem(messages)[0] == problem


def test_a_good_conversation_passes():
    assert conversation_problem(chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"))) is None


def test_chosen_identical_to_rejected_is_bad_for_text_and_conversations():
    same = row_problem(4, {"prompt": "q", "chosen": "a", "rejected": "a"}, PREF)
    assert same == RowProblem(4, "rejected", "is identical to 'chosen'", same.fix)
    assert row_problem(1, {"prompt": "q", "chosen": chat(("assistant", "a")), "rejected": chat(("assistant", "a"))},
                       PREF).problem == "is identical to 'chosen'"
    assert row_problem(1, {"prompt": "q", "chosen": "a", "rejected": "b"}, PREF) is None


def test_the_first_bad_field_of_a_row_is_reported():
    assert row_problem(2, {"prompt": "", "chosen": None}, PREF).column == "prompt"
    assert row_problem(2, {"prompt": "q", "chosen": "a"}, PREF).describe() == "row 2, column 'rejected' is missing"


def test_check_rows_keeps_good_positions_and_lists_bad_rows():
    rows = [(1, {"prompt": "q", "completion": "a"}), (3, {"prompt": "q", "completion": None}),
            (4, {"prompt": "q", "completion": "b"})]
    checked = check_rows(rows, ("prompt", "completion"), JSONL)
    assert checked.kept == [0, 2]
    assert [(p.row, p.column, p.problem) for p in checked.problems] == [(3, "completion", "is null")]


def test_a_column_mixing_conversations_and_text_is_one_error():
    rows = [(1, {"prompt": chat(("user", "q")), "completion": "a"}), (2, {"prompt": "q", "completion": "a"})]
    with pytest.raises(UserError, match=r"data.path=d.csv: column 'prompt' mixes lists of messages \(first: row 1\) "
                                        r"and plain text \(first: row 2\), counting data rows from 1, after the header"):
        check_rows(rows, ("prompt", "completion"), CSV)
    rows = [(1, {"prompt": chat(("user", "q")), "completion": "a"})]  # text in one column, messages in another
    assert check_rows(rows, ("prompt", "completion"), CSV).kept == [0]


def test_settle_raises_for_the_first_bad_row_naming_file_row_column_and_fix():
    problems = [RowProblem(9, "chosen", "is null", "give it a value"), RowProblem(7, "chosen", "is empty", "fill it")]
    with pytest.raises(UserError) as error:
        settle(problems, 40, "error", CSV)
    assert str(error.value) == (
        "data.path=d.csv: row 7 (counting data rows from 1, after the header), column 'chosen' is empty. Fix: fill it "
        "(2 of its 40 rows are bad; data.on_bad_row=skip would leave them out).")


def test_settle_skips_with_a_warning_but_never_leaves_nothing():
    problems = [RowProblem(7, "chosen", "is empty", "fill it")]
    assert settle(problems, 40, "skip", JSONL) == (
        "skipped 1 bad row(s) of 40 in data.path=d.jsonl (data.on_bad_row=skip); first: row 7 (counting from 1), "
        "column 'chosen' is empty")
    assert settle([], 40, "error", JSONL) is None
    with pytest.raises(UserError, match=r"every one of its 1 row\(s\) is bad, so none is left to train on; first: row 7"):
        settle(problems, 1, "skip", JSONL)
    with pytest.raises(UserError, match=r"data.path=d.csv has no rows after its header"):
        settle([], 0, "skip", CSV)


def test_on_bad_row_accepts_error_and_skip_only():
    assert check_on_bad_row("skip") == "skip"
    with pytest.raises(UserError, match=r"data.on_bad_row='ignore' is not one of error, skip. Fix"):
        check_on_bad_row("ignore")


def test_an_answer_must_end_with_the_assistants_message():
    """chosen/rejected/completion written as conversations, and SFT's messages, are what is learned."""
    user_answer = {"prompt": "q", "chosen": chat(("user", "a")), "rejected": chat(("assistant", "b"))}
    assert row_problem(3, user_answer, PREF).describe() == (
        "row 3, column 'chosen' ends with a 'user' message, not the assistant's answer")
    turns = {"messages": chat(("user", "q"), ("assistant", "a"), ("user", "and?"))}
    assert row_problem(1, turns, ("messages",)).column == "messages"
    assert row_problem(1, turns, ("messages",), answers=False) is None  # prompts only (an online algorithm)
    assert row_problem(1, {"messages": chat(("user", "q"), ("assistant", "a"))}, ("messages",)) is None
    assert row_problem(1, {"prompt": chat(("system", "s"), ("user", "q")), "completion": chat(("tool", "x"))},
                       ("prompt", "completion")).problem == "ends with a 'tool' message, not the assistant's answer"
