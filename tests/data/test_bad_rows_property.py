"""Property: every generated row, in every supported file format, is either trained on as written or refused.

Files of generated rows (good ones and malformed ones: missing, null, empty or mistyped fields, conversations with
unknown roles or no content, answers that do not end with the assistant's message, chosen identical to rejected, a
column mixing conversations and text) go through the
data pipeline as a run sees it: ``DataSource.load`` and the algorithm's ``tokenize`` with the embedded byte
tokenizer. With ``on_bad_row=error`` a file with a bad row must raise a :class:`UserError` naming the file and its
first bad row; with ``skip`` exactly the good rows must come out, each tokenized to the bytes of what was written
(a None never becomes the text "None").
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

import datasets
import pytest
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT
from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN
from rlhf.data.source import DataSource
from rlhf.models.tokenizer import byte_tokenizer

FORMATS = ("csv", "jsonl", "json", "parquet", "saved")
LAYOUTS = {  # algorithm -> the raw column layouts it accepts
    "sft": [("prompt", "completion"), ("messages",), ("text",)],
    "dpo": [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
}
MISSING = "<missing>"  # a field the row does not have (JSON) or leaves empty (CSV), None in Arrow formats
BAD = "bad"
TOKENIZER = byte_tokenizer()
EOS = TOKENIZER.eos_token_id

# Text without "<" (no special-token text such as "<eos>") or "[" (no plain text that reads as JSON in a CSV).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<["), min_size=1, max_size=8).filter(
    str.strip)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
                    min_size=1, max_size=3)
# An answer (completion, chosen, rejected, SFT's messages) must end with the assistant's message.
ANSWERS = ("completion", "chosen", "rejected", "messages")
ANSWER_MESSAGES = MESSAGES.map(lambda m: [*m[:-1], {"role": "assistant", "content": m[-1]["content"]}])

BAD_CONVERSATIONS = [[], [{"role": "bot", "content": "x"}], [{"role": "user"}], [{"content": "x"}],
                     [{"role": "user", "content": None}], [{"role": "user", "content": ""}],
                     [{"role": "user", "content": " \n"}], [{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"}]]
BAD_VALUES = {  # (file format, column style) -> malformed values that format can hold
    ("json", "text"): [MISSING, None, "", "  \t", 3, 2.5, True, ["a"], {"a": "b"}, []],
    ("json", "conversation"): [MISSING, None, "", 3, False, ["hi"], {"role": "user", "content": "x"},
                               [{"role": "user", "content": 5}], *BAD_CONVERSATIONS],
    ("arrow", "text"): [None, "", " "],
    ("arrow", "conversation"): [None, *BAD_CONVERSATIONS],
    ("csv", "text"): [None, "", " \r\n "],
    ("csv", "conversation"): [None, "", "  ", "[not json", '[{"role": "user"', [{"role": "user", "content": 5}],
                              ["hi"], *BAD_CONVERSATIONS],
}
GROUP = {"csv": "csv", "jsonl": "json", "json": "json", "parquet": "arrow", "saved": "arrow"}


@st.composite
def cell(draw, fmt: str, style: str, good: bool = False, answer: bool = False):
    """(value as written, what it must become): ("text", str), ("conversation", messages) or BAD. An `answer`
    conversation that does not end with the assistant's message is BAD."""
    if good or draw(st.integers(0, 4)) > 0:
        value = draw(TEXT if style == "text" else ANSWER_MESSAGES if answer and good else MESSAGES)
        if style == "conversation" and answer and value[-1]["role"] != "assistant":
            return value, BAD
        return value, (style, value)
    return draw(st.sampled_from(BAD_VALUES[GROUP[fmt], style])), BAD


