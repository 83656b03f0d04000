"""Typed columns (KTO's ``label``, a reward model's ``margin``) pass through every reader with their types, bad values
are named like any bad field, and preference pairs become unpaired rows for an algorithm that asks for them."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhf.core.errors import UserError
from rlhf.data.checks import ROW_COLUMN
from rlhf.data.formats import pick_format
from rlhf.data.source import DataSource
from rlhf.models.tokenizer import byte_tokenizer

UNPAIRED = ("prompt", "completion", "label")
ROWS = [{"prompt": f"p{i}=", "completion": f"c{i}", "label": i % 2 == 0} for i in range(6)]


def _load(path, columns=UNPAIRED, **kwargs):
    return DataSource(path=str(path), eval_size=1).load(columns, byte_tokenizer(), **kwargs)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_labels_keep_their_type_in_every_file_type(tmp_path, suffix):
    path = tmp_path / f"unpaired{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif suffix == ".csv":  # CSV holds text: true/false in any case, or 1/0
        words = ["true", "FALSE", "1", "0", "True", "false"]
        path.write_text("prompt,completion,label\n" + "".join(f"p{i}=,c{i},{w}\n" for i, w in enumerate(words)))
    else:
        pd.DataFrame(ROWS).to_parquet(path)
    splits = _load(path)
    rows = [*splits["train"], *splits["eval"]]
    assert sorted((r["prompt"], r["label"]) for r in rows) == [(r["prompt"], r["label"]) for r in ROWS]
    assert all(type(r["label"]) is bool for r in rows)


def test_a_label_that_is_not_true_or_false_names_the_row_and_the_fix(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("prompt,completion,label\na=,b,true\nc=,d,yes\ne=,f,false\n")
    with pytest.raises(UserError, match=r"row 2 .*column 'label' is a string 'yes', not true/false\. Fix: write true"):
        _load(path)


def test_data_without_a_label_asks_for_one():
    with pytest.raises(UserError, match="add a 'label' column"):
        pick_format(["prompt", "completion"], UNPAIRED)


def test_preference_pairs_become_a_desirable_and_an_undesirable_row(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}=", "chosen": f"good{i}", "rejected": f"bad{i}"})
                              for i in range(3)))
    splits = _load(path)
    rows = sorted([*splits["train"], *splits["eval"]], key=lambda r: (r["prompt"], not r["label"]))
    assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [
        (f"p{i}=", answer, label) for i in range(3) for answer, label in ((f"good{i}", True), (f"bad{i}", False))]
    assert rows[1][ROW_COLUMN].endswith("row 1 (counting from 1), its rejected answer")


def test_an_optional_column_is_passed_on_where_the_data_has_it(tmp_path):
    path = tmp_path / "margins.csv"
    path.write_text("prompt,chosen,rejected,margin\na=,b,c,1.5\nd=,e,f,2\ng=,h,i,0\n")
    splits = _load(path, ("prompt", "chosen", "rejected"), optional=("margin",))
    assert sorted(r["margin"] for r in [*splits["train"], *splits["eval"]]) == [0.0, 1.5, 2.0]
    assert "margin" not in _load(path, ("prompt", "chosen", "rejected"))["train"].column_names
    path.write_text("prompt,chosen,rejected,margin\na=,b,c,1.5\nd=,e,f,lots\n")
    with pytest.raises(UserError, match="column 'margin' is a string 'lots', not a finite number"):
        _load(path, ("prompt", "chosen", "rejected"), optional=("margin",))


def test_unpaired_rows_given_to_a_pairwise_algorithm_point_to_kto():
    with pytest.raises(UserError, match="algo=kto for such data"):
        pick_format(["prompt", "completion", "label"], ("prompt", "chosen", "rejected"))
