"""A test-only algorithm: SFT whose loss is NaN on chosen micro-batches (``algo._target_=tests.nonfinite_loss.NaNAt``).

A real divergence is tested too (SGD with a huge learning rate); this one puts the NaN exactly where a test wants
it, e.g. on one process only, with NaN gradients or with finite ones.
"""

from __future__ import annotations

import os

import torch

from rlhf.algos.sft import SFT


class NaNAt(SFT):
    """Args: calls: the 0-based training micro-batches (calls of ``loss`` in training mode) that return NaN (every
    call when empty); rank: only on this process (``RANK``), or on all when null; nan_gradients: the gradients are
    NaN too (``loss * nan``), or stay finite (``loss + nan * loss.detach()``: only the loss value says so).

    Its state (saved per rank in each checkpoint) holds this process's parameters, so that a test can compare the
    ranks' models."""

    def __init__(self, calls: list[int] | None = None, rank: int | None = None, nan_gradients: bool = True,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls, self.rank, self.nan_gradients, self.count = list(calls or []), rank, nan_gradients, 0
        self.model = None

    def loss(self, model, batch, **kwargs):  # kwargs: e.g. DPO's training=False on held-out batches
        loss, metrics = super().loss(model, batch, **kwargs)
        if not model.training:  # evaluation (SFT evaluates with its loss) is not counted
            return loss, metrics
        self.model = model
        here = self.rank is None or int(os.environ.get("RANK", "0")) == self.rank
        if here and (not self.calls or self.count in self.calls):
            loss = loss * float("nan") if self.nan_gradients else loss + float("nan") * loss.detach()
            metrics = {**metrics, "loss": loss.detach()}
        self.count += 1
        return loss, metrics

    def state_dict(self) -> dict:
        parameters = None if self.model is None else torch.cat([p.detach().flatten() for p in self.model.parameters()])
        return {"count": self.count, "parameters": parameters}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
