import json

import pytest

from rlhf.core.errors import UserError
from rlhf.data.checks import Origin
from rlhf.data.readers import decode_conversations, parse_csv, parse_json, read_file, read_text

CSV = Origin("data.path=d.csv", header=True)
JSONL = Origin("data.path=d.jsonl")
HI = [{"role": "user", "content": "hi"}]


def csv_field(value) -> str:
    return '"' + json.dumps(value).replace('"', '""') + '"'


def test_csv_fields_are_always_text_and_rows_count_after_the_header():
    records = parse_csv("prompt,completion\n1,None\n\nNA,\n", CSV)
    assert records.columns == ["prompt", "completion"]
    assert records.rows == [(1, {"prompt": "1", "completion": "None"}), (2, {"prompt": "NA", "completion": ""})]


def test_csv_rows_with_too_many_or_too_few_fields():
    records = parse_csv("prompt,completion\na,b,c\nd\n", CSV)
    assert [(p.row, p.problem) for p in records.problems] == [(1, "has 3 fields but the header has 2")]
    assert records.rows == [(2, {"prompt": "d"})]  # the missing field is reported by the row checks


@pytest.mark.parametrize(("text", "message"), [
    ('prompt,completion\na,"b\n', r"data.path=d.csv looks truncated: it ends inside a quoted field"),
    ("prompt,completion\na,b\nc", r"data.path=d.csv looks truncated: its last row, row 2 \(counting data rows from "
                                  r"1, after the header\), has fewer fields than the header and no line end"),
    ('prompt,completion\na,"b"c\n', r"data.path=d.csv: not valid CSV at line 2 \(',' expected after '\"'\)"),
    ("\nprompt\n", r"data.path=d.csv has no header row"),
    ("prompt,prompt\na,b\n", r"the header names column\(s\) \['prompt'\] more than once"),
])
def test_damaged_csv_files_get_one_message(text, message):
    with pytest.raises(UserError, match=message):
        parse_csv(text, CSV)


def test_json_lines_and_json_lists_give_numbered_rows():
    lines = parse_json('{"prompt": "a"}\n\n{"prompt": null, "text": 3}\n', JSONL)
    assert lines.rows == [(1, {"prompt": "a"}), (2, {"prompt": None, "text": 3})]
    assert lines.columns == ["prompt", "text"]
    assert parse_json('[{"prompt": "a"}, {"prompt": "b"}]', JSONL).rows == [(1, {"prompt": "a"}), (2, {"prompt": "b"})]


def test_json_rows_that_are_not_objects_or_not_json_are_bad_rows():
    records = parse_json('{"prompt": "a"}\n[1, 2]\n{"prompt": \n{"prompt": "b"}\n', JSONL)
    assert [(p.row, p.problem.split(" (")[0]) for p in records.problems] == [
        (2, "is a list, not an object"), (3, "is not valid JSON")]
    assert [n for n, _ in records.rows] == [1, 4]


@pytest.mark.parametrize(("text", "message"), [
    ('{"prompt": "a"}\n{"prompt": "b', r"data.path=d.jsonl looks truncated: its last row, row 2 \(counting from 1\), "
                                       r"is not complete JSON"),
    ('[{"prompt": "a"}, {"pro', r"data.path=d.jsonl: not valid JSON \(line 1, column 20: .*\); the file looks truncated"),
    ('{\n  "prompt": ["a", "b"]\n}\n', r"data.path=d.jsonl holds one JSON object, not rows"),
])
def test_damaged_json_files_get_one_message(text, message):
    with pytest.raises(UserError, match=message):
        parse_json(text, JSONL)


def test_a_csv_column_of_json_conversations_is_decoded():
    records = parse_csv(f"prompt,completion\n{csv_field(HI)},a\n{csv_field(HI)},[not json]\n", CSV)
    decoded = decode_conversations(records, ["prompt", "completion"])
    assert decoded.rows == [(1, {"prompt": HI, "completion": "a"}), (2, {"prompt": HI, "completion": "[not json]"})]


def test_a_conversational_csv_column_with_broken_json_has_bad_rows():
    records = parse_csv(f"messages\n{csv_field(HI)}\n\"[{{\"\"role\"\": \"\"user\"\"\"\n[]\n", CSV)
    decoded = decode_conversations(records, ["messages"])
    assert [(p.row, p.column, p.problem.split(" (")[0]) for p in decoded.problems] == [
        (2, "messages", "is not valid JSON")]
    assert decoded.rows == [(1, {"messages": HI}), (3, {"messages": []})]  # [] is then refused as empty


def test_a_plain_csv_column_keeps_text_that_looks_like_json():
    records = parse_csv('prompt,completion\nq,"[1, 2]"\nq,[]\n', CSV)
    assert decode_conversations(records, ["prompt", "completion"]).rows == records.rows


def test_unreadable_empty_and_binary_files_name_the_file(tmp_path):
    with pytest.raises(UserError, match=r"data.path=x: could not read it \(FileNotFoundError"):
        read_text(str(tmp_path / "nope.csv"), "data.path=x")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(UserError, match=r"data.path=x is empty \(4 bytes\)"):
        read_text(str(tmp_path / "empty.jsonl"), "data.path=x")
    (tmp_path / "binary.csv").write_bytes(b"PAR1\xff\xfe\x00")
    with pytest.raises(UserError, match=r"data.path=x: not UTF-8 text \(byte 4: invalid start byte\), so not a .csv file"):
        read_text(str(tmp_path / "binary.csv"), "data.path=x")


def test_read_file_picks_the_parser_by_extension(tmp_path):
    (tmp_path / "d.csv").write_text("\ufeffprompt\nq\n", encoding="utf-8")  # a byte-order mark is dropped
    records, origin = read_file(str(tmp_path / "d.csv"), "data.path=d.csv")
    assert origin.header and records.rows == [(1, {"prompt": "q"})]
    (tmp_path / "d.json").write_text('[{"prompt": "q"}]')
    records, origin = read_file(str(tmp_path / "d.json"), "data.path=d.json")
    assert not origin.header and records.rows == [(1, {"prompt": "q"})]
