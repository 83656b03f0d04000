import json

import pandas as pd
import pytest

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN
from rlhf.data.encoding import FORMAT_COLUMN
from rlhf.data.source import DataSource
from rlhf.data.tasks import ReverseTask
from rlhf.models.tokenizer import byte_tokenizer

ROWS = [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(20)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_of_every_supported_type_load(tmp_path, suffix):
    path = tmp_path / f"prefs{suffix}"
    frame = pd.DataFrame(ROWS)
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    splits = DataSource(path=str(path), eval_size=0.25).load(("prompt", "chosen", "rejected"), byte_tokenizer())
    assert len(splits["train"]) == 15 and len(splits["eval"]) == 5
    # ROW_COLUMN: where it came from; FORMAT_COLUMN: how to tokenize it (rlhf.data.encoding)
    assert set(splits["train"][0]) == {"prompt", "chosen", "rejected", ROW_COLUMN, FORMAT_COLUMN}


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        DataSource(path=str(tmp_path / "nope.jsonl")).load(("prompt", "completion"), byte_tokenizer())


def test_embedded_task_is_used_without_a_path():
    splits = DataSource(task=ReverseTask(num_train=10, num_eval=3)).load(("prompt", "completion"), byte_tokenizer())
    assert (len(splits["train"]), len(splits["eval"])) == (10, 3)


@pytest.mark.parametrize("source", ["task", "file"])
def test_validation_rows_are_part_of_the_held_out_split_and_never_scored_with_the_held_out_figures(source, tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))

    def load(**kwargs):
        if source == "task":
            return DataSource(task=ReverseTask(num_train=30, num_eval=20), **kwargs).load(("prompt", "completion"),
                                                                                          byte_tokenizer())
        return DataSource(path=str(path), eval_size=8, **kwargs).load(("prompt", "chosen", "rejected"), byte_tokenizer())

    whole, held_out = load(), load(validation_size=0.25)
    validation = load(validation_size=0.25, evaluate_on="validation")
    rows = {name: {r["prompt"] for r in splits["eval"]} for name, splits in
            (("whole", whole), ("held_out", held_out), ("validation", validation))}
    assert rows["held_out"].isdisjoint(rows["validation"]) and rows["held_out"] | rows["validation"] == rows["whole"]
    assert len(rows["validation"]) == -(-len(rows["whole"]) // 4)  # a quarter, rounded up
    # the training rows do not depend on which split a run scores
    assert whole["train"]["prompt"] == held_out["train"]["prompt"] == validation["train"]["prompt"]


def test_a_validation_split_that_leaves_no_held_out_row_is_refused():
    with pytest.raises(UserError, match=r"data.validation_size=3 sets aside 3 of the 3 held-out rows, leaving none"):
        DataSource(task=ReverseTask(num_train=10, num_eval=3), validation_size=3).load(("prompt", "completion"),
                                                                                     byte_tokenizer())


def test_a_saved_dataset_dict_folder_loads_with_its_own_eval_split(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS[:12]), "test": Dataset.from_list(ROWS[12:])}).save_to_disk(tmp_path / "d")
    splits = DataSource(path=str(tmp_path / "d"), eval_split="test").load(("prompt", "chosen", "rejected"), byte_tokenizer())
    assert (len(splits["train"]), len(splits["eval"])) == (12, 8)
    with pytest.raises(UserError, match=r"has splits \['train', 'test'\], not 'validation'"):
        DataSource(path=str(tmp_path / "d"), eval_split="validation").load(("prompt", "chosen", "rejected"), byte_tokenizer())


# ---- bad data: one message naming the file, the row, the column and the fix ---------------------------------------
PREF = ("prompt", "chosen", "rejected")
HI = [{"role": "user", "content": "hi"}]


def write(path, rows, columns=PREF):
    """`rows` in the file type of `path`'s extension (a folder: save_to_disk); None is an empty CSV field."""
    from datasets import Dataset

    if path.suffix == ".csv":
        pd.DataFrame(rows, columns=list(columns)).to_csv(path, index=False)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows, columns=list(columns)).to_parquet(path)
    else:
        Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def load(path, columns=PREF, **kwargs):
    source = DataSource(path=str(path), eval_size=1, **kwargs)
    return source, source.load(columns, byte_tokenizer())


@pytest.mark.parametrize("name", ["d.csv", "d.jsonl", "d.json", "d.parquet", "saved"])
def test_a_null_field_stops_with_file_row_column_and_fix_in_every_format(tmp_path, name):
    rows = [dict(r) for r in ROWS[:6]]
    rows[2]["chosen"] = None
    path = write(tmp_path / name, rows)
    counting = "counting data rows from 1, after the header" if name.endswith(".csv") else "counting from 1"
    problem = "is empty" if name.endswith(".csv") else "is null"  # in a CSV file, a missing value is empty text
    with pytest.raises(UserError) as error:
        load(path)
    assert str(error.value).startswith(f"data.path={path}: row 3 ({counting}), column 'chosen' {problem}. Fix: ")
    assert "data.on_bad_row=skip" in str(error.value)


