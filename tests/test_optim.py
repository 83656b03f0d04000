import pytest
import torch

from rlhf import optim
from rlhf.embedded.tiny_model import TinySpec
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


@pytest.mark.parametrize("ours, theirs, settings", [
    ("constant_with_warmup", "get_constant_schedule_with_warmup", {"num_warmup_steps": 7}),
    ("linear_with_warmup", "get_linear_schedule_with_warmup", {"num_warmup_steps": 7, "num_training_steps": 53}),
    ("linear_with_warmup", "get_linear_schedule_with_warmup", {"num_warmup_steps": 0, "num_training_steps": 40}),
    ("cosine_with_warmup", "get_cosine_schedule_with_warmup",
     {"num_warmup_steps": 7, "num_training_steps": 53, "num_cycles": 0.37}),
    ("cosine_with_warmup", "get_cosine_schedule_with_warmup", {"num_warmup_steps": 3, "num_training_steps": 30}),
])
def test_warmup_schedules_give_hugging_faces_learning_rates_to_the_last_bit(ours, theirs, settings):
    import transformers

    rates = []
    for make in (getattr(optim, ours), getattr(transformers, theirs)):
        parameter = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([parameter], lr=3.7e-4)
        scheduler = make(optimizer, **settings)
        rates.append([])
        for _ in range(60):  # past the end of training too (0, or the cosine's next period)
            rates[-1].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert rates[0] == rates[1]
    assert len(set(rates[0])) > 5  # a schedule that moves


def test_a_schedules_checkpoint_holds_no_function_and_resumes_where_it_was():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scheduler = optim.cosine_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{}]  # a functools.partial: nothing to pickle but its (empty) __dict__
    again = optim.cosine_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                     num_warmup_steps=2, num_training_steps=10)
    again.load_state_dict(state)
    assert again.get_last_lr() == scheduler.get_last_lr() and again.last_epoch == 4


@pytest.mark.parametrize("make", [optim.cosine_with_warmup, optim.linear_with_warmup, optim.constant_with_warmup])
def test_a_warmup_as_long_as_the_run_is_warned_with_the_lr_it_ends_at_and_kept(make, caplog):
    """The run of 6 steps with scheduler.num_warmup_steps=10 never reaches optimizer.lr: said at start-up, with the
    fix; the schedule is the one asked for (not scaled); a warmup shorter than the run says nothing (red: silent)."""
    import functools

    extra = {} if make is optim.constant_with_warmup else {"num_training_steps": None}
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1e-6)
    with caplog.at_level("WARNING", logger="rlhf.optim"):
        scheduler = optim.schedule(functools.partial(make, num_warmup_steps=10, **extra), optimizer, 6)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("scheduler.num_warmup_steps=10 is not shorter than the run's 6 optimizer step(s): the learning rate "
                    "rises for the whole run and never reaches its peak optimizer.lr=1e-06 (the last step trains at "
                    "5e-07). Fix: scheduler.num_warmup_steps=0 (or another count below 6; TRL's default is 0), or a "
                    "run longer than 10 steps (train.max_steps)")
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([k * 1e-7 for k in range(6)])  # warned, not scaled
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhf.optim"):
        optim.schedule(functools.partial(make, num_warmup_steps=5, **extra),
                       torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-6), 6)
    assert caplog.records == []
    assert optim.warmup_warning(10, 0) is None  # train.max_steps=0: no step to train
    assert optim.warmup_warning(10, 10).startswith("scheduler.num_warmup_steps=10 is not shorter than the run's 10")
