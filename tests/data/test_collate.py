from rlhf.data.collate import collate_sequences
from rlhf.data.encoding import encode
from rlhf.models.tokenizer import byte_tokenizer


def test_collate_right_pads_with_masks():
    batch = collate_sequences([[1, 2, 3], [4]], [[0, 1, 1], [1]], pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_a_long_prompt_is_cut_but_a_row_with_no_completion_token_is_an_error():
    import pytest

    from rlhf.algos.dpo import DPO
    from rlhf.algos.sft import SFT
    from rlhf.core.errors import UserError
    from rlhf.data.checks import ROW_COLUMN

    tok = byte_tokenizer()
    row = {"prompt": "x" * 20, "completion": "ab", "chosen": "ab", "rejected": "ba", ROW_COLUMN: "data.path=d.csv, row 7"}
    assert SFT(max_prompt_length=4, max_length=8).tokenize(row, tok)["completion_mask"] == [0] * 4 + [1] * 3
    assert sum(DPO(max_prompt_length=4, max_length=8).tokenize(row, tok)["rejected_completion_mask"]) == 3
    with pytest.raises(UserError, match=r"^data.path=d.csv, row 7: not one token of 'completion' fits in "
                                        r"algo.max_length=8: the prompt fills it. Fix: raise algo.max_length"):
        SFT(max_prompt_length=None, max_length=8).tokenize(row, tok)
    with pytest.raises(UserError, match=r"^data.path=d.csv, row 7: not one token of 'chosen' fits"):
        DPO(max_prompt_length=None, max_length=8).tokenize(row, tok)
    with pytest.raises(UserError, match=r"^a row: not one token"):  # a row that does not say where it came from
        SFT(max_prompt_length=None, max_length=8, completion_only_loss=False).tokenize({"prompt": "x" * 9,
                                                                                      "completion": "a"}, tok)


def test_what_truncation_cut_is_recorded_and_counted():
    """Each side's flag only where it cut (a prompt exactly max_prompt_length long is not cut), and the count over
    a split by side: the start-up line's and data/truncated_rows' numbers."""
    from datasets import Dataset

    from rlhf.data.collate import truncated_rows
    from rlhf.data.encoding import END_CUT, PROMPT_CUT, TRUNCATED

    tok = byte_tokenizer()
    flags = [encode(tok, p, c, max_prompt_length=3, max_length=6)[TRUNCATED]
             for p, c in (("ab=", "ba"), ("abcd=", "x"), ("ab=", "xyzw"), ("abcdef=", "uvwxyz"))]
    assert flags == [0, PROMPT_CUT, END_CUT, PROMPT_CUT | END_CUT]
    assert encode(tok, "abc", "d")[TRUNCATED] == 0  # no limits
    counts = truncated_rows(Dataset.from_dict({TRUNCATED: flags, "input_ids": [[1]] * 4}))
    assert counts == {"rows": 4, "prompt_cut": 2, "end_cut": 2, "either": 3}


def test_a_run_says_how_many_rows_truncation_cut(fast_config, caplog):
    """A share above 5% is a warning with the fix, in the start-up lines; data/truncated_rows at step 0 (red
    before: cut without a word). A pair counts once whichever side was cut."""
    import json
    import logging
    from pathlib import Path

    from rlhf import train

    cfg = fast_config("algo=dpo", "algo.max_length=10", "algo.max_prompt_length=5", "train.max_steps=1")
    with caplog.at_level(logging.INFO, logger="rlhf"):
        train(cfg)
    warning = [r.getMessage() for r in caplog.records if r.getMessage().startswith("truncation: ")]
    assert len(warning) == 1 and " of 64 training rows (" in warning[0] and "Fix: a larger algo.max_length" in \
        warning[0], warning
    first = json.loads(Path(cfg.output_dir, "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["data/truncated_rows"] == int(warning[0].split()[1]) > 0
