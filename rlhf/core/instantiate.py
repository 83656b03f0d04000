"""Building a component from its config node: Hydra's ``instantiate``, with the project's errors kept whole; and
whether Hydra runs this process as a sweep's job."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from rlhf.core.errors import UserError


def build(node: DictConfig, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but a :class:`UserError` raised while building surfaces as itself, not
    wrapped in Hydra's InstantiationException."""
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def in_a_sweep() -> bool:
    """Whether this process runs a job of a sweep (``-m``; under any launcher), not a single run: Hydra's record of
    the run mode (the sweep's report, its failed points and its memory figures read it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
