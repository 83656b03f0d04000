"""Test-only algorithms: SFT or DPO whose training micro-batches take long from a chosen one on
(``algo._target_=tests.slow_loss.SlowFrom`` on ``algo=sft``, ``tests.slow_loss.SlowDPOFrom`` on ``algo=dpo``), so
that a test can signal a run in the middle of a step. The sleep changes no number: such a run ends bit-identical
to the same run without it."""

from __future__ import annotations

import time

from rlhf.algos.dpo import DPO
from rlhf.algos.sft import SFT


class _Slow:
    """Args: call: the 0-based training micro-batch (call of ``loss`` in training mode) from which each one sleeps;
    seconds: how long each of those sleeps. Python retries a sleep that a signal handler interrupts and returns
    from, so only a handler that raises ends the sleep early."""

    def __init__(self, call: int = 1, seconds: float = 60.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.call, self.seconds, self.count = call, seconds, 0

    def loss(self, model, batch, **kwargs):  # kwargs: e.g. DPO's training=False on held-out batches
        if model.training:
            if self.count >= self.call:
                time.sleep(self.seconds)
            self.count += 1
        return super().loss(model, batch, **kwargs)


class SlowFrom(_Slow, SFT):
    pass


class SlowDPOFrom(_Slow, DPO):
    pass
