import json

import pandas as pd
import pytest

from rlhf.data.source import DataSource
from rlhf.data.tasks import ReverseTask
from rlhf.errors import UserError
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
    assert set(splits["train"][0]) == {"prompt", "chosen", "rejected"}


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        DataSource(path=str(tmp_path / "nope.jsonl")).load(("prompt", "completion"), byte_tokenizer())


def test_embedded_task_is_used_without_a_path():
    splits = DataSource(task=ReverseTask(num_train=10, num_eval=3)).load(("prompt", "completion"), byte_tokenizer())
    assert (len(splits["train"]), len(splits["eval"])) == (10, 3)


def test_a_saved_dataset_dict_folder_loads_with_its_own_eval_split(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS[:12]), "test": Dataset.from_list(ROWS[12:])}).save_to_disk(tmp_path / "d")
    splits = DataSource(path=str(tmp_path / "d"), eval_split="test").load(("prompt", "chosen", "rejected"), byte_tokenizer())
    assert (len(splits["train"]), len(splits["eval"])) == (12, 8)
    with pytest.raises(UserError, match=r"has splits \['train', 'test'\], not 'validation'"):
        DataSource(path=str(tmp_path / "d"), eval_split="validation").load(("prompt", "chosen", "rejected"), byte_tokenizer())
