"""Count the bytes of the tensors torch allocates inside a block: alive now, at their peak, and in all. For tests of
what an operation holds on a CPU, where torch keeps no allocator statistics (``torch.cuda.max_memory_allocated`` has
no CPU twin). Every operator call is seen through a ``TorchDispatchMode``; a storage counts from the operator that
returned it first until Python drops its last reference (a weak reference to the storage, whose Python object torch
keeps one per storage). Tensors made before the block and what they are given back as (views, in-place results,
``out=``) do not count."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as seen: ...``: ``seen.peak`` the most bytes alive at once, ``seen.total`` every byte
    allocated, ``seen.now`` what is alive at the end (of tensors made inside the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = self.total = 0
        self._alive: dict[int, weakref.ref] = {}  # id of a storage -> a weak reference that counts its end

    def _freed(self, key: int, size: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in given or key in self._alive:
                continue
            size = storage.nbytes()
            self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._freed(key, size))
            self.now += size
            self.total += size
            self.peak = max(self.peak, self.now)
        return out