@pytest.mark.parametrize("name", ["d.csv", "d.jsonl", "d.parquet", "saved"])
def test_skip_leaves_bad_rows_out_counts_them_and_logs_once(tmp_path, name, caplog):
    rows = [dict(r) for r in ROWS[:8]]
    rows[1]["rejected"] = rows[1]["chosen"]
    rows[4]["prompt"] = ""
    path = write(tmp_path / name, rows)
    source, splits = load(path, on_bad_row="skip")
    assert source.skipped_rows == 2
    assert len(splits["train"]) + len(splits["eval"]) == 6
    kept = sorted(int(r.split(", row ")[1].split()[0]) for s in splits.values() for r in s[ROW_COLUMN])
    assert kept == [1, 3, 4, 6, 7, 8]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"skipped 2 bad row(s) of 8 in data.path={path}")
    assert "first: row 2 (" in warnings[0] and "column 'rejected' is identical to 'chosen'" in warnings[0]


def test_skipped_rows_add_up_over_both_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    bad = {"prompt": "p", "chosen": "same", "rejected": "same"}
    DatasetDict({"train": Dataset.from_list(ROWS[:5] + [bad]), "test": Dataset.from_list([bad] + ROWS[:3])}
                ).save_to_disk(tmp_path / "d")
    source = DataSource(path=str(tmp_path / "d"), eval_split="test", on_bad_row="skip")
    splits = source.load(PREF, byte_tokenizer())
    assert source.skipped_rows == 2 and (len(splits["train"]), len(splits["eval"])) == (5, 3)
    with pytest.raises(UserError, match=r"data.path=.*d \(split 'train'\): row 6 \(counting from 1\), column "
                                        r"'rejected' is identical to 'chosen'"):
        DataSource(path=str(tmp_path / "d"), eval_split="test").load(PREF, byte_tokenizer())


def test_on_bad_row_is_checked_when_built():
    with pytest.raises(UserError, match="data.on_bad_row='drop' is not one of error, skip"):
        DataSource(path="x.csv", on_bad_row="drop")
    assert DataSource(path="x.csv").on_bad_row == "error"


@pytest.mark.parametrize(("value", "problem"), [
    (3, "is a number, not text or a list of messages"),
    ([{"role": "bot", "content": "x"}], "has message 1 with unknown role 'bot'"),
    ([{"role": "user", "content": ""}], "has message 1 (user) without content"),
    ([{"role": "user"}], "has message 1 (user) without content"),
])
def test_wrong_types_and_bad_conversations_in_json(tmp_path, value, problem):
    rows = [{"prompt": HI, "chosen": [{"role": "assistant", "content": c}], "rejected": [{"role": "assistant",
             "content": "no"}]} for c in "abc"]
    rows[1]["chosen"] = value
    path = write(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=rf"row 2 \(counting from 1\), column 'chosen' {__import__('re').escape(problem)}"):
        load(path)


def test_a_missing_field_in_a_json_row(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "q", "completion": "a"}, {"prompt": "q"}, {"prompt": "r",
                                                                                                "completion": "b"}])
    with pytest.raises(UserError, match=r"row 2 \(counting from 1\), column 'completion' is missing. Fix: give every "
                                        r"row a non-empty 'completion'"):
        load(path, ("prompt", "completion"))


def test_a_conversational_csv_is_read_as_conversations_not_as_json_text(tmp_path):
    rows = [{"prompt": json.dumps(HI), "chosen": json.dumps([{"role": "assistant", "content": f"yes{i}"}]),
             "rejected": json.dumps([{"role": "assistant", "content": "no"}])} for i in range(4)]
    _, splits = load(write(tmp_path / "d.csv", rows))
    row = splits["train"][0]
    assert row["prompt"] == "<|user|>\nhi\n<|assistant|>\n"
    assert row["chosen"].startswith(row["prompt"] + "yes") and row["rejected"] == row["prompt"] + "no\n"


def test_a_messages_csv_trains_on_its_conversations(tmp_path):
    chat = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    path = write(tmp_path / "d.csv", [{"messages": json.dumps(chat)}] * 3, ["messages"])
    _, splits = load(path, ("prompt", "completion"))
    assert splits["train"][0]["prompt"] == "<|user|>\n2+2\n<|assistant|>\n"
    assert splits["train"][0]["completion"] == "<|user|>\n2+2\n<|assistant|>\n4\n"  # all of it is trained


