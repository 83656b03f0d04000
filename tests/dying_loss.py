"""A test-only algorithm: SFT whose process kills itself (SIGKILL, as the out-of-memory killer does) at a chosen
training micro-batch (``algo._target_=tests.dying_loss.DieAt``): a sweep point that ends its process with no
exception and no result."""

from __future__ import annotations

import os
import signal

from rlhf.algos.sft import SFT


class DieAt(SFT):
    """Args: call: the 0-based training micro-batch (call of ``loss`` in training mode) at which the process
    sends itself SIGKILL; null: never (a normal SFT run)."""

    def __init__(self, call: int | None = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.call, self.count = call, 0

    def loss(self, model, batch, **kwargs):
        if model.training:
            if self.call is not None and self.count == self.call:
                os.kill(os.getpid(), signal.SIGKILL)
            self.count += 1
        return super().loss(model, batch, **kwargs)
