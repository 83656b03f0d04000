"""rlhf/core/train_state.py: the log window's sums read at once, and a state with device sums stored as plain numbers."""

from __future__ import annotations

import torch

from rlhf.core.train_state import TrainState, read_at_once


def test_sums_are_read_in_their_order_numbers_and_tensors_alike():
    values = {"a": 1.5, "b": torch.tensor(2.0, dtype=torch.float64), "c": torch.tensor([3.0]), "d": 4}
    assert list(read_at_once(values).items()) == [("a", 1.5), ("b", 2.0), ("c", 3.0), ("d", 4.0)]
    assert all(type(v) is float for v in read_at_once(values).values())


def test_a_state_whose_sums_are_tensors_is_stored_as_plain_numbers():
    state = TrainState(window_tokens=torch.tensor(7))
    state.window_sums["loss"] += torch.tensor(0.25, dtype=torch.float64)
    stored = state.to_dict()
    assert stored["window_sums"] == {"loss": 0.25} and stored["window_tokens"] == 7
    assert type(stored["window_sums"]["loss"]) is float and type(stored["window_tokens"]) is int
    assert TrainState.from_dict(stored).window_sums["loss"] == 0.25
