import pytest
import torch

from rlhf.core.errors import UserError
from rlhf.embedded.tiny_model import TinySpec
from rlhf.models.loading import load_policy


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


def test_gradient_checkpointing_recomputes_activations_and_gives_the_same_gradients():
    """model.gradient_checkpointing=true: the layers are checkpointed (non-reentrant) and a backward pass gives the
    gradients of the plain model bit for bit (so a resume may switch it: not compared by the resume check)."""
    from rlhf.embedded.tiny_model import TinySpec
    from rlhf.models.loading import load_policy

    spec = dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, warm_start_steps=0)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = load_policy(tiny=TinySpec(**spec), gradient_checkpointing=checkpointing).model.train()
        assert model.is_gradient_checkpointing == checkpointing
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), labels=torch.tensor([[5, 6, 7, 8, 9]])).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