def test_a_csv_column_mixing_conversations_and_text_is_one_error(tmp_path):
    rows = [{"prompt": json.dumps(HI), "completion": "a"}, {"prompt": "plain", "completion": "b"}]
    path = write(tmp_path / "d.csv", rows * 2, ["prompt", "completion"])
    with pytest.raises(UserError, match=r"column 'prompt' mixes lists of messages \(first: row 1\) and plain text "
                                        r"\(first: row 2\), counting data rows from 1, after the header. Fix"):
        load(path, ("prompt", "completion"), on_bad_row="skip")


def test_an_unsupported_extension_names_the_supported_ones(tmp_path):
    (tmp_path / "notes.txt").write_text("prompt,completion\nq,a\n")
    with pytest.raises(UserError, match=r"notes.txt: '.txt' files are not supported. Fix: use a .csv, .json, .jsonl "
                                        r"or .parquet file, a folder written by Dataset.save_to_disk"):
        load(tmp_path / "notes.txt")
    with pytest.raises(UserError, match=r"no such file or folder.*Note: '.txt' files are not supported either"):
        load("data/absent.txt")


@pytest.mark.parametrize(("name", "content", "message"), [
    ("d.csv", b"", r"is empty \(0 bytes\)"),
    ("d.jsonl", b"", r"is empty \(0 bytes\)"),
    ("d.parquet", b"", r"is empty \(0 bytes\)"),
    ("d.csv", b"prompt,chosen,rejected\n", r"has no rows after its header"),
    ("d.json", b"[]", r"has no rows. Fix"),
    ("d.parquet", b"PAR1 not really", r"could not read it \(ArrowInvalid: .*\); it looks truncated or damaged"),
    ("d.jsonl", b'{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "cho', r"looks truncated"),
])
def test_empty_truncated_or_damaged_files_get_one_message(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=rf"data.path={tmp_path / name}:? {message}"):
        load(tmp_path / name)


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_a_folder_whose_data_file_holds_no_rows_names_the_file(tmp_path, content):
    """A folder of data files read by ``datasets`` (red before: its StopIteration traceback)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(content)
    with pytest.raises(UserError, match=rf"data.path={tmp_path / 'data'}: a data file in this folder holds no rows "
                                        r"\(train.jsonl\). Fix: remove the empty file"):
        load(tmp_path / "data")


def test_an_empty_parquet_file_and_a_truncated_saved_folder(tmp_path):
    path = write(tmp_path / "d.parquet", [], PREF)
    with pytest.raises(UserError, match=r"d.parquet has no rows"):
        load(path)
    path = write(tmp_path / "saved", ROWS)
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    with pytest.raises(UserError, match=r"saved: could not read it .*; it looks truncated or damaged"):
        load(path)


def test_the_embedded_task_names_its_rows_too():
    splits = DataSource(task=ReverseTask(num_train=4, num_eval=2)).load(("prompt", "completion"), byte_tokenizer())
    assert splits["eval"][1][ROW_COLUMN] == "the embedded task (eval split), row 2 (counting from 1)"


def test_a_row_without_room_for_a_completion_token_stops_tokenization_as_a_user_error(tmp_path):
    from rlhf.algos.sft import SFT

    rows = [{"prompt": "q" * (40 if i == 2 else 3), "completion": "a"} for i in range(5)]
    _, splits = load(write(tmp_path / "d.csv", rows, ["prompt", "completion"]), ("prompt", "completion"))
    tokenize = SFT(max_prompt_length=None, max_length=16).tokenize
    with pytest.raises(UserError, match=rf"^data.path={tmp_path / 'd.csv'}, row 3 \(counting data rows from 1, after "
                                        r"the header\): not one token of 'completion' fits in algo.max_length=16"):
        splits.map(tokenize, fn_kwargs={"tokenizer": byte_tokenizer()}, remove_columns=splits["train"].column_names)
    tokenized = splits.map(SFT(max_prompt_length=8, max_length=16).tokenize, fn_kwargs={"tokenizer": byte_tokenizer()},
                           remove_columns=splits["train"].column_names)  # long prompts are cut, as before
    assert max(len(ids) for ids in tokenized["train"]["input_ids"]) <= 16


def test_a_folder_of_data_files_is_checked_like_a_file(tmp_path):
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "train.jsonl", [*ROWS[:3], {"prompt": "q", "chosen": "a", "rejected": None}])
    with pytest.raises(UserError, match=r"data.path=.*data \(split 'train'\): row 4 \(counting from 1\), column "
                                        r"'rejected' is null"):
        load(tmp_path / "data")


# ---- issue 19: answers that are not the assistant's, a held-out size that takes every row ------------------------
def _chat(*turns):
    return [{"role": role, "content": content} for role, content in turns]


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_a_dpo_answer_from_the_user_is_refused_or_skipped_naming_the_row(tmp_path, name):
    rows = [{"prompt": _chat(("user", f"q{i}")), "chosen": _chat(("assistant", "good")),
             "rejected": _chat(("assistant", "bad"))} for i in range(6)]
    rows[3]["chosen"] = _chat(("user", "good"))
    path = write(tmp_path / name, rows)
    with pytest.raises(UserError) as error:
        load(path)
    assert str(error.value).startswith(f"data.path={path}: row 4 (counting from 1), column 'chosen' ends with a "
                                       "'user' message, not the assistant's answer. Fix: write 'chosen' as the "
                                       "assistant's answer")
    source, splits = load(path, on_bad_row="skip")
    assert source.skipped_rows == 1 and len(splits["train"]) + len(splits["eval"]) == 5


def test_an_sft_conversation_that_does_not_end_with_the_assistant_is_refused_or_skipped(tmp_path):
    rows = [{"messages": _chat(("user", f"q{i}"), ("assistant", "a"))} for i in range(5)]
    rows[1]["messages"] = _chat(("user", "q"), ("assistant", "a"), ("user", "and?"))
    path = write(tmp_path / "chat.jsonl", rows, columns=("messages",))
    with pytest.raises(UserError, match=r": row 2 \(counting from 1\), column 'messages' ends with a 'user' message, "
                                        r"not the assistant's answer. Fix: end each conversation with the assistant's"):
        load(path, columns=("prompt", "completion"))
    source, splits = load(path, columns=("prompt", "completion"), on_bad_row="skip")
    assert source.skipped_rows == 1 and len(splits["train"]) + len(splits["eval"]) == 4
    source = DataSource(path=path, eval_size=1)  # an algorithm that takes prompts only: no answer to end with
    source.load_raw(("prompt",))
    assert source.skipped_rows == 0


@pytest.mark.parametrize(("size", "held_out"), [(20, 20), (25, 20), (0.99, 20)])
def test_a_held_out_size_that_takes_every_row_is_refused_once_the_rows_are_known(tmp_path, size, held_out):
    path = write(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(UserError) as error:
        DataSource(path=path, eval_size=size).load(PREF, byte_tokenizer())
    assert str(error.value) == (f"data.eval_size={size} holds out {held_out} of the 20 rows of data.path={path}, "
                                "leaving none to train on. Fix: a smaller data.eval_size: a fraction such as 0.05, "
                                "or a count below 20.")
    splits = DataSource(path=path, eval_size=19).load(PREF, byte_tokenizer())
    assert (len(splits["train"]), len(splits["eval"])) == (1, 19)


MAPPED = {"prompt": "question", "chosen": "good", "rejected": "bad"}


@pytest.mark.parametrize("name", ["d.csv", "d.jsonl", "d.json", "d.parquet", "saved"])
def test_data_columns_maps_the_datas_own_names_in_every_format(tmp_path, name):
    rows = [{"question": f"q{i}", "good": f"a{i}", "bad": f"b{i}", "prompt": "not this one"} for i in range(4)]
    path = write(tmp_path / name, rows, ("question", "good", "bad", "prompt"))
    splits = DataSource(path=str(path), eval_size=1, columns=MAPPED).load(PREF, byte_tokenizer())
    row = sorted([*splits["train"], *splits["eval"]], key=lambda r: r["prompt"])[0]
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("q0", "a0", "b0")  # the named column, not `prompt`


@pytest.mark.parametrize(("columns", "message"), [
    ({"prompt": "question", "chosen": "good", "rejected": "nope"},
     r"has no column 'nope' \(data.columns.rejected=nope\); its columns are \['question', 'good', 'bad'\]. Fix: "
     r"data.columns.rejected=<one of them>"),
    ({"prompts": "question"}, r"data.columns names \['prompts'\], which no algorithm takes"),
    ({"prompt": "good", "chosen": "good"}, r"gives the data's column 'good' to more than one name"),
    ({"chosen": "good"}, r"name them: data.columns=\{rejected:<its name>\}"),
])
def test_data_columns_is_checked_before_anything_loads(tmp_path, columns, message):
    from rlhf.config.checks import check_config
    from tests.conftest import compose_config

    path = write(tmp_path / "d.jsonl", [{"question": "q", "good": "a", "bad": "b"}] * 3, ("question", "good", "bad"))
    mapping = "{" + ",".join(f"{k}:{v}" for k, v in columns.items()) + "}"
    with pytest.raises(UserError, match=message):
        check_config(compose_config("algo=dpo", f"data.path={path}", f"data.columns={mapping}", output_dir=tmp_path))
    with pytest.raises(UserError, match=r"data.columns renames the columns of data of one's own, but data.path is null"):
        check_config(compose_config("algo=dpo", "data.columns={prompt:question}", output_dir=tmp_path))
