"""A test-only algorithm: SFT whose loss is NaN on chosen micro-batches (``algo._target_=tests.nonfinite_loss.NaNAt``).

A real divergence is tested too (SGD with a huge learning rate); this one puts the NaN exactly where a test wants
it, e.g. on one process only.
"""

from __future__ import annotations

import os

from rlhf.algos.sft import SFT


class NaNAt(SFT):
    """Args: calls: the 0-based training micro-batches (calls of ``loss`` in training mode) that return NaN (every call when empty);
    rank: only on this process (``RANK``), or on all when null."""

    def __init__(self, calls: list[int] | None = None, rank: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls, self.rank, self.count = list(calls or []), rank, 0

    def loss(self, model, batch):
        loss, metrics = super().loss(model, batch)
        if not model.training:  # evaluation (SFT evaluates with its loss) is not counted
            return loss, metrics
        here = self.rank is None or int(os.environ.get("RANK", "0")) == self.rank
        if here and (not self.calls or self.count in self.calls):
            loss = loss * float("nan")
            metrics = {**metrics, "loss": loss.detach()}
        self.count += 1
        return loss, metrics
