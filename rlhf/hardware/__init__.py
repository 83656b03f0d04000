"""Hardware strategies: one object per ``conf/hardware`` option decides processes, devices and sharding. May
import ``rlhf.models``, ``rlhf.data``, ``rlhf.ops`` and ``rlhf.core``; independent of ``rlhf.algos``."""

from rlhf.hardware.base import DataParallel, cpus_available
from rlhf.hardware.fsdp import FSDP2
from rlhf.hardware.holding import FrozenHolding, global_numel
from rlhf.hardware.ports import free_port
from rlhf.hardware.zero import ZeRO

__all__ = ["FSDP2", "DataParallel", "FrozenHolding", "ZeRO", "cpus_available", "free_port", "global_numel"]
