"""The optimizer against the hardware strategy, before anything loads: an optimizer that cannot run on the pieces a
sharded strategy hands it (:func:`rlhf.optim.support.sharding_refusal`) is refused with its reason and the fix."""

from __future__ import annotations

import inspect
from typing import Any

from hydra.utils import get_object

from rlhf.core.errors import UserError


def check_optimizer_with_hardware(container: dict) -> None:
    """An optimizer whose update needs each tensor whole on one process (its class's ``whole_matrices``, or a library
    that :mod:`rlhf.optim.support` names) under a strategy that hands the optimizer pieces of it (FSDP2's row shards,
    ZeRO's flat float32 partitions), refused: it would apply another rule without a word (DeepSpeed#8441, verl fork
    #91). The fix names the strategies the optimizer runs under."""
    optimizer, hardware = container.get("optimizer"), container.get("hardware")
    if not (isinstance(optimizer, dict) and isinstance(hardware, dict) and "_target_" in optimizer
            and "_target_" in hardware):
        return
    from rlhf.hardware.sharded import Sharded
    from rlhf.optim.support import sharding_refusal

    strategy = get_object(hardware["_target_"])
    if not (inspect.isclass(strategy) and issubclass(strategy, Sharded)):
        return
    name = f"zero{hardware['stage']}" if "stage" in hardware else "fsdp"
    for target in _update_rules(optimizer):  # the optimizer, and the rules inside it (PerRule's), by class
        why = sharding_refusal(target, get_object(target), zero=name != "fsdp")
        if why is not None:
            break
    else:
        return
    runs = "cpu_ddp or ddp (each process holds whole tensors)"
    if name != "fsdp" and all(sharding_refusal(t, get_object(t), zero=False) is None for t in _update_rules(optimizer)):
        runs = "fsdp (it steps the model's own parameters), cpu_ddp or ddp"
    raise UserError(f"optimizer={target.rsplit('.', 1)[-1]} {why}, but hardware={name} "
                    f"({strategy.__name__}) hands the optimizer only this process's shard of each tensor (under ZeRO, "
                    f"float32 copies of them), so the update would be another rule's. Fix: hardware={runs}, or an "
                    "optimizer that updates element by element under sharding (optimizer=adamw).")


def _update_rules(node: Any) -> list[str]:
    """The ``_target_`` of ``node`` and of every node below it but the partition (which only groups tensors): an
    optimizer of several rules (``rlhf.optim.rules.PerRule``) names each rule's optimizer in a node of its own."""
    found = [node["_target_"]] if isinstance(node, dict) and isinstance(node.get("_target_"), str) else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        if key != "partition":
            found += _update_rules(child)
    return found
