"""A model that generates: its parameters gathered once for a whole generation where a strategy shards them.

Under FSDP2 every forward pass of a sharded model all-gathers each unit's parameters and frees them after; generating
``T`` tokens would gather the model ``T`` times. :func:`gathered_for_generation` gathers it once for the block.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)


def sharded(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is partitioned over processes (an FSDP2 DTensor, a ZeRO-3 parameter):
    then every forward pass is a collective."""
    return any(hasattr(p, "ds_id") or hasattr(p, "to_local") for p in model.parameters())


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module) -> Iterator[bool]:
    """FSDP2's parameters gathered once, and kept whole until the block ends, instead of each unit's gathered at
    every forward pass and freed after it: generating ``T`` tokens then costs one all-gather of the model, not
    ``T``; the forward passes inside are no collectives. Yields whether the parameters stay sharded after all
    (ZeRO-3, whose own hooks gather each layer at every forward: generation there stays a collective, ``synced_gpus``).
    Memory: the whole model in the compute dtype on each process for the length of the block."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield sharded(model)
        return
    saved = []
    try:
        # FSDP2 decides at its first forward (lazy init) that the root keeps its parameters after forward; run it
        # now, before the settings are read, or a first forward inside this block would skip that for good
        units[0]._get_fsdp_state()._lazy_init()  # units[0]: the outermost unit, the root
        for unit in units:  # what set_reshard_after_forward changes, to put back as the strategy set it
            state = unit._get_fsdp_state()
            saved.append((state, state._auto_reshard_after_forward,
                          [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
    except AttributeError:  # another torch's FSDP2 internals: gather per forward pass, as without this
        log.warning("FSDP2's internals differ in this torch: generation gathers the parameters at every token")
        yield True
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield False
    finally:
        for unit, (state, auto, meshes) in zip(units, saved):
            state._auto_reshard_after_forward = auto
            for group, mesh in zip(state._fsdp_param_groups, meshes):
                group.post_forward_mesh_info = mesh
            unit.reshard()
