import pytest
from datasets import Dataset

from rlhf.core.errors import UserError
from rlhf.data.encoding import CHAT, FORMAT_COLUMN, TEXT, WHOLE_CHAT
from rlhf.data.formats import standardize
from rlhf.models.tokenizer import byte_tokenizer

PREF = ("prompt", "chosen", "rejected")
SFT = ("prompt", "completion")


def test_standard_preference_rows_pass_through():
    ds = Dataset.from_list([{"prompt": "q", "chosen": "a", "rejected": "b"}])
    assert standardize(ds, PREF, byte_tokenizer())[0] == {"prompt": "q", "chosen": "a", "rejected": "b",
                                                              FORMAT_COLUMN: TEXT}


def test_implicit_prompt_is_the_shared_beginning():
    ds = Dataset.from_list([{"chosen": "Q: why? A: because", "rejected": "Q: why? A: no idea"}])
    row = standardize(ds, PREF, byte_tokenizer())[0]
    assert row == {"prompt": "Q: why? A: ", "chosen": "because", "rejected": "no idea", FORMAT_COLUMN: TEXT}


def test_conversational_preference_uses_the_chat_template():
    tok = byte_tokenizer()
    ds = Dataset.from_list([{
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go away"}],
    }])
    row = standardize(ds, PREF, tok)[0]
    assert row["prompt"] == "<|user|>\nhi\n<|assistant|>\n"  # with the generation prompt
    # each answer is the whole conversation, as the template renders it (rlhf.data.encoding splits it as TRL does)
    assert row["chosen"] == "<|user|>\nhi\n<|assistant|>\nhello\n" and row[FORMAT_COLUMN] == CHAT
    assert row["rejected"] == "<|user|>\nhi\n<|assistant|>\ngo away\n"


def test_messages_and_text_become_prompt_completion():
    tok = byte_tokenizer()
    messages = Dataset.from_list([{"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}])
    row = standardize(messages, SFT, tok)[0]
    # the prompt for generating (the conversation before the last answer); every token is trained (TRL's
    # conversational language modeling)
    assert row["prompt"] == "<|user|>\n2+2\n<|assistant|>\n" and row[FORMAT_COLUMN] == WHOLE_CHAT
    assert row["completion"] == "<|user|>\n2+2\n<|assistant|>\n4\n"
    text = standardize(Dataset.from_list([{"text": "plain"}]), SFT, tok)[0]
    assert text == {"prompt": "", "completion": "plain", FORMAT_COLUMN: TEXT}


def test_an_online_rows_reward_columns_pass_through_as_they_are_beside_a_conversational_prompt():
    """A reference answer for a reward function is no assistant turn: no template renders it."""
    tok = byte_tokenizer()
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "2+2"}], "answer": "4"}])
    row = standardize(ds, ("prompt",), tok, optional=("answer",))[0]
    assert row == {"prompt": "<|user|>\n2+2\n<|assistant|>\n", "answer": "4", FORMAT_COLUMN: CHAT}
    text = standardize(Dataset.from_list([{"prompt": "2+2=", "answer": "4"}]), ("prompt",), tok, optional=("answer",))
    assert text[0] == {"prompt": "2+2=", "answer": "4", FORMAT_COLUMN: TEXT}


def test_an_online_rows_messages_are_its_prompt_and_its_reward_columns_pass_through():
    """A ``messages`` row for an online algorithm: the conversation (up to its last answer, if it ends with one) is
    the prompt, and the reward columns beside it are kept (they were lost: KeyError, and a conversation ending in a
    user turn became an empty prompt)."""
    tok = byte_tokenizer()
    asked = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]
    ds = Dataset.from_list([{"messages": asked, "answer": "4"},
                            {"messages": [*asked, {"role": "assistant", "content": "5"}], "answer": "4"}])
    rows = standardize(ds, ("prompt",), tok, optional=("answer",))
    expected = {"prompt": "<|system|>\nbe brief\n<|user|>\n2+2\n<|assistant|>\n", "answer": "4", FORMAT_COLUMN: CHAT}
    assert rows[0] == expected and rows[1] == expected


def test_missing_columns_name_the_problem_and_the_fix():
    ds = Dataset.from_list([{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"columns \['question', 'answer'\].*prompt/chosen/rejected.*Fix"):
        standardize(ds, PREF, byte_tokenizer())


def test_conversational_data_without_chat_template_is_refused():
    tok = byte_tokenizer()
    tok.chat_template = None
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}])
    with pytest.raises(UserError, match="chat template"):
        standardize(ds, SFT, tok)


def test_a_conversation_the_chat_template_refuses_names_its_row():
    tok = byte_tokenizer()
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
                             "_row": "data.path=d.jsonl, row 3 (counting from 1)"}])
    with pytest.raises(UserError, match=r"^data.path=d.jsonl, row 3 \(counting from 1\): the tokenizer's chat template "
                                        r"refused this conversation \(Conversation roles must alternate"):
        standardize(ds, SFT, tok)


def test_the_row_origin_column_is_kept_and_not_listed_as_a_data_column():
    ds = Dataset.from_list([{"prompt": "q", "completion": "a", "_row": "data.path=d.csv, row 1"}])
    assert standardize(ds, SFT, byte_tokenizer())[0] == {"prompt": "q", "completion": "a", FORMAT_COLUMN: TEXT,
                                                          "_row": "data.path=d.csv, row 1"}
    with pytest.raises(UserError, match=r"has columns \['prompt', 'completion'\], but this algorithm needs"):
        standardize(ds, PREF, byte_tokenizer())
