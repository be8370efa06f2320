"""Host reads the CPU can see below Python: every ``.item()``, ``float(t)`` and every tensor an
op's C++ argument parser turns into a number (a 0-dim tensor passed where a kernel takes a
float) reaches the dispatcher as ``aten._local_scalar_dense``; on a GPU each one is a
synchronisation. :class:`HostReads` counts them, and records which ops ran, while active."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


class HostReads(TorchDispatchMode):
    """``reads``: how many values were read to the host; ``ops``: a count of every aten op."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        if func is LOCAL_SCALAR:
            self.reads += 1
        return func(*args, **(kwargs or {}))