@st.composite
def data_files(draw, fmt: str, algo: str):
    """A file's rows for `algo`, in one of its layouts, and what each row must become."""
    layout = draw(st.sampled_from(LAYOUTS[algo]))
    fixed = {"messages": "conversation", "text": "text"}
    if layout == ("chosen", "rejected"):  # implicit prompt: both answers are written the same way
        style = draw(st.sampled_from(["text", "conversation"]))
        styles = {"chosen": style, "rejected": style}
    else:
        styles = {c: fixed.get(c) or draw(st.sampled_from(["text", "conversation"])) for c in layout}
    n = draw(st.integers(12, 40))
    good_rows = set(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
    rows, expected = [], []
    for i in range(n):
        cells = {c: draw(cell(fmt, styles[c], good=i in good_rows, answer=c in ANSWERS)) for c in layout}
        same_style = "rejected" in layout and styles["chosen"] == styles["rejected"]
        if same_style and i not in good_rows and draw(st.integers(0, 9)) == 0:
            cells["rejected"] = cells["chosen"]  # the same answer twice
        elif i in good_rows and "rejected" in layout and cells["rejected"][1] == cells["chosen"][1]:
            cells["rejected"] = (cells["chosen"][0] + "!", ("text", cells["chosen"][0] + "!")) \
                if styles["rejected"] == "text" else ([*cells["chosen"][0], {"role": "assistant", "content": "!"}],
                                                      ("conversation", [*cells["chosen"][0],
                                                                        {"role": "assistant", "content": "!"}]))
        rows.append({c: v for c, (v, _) in cells.items()})
        expect = {c: e for c, (_, e) in cells.items()}
        same = "rejected" in expect and expect["chosen"] == expect["rejected"]
        expected.append(None if BAD in expect.values() or same else expect)
    mixed = None
    flexible = [c for c in layout if c in ("prompt", "completion", "chosen", "rejected") and styles[c] != "text"]
    if flexible and GROUP[fmt] != "arrow" and draw(st.integers(0, 9)) == 0:
        column, row = draw(st.sampled_from(flexible)), draw(st.integers(0, n - 1))
        rows[row][column] = draw(TEXT)  # plain text in a column of conversations
        mixed = column
    return algo, layout, rows, expected, mixed


def write(path: Path, fmt: str, layout: tuple[str, ...], rows: list[dict]) -> None:
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(layout)
            for row in rows:
                writer.writerow(["" if row[c] in (None, MISSING) else row[c] if isinstance(row[c], str)
                                 else json.dumps(row[c]) for c in layout])
    elif fmt in ("json", "jsonl"):
        present = [{c: v for c, v in row.items() if v is not MISSING} for row in rows]
        path.write_text(json.dumps(present) if fmt == "json" else "".join(json.dumps(r) + "\n" for r in present))
    else:
        dataset = Dataset.from_list([{c: None if v is MISSING else v for c, v in row.items()} for row in rows])
        dataset.to_parquet(str(path)) if fmt == "parquet" else dataset.save_to_disk(str(path))


def render(messages: list[dict]) -> str:
    """The embedded tokenizer's chat template, written out."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


def expected_text(expect: dict, answer: str) -> tuple[str, bool, str | None]:
    """The whole sequence a row must tokenize to, whether EOS follows it (plain text: appended; a conversation: the
    template closes the turn, as TRL tokenizes it), and the prompt the answer is split from where known ("": every
    token of an SFT ``messages`` row is trained)."""
    if "prompt" not in expect:  # implicit-prompt pairs, messages, text: the answer column is the whole text
        (kind, value), = [expect[c] for c in expect if c in (answer, "messages", "text")]
        if kind == "text":
            return value, True, None
        return render(value), False, "" if "messages" in expect else None
    (p_kind, prompt), (a_kind, value) = expect["prompt"], expect[answer]
    if all(kind == "text" for kind, _ in expect.values()):  # else every part is rendered as a conversation
        return prompt + value, True, prompt
    p_messages = prompt if p_kind == "conversation" else [{"role": "user", "content": prompt}]
    a_messages = value if a_kind == "conversation" else [{"role": "assistant", "content": value}]
    return render(p_messages + a_messages), False, render(p_messages) + "<|assistant|>\n"


def check_tokenized(algo: str, row: dict, expect: dict) -> None:
    algorithm = SFT(max_prompt_length=None, max_length=None) if algo == "sft" else DPO(max_prompt_length=None,
                                                                                     max_length=None)
    tokens = algorithm.tokenize(row, TOKENIZER)
    answers = ("completion",) if algo == "sft" else ("chosen", "rejected")
    texts = {answer: expected_text(expect, answer) for answer in answers}
    # The answers start where the prompt and the whole sequence diverge, the same for both sides of a pair (the
    # byte tokenizer: a byte is a token)
    prompts = [(prompt.encode(), text.encode()) for text, _, prompt in texts.values() if prompt is not None]
    start = min((len(os.path.commonprefix([p, t])) for p, t in prompts), default=None)
    for answer, (text, eos, _) in texts.items():
        prefix = "" if algo == "sft" else f"{answer}_"
        ids, mask = tokens[f"{prefix}input_ids"], tokens[f"{prefix}completion_mask"]
        assert ids == [*text.encode(), *([EOS] if eos else [])], (row, expect)
        first = mask.index(1)
        assert mask == [0] * first + [1] * (len(mask) - first)
        assert start is None or first == start, (row, expect)


def row_number(label: str) -> int:
    return int(label.split(", row ")[1].split()[0])


def run_one(folder: Path, fmt: str, spec) -> tuple[int, int]:
    """Check one generated file under both settings of on_bad_row; return (rows, bad rows)."""
    algo, layout, rows, expected, mixed = spec
    path = folder / ("d" if fmt == "saved" else f"d.{fmt}")
    write(path, fmt, layout, rows)
    columns = (SFT if algo == "sft" else DPO).columns
    bad = [i + 1 for i, e in enumerate(expected) if e is None]
    for on_bad_row in ("error", "skip"):
        source = DataSource(path=str(path), eval_size=1, on_bad_row=on_bad_row)
        if mixed or (bad and on_bad_row == "error"):
            with pytest.raises(UserError) as error:
                source.load(columns, TOKENIZER)
            message = str(error.value)
            assert message.startswith(f"data.path={path}: "), message
            if mixed:
                assert f"column {mixed!r} mixes lists of messages" in message, message
            else:
                assert f" row {bad[0]} (" in message, message  # the first bad row
            continue
        splits = source.load(columns, TOKENIZER)
        out = [row for split in splits.values() for row in split]
        assert sorted(row_number(r[ROW_COLUMN]) for r in out) == [i + 1 for i, e in enumerate(expected) if e]
        assert source.skipped_rows == len(bad)
        for row in out:
            check_tokenized(algo, row, expected[row_number(row[ROW_COLUMN]) - 1])
    return len(rows), len(bad)


@pytest.mark.parametrize("algo", sorted(LAYOUTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_generated_rows_are_trained_on_as_written_or_refused_naming_file_and_row(fmt, algo):
    counts = []
    datasets.disable_progress_bars()

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(spec=data_files(fmt, algo))
    def check(spec):
        with tempfile.TemporaryDirectory() as folder:
            counts.append(run_one(Path(folder), fmt, spec))

    try:
        check()
    finally:
        datasets.enable_progress_bars()
    rows, bad = map(sum, zip(*counts))
    assert bad >= 50, (rows, bad)  # x 5 formats x 2 algorithms: over 500 malformed rows in all
