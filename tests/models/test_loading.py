import pytest
import torch

from rlhf.errors import UserError
from rlhf.models.loading import load_policy
from rlhf.models.tiny import TinySpec


def test_loads_a_saved_folder_in_the_requested_dtype(tmp_path):
    policy = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build()
    policy.model.save_pretrained(tmp_path)
    policy.tokenizer.save_pretrained(tmp_path)
    loaded = load_policy(str(tmp_path), dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.tokenizer.eos_token_id == policy.tokenizer.eos_token_id


def test_missing_folder_and_bad_dtype_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        load_policy(str(tmp_path / "missing" / "final"))
    with pytest.raises(UserError, match="model.dtype"):
        load_policy(None, dtype="float8", tiny=TinySpec())
