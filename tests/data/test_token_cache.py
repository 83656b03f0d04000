"""rlhf/data/token_cache.py: the tokenized data kept across runs, used again only for the same rows, tokenizer,
algorithm settings and code, and never half-written. About 1 s in all."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from datasets import Dataset, DatasetDict

from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build
from rlhf.data import token_cache
from rlhf.data.fingerprint import data_fingerprint
from rlhf.data.loaders import tokenize_once
from rlhf.models.tokenizer import byte_tokenizer
from tests.conftest import compose_config


class _OneProcess:
    num_processes, process_index, local_process_index = 1, 0, 0
    is_main_process = is_local_main_process = True

    @staticmethod
    def local_main_process_first():
        return contextlib.nullcontext()

    def wait_for_everyone(self) -> None:
        pass


def _splits(first_prompt: str = "abc=") -> DatasetDict:
    rows = [{"prompt": first_prompt, "chosen": "cba", "rejected": "cab"}] + [
        {"prompt": f"x{i}y=", "chosen": f"y{i}x", "rejected": f"{i}yx"} for i in range(7)]
    return DatasetDict({"train": Dataset.from_list(rows[:6]), "eval": Dataset.from_list(rows[6:])})


@pytest.fixture
def calls(monkeypatch):
    """How many rows DPO.tokenize was called on."""
    count = {"rows": 0}
    original = DPO.tokenize

    def counting(self, row, tokenizer):
        count["rows"] += 1
        return original(self, row, tokenizer)

    monkeypatch.setattr(DPO, "tokenize", counting)
    return count


def _tokenize(tmp_path, splits=None, algo=None, tokenizer=None, keep=True) -> DatasetDict:
    return tokenize_once(splits if splits is not None else _splits(), algo or DPO(), tokenizer or byte_tokenizer(),
                         _OneProcess(), tmp_path / "run-cache", keep=tmp_path / "cache" if keep else None)


def test_a_second_run_loads_the_tokens_of_the_first(tmp_path, calls):
    first = _tokenize(tmp_path)
    assert calls["rows"] == 8
    second = _tokenize(tmp_path)
    assert calls["rows"] == 8  # not tokenized again
    assert {s: data_fingerprint(second[s]) for s in second} == {s: data_fingerprint(first[s]) for s in first}
    assert len(list((tmp_path / "cache" / token_cache.FOLDER).iterdir())) == 1
    _tokenize(tmp_path, keep=False)  # data.cache_dir=null: tokenized on every run
    assert calls["rows"] == 16


def test_other_rows_settings_tokenizer_or_code_tokenize_again(tmp_path, calls, monkeypatch):
    _tokenize(tmp_path)
    _tokenize(tmp_path, splits=_splits(first_prompt="abd="))  # one row differs
    assert calls["rows"] == 16
    _tokenize(tmp_path, algo=DPO(max_length=5, max_prompt_length=3))  # a setting tokenize reads
    assert calls["rows"] == 24
    _tokenize(tmp_path, algo=DPO(beta=0.5))  # a setting it does not read: the first entry
    assert calls["rows"] == 24
    other = byte_tokenizer()
    other.chat_template = "{{ messages }}"
    _tokenize(tmp_path, tokenizer=other)
    assert calls["rows"] == 32
    monkeypatch.setattr(token_cache, "code_version", lambda: "edited")
    _tokenize(tmp_path)
    assert calls["rows"] == 40


def test_an_algorithm_that_names_no_settings_is_keyed_by_all_of_them():
    class Custom(SFT):
        def tokenize(self, row, tokenizer):  # overrides tokenize without naming what it reads
            return super().tokenize(row, tokenizer)

    assert token_cache.tokenize_settings(SFT(max_length=9)) == {
        "completion_only_loss": True, "max_prompt_length": 512, "max_length": 9}
    assert "pad_id" in token_cache.tokenize_settings(Custom())  # every attribute, not SFT's list
    assert token_cache.tokenize_settings(DPO(beta=0.2)) == token_cache.tokenize_settings(DPO(beta=0.3))


def test_an_interrupted_write_leaves_no_entry(tmp_path, calls, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt  # e.g. Ctrl-C after the files were written, before the rename

    with monkeypatch.context() as patch:
        patch.setattr(token_cache.os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            _tokenize(tmp_path)
    folder = tmp_path / "cache" / token_cache.FOLDER
    assert list(folder.iterdir()) == []  # neither an entry nor its staging folder
    _tokenize(tmp_path)
    assert calls["rows"] == 16  # tokenized again, and kept this time
    assert [p.name for p in folder.iterdir() if not p.name.startswith(".")] != []


def test_a_run_that_finds_the_entry_written_meanwhile_keeps_it(tmp_path):
    entry = tmp_path / "tokenized" / "key"
    token_cache.write(entry, lambda: DatasetDict({"train": Dataset.from_list([{"a": [1]}])}))
    token_cache.write(entry, lambda: DatasetDict({"train": Dataset.from_list([{"a": [1]}])}))  # a sweep's twin
    assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]


def test_an_unwritable_cache_folder_says_how_to_go_on(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="data.cache_dir=null"):
        token_cache.write(tmp_path / "file" / "tokenized" / "key", lambda: None)


def test_the_option_is_in_the_data_configs():
    assert build(compose_config("data.cache_dir=null").data).cache_dir is None
    assert build(compose_config().data).cache_dir.endswith("rlhf-cache")  # $RLHF_CACHE, as the tests set it


def test_a_killed_writes_staging_folder_is_removed_a_day_later(tmp_path):
    folder = tmp_path / "tokenized"
    old, recent = folder / ".tmp-old", folder / ".tmp-recent"
    for staging in (old, recent):
        (staging / "train").mkdir(parents=True)
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    token_cache.write(folder / "key", lambda: DatasetDict({"train": Dataset.from_list([{"a": [1]}])}))
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-recent", "key"]  # a write in progress stays
