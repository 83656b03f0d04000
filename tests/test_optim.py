import torch

from rlhf.models.tiny import TinySpec
from rlhf.optim import param_groups


def test_no_decay_on_biases_and_norms_and_frozen_parameters_left_out():
    model = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=0).build().model
    model.model.embed_tokens.weight.requires_grad_(False)
    groups = param_groups(model)
    decay, no_decay = groups
    assert "weight_decay" not in decay and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])  # RMSNorm weights
    everything = {id(p) for g in groups for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in everything
    optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
