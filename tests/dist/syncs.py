"""Counting host reads of device values made by fasttrain itself, in a worker process.

Every Tensor method that copies a value to the host is wrapped for the duration of a ``with``
block. A call is attributed to fasttrain when the frame that made it lies in the fasttrain package
or in ``kernels/`` (installed as ``fasttrain.kernels``); calls from torch, accelerate or the test
scenarios are not counted. On the CPU these reads cost nothing, but on a GPU each one is a
host-device synchronisation, so the count is how the CPU test suite guards the hot path in every
process of a multi-process run.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional

import torch

import fasttrain
import fasttrain.kernels

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (fasttrain, fasttrain.kernels)
)


class SyncRecorder:
    """Records ``(method, file, line, function, context)`` for each host read by fasttrain.

    ``context`` is whatever ``context_fn`` returns at the moment of the read (the scenario passes
    the trainer's update count and position in the epoch), so the test can check that every read
    happened at a flush or an epoch end.
    """

    def __init__(self, context_fn: Optional[Callable[[], tuple]] = None):
        self.context_fn = context_fn or (lambda: ())
        self.events: List[tuple] = []
        self._originals = {}

    def _wrap(self, name, original):
        recorder = self

        def wrapper(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename.startswith(LIBRARY_DIRS):
                recorder.events.append(
                    (name, os.path.basename(filename), frame.f_lineno, frame.f_code.co_name, recorder.context_fn())
                )
            return original(tensor, *args, **kwargs)

        wrapper.__name__ = name
        return wrapper

    def __enter__(self):
        for name in SYNC_METHODS:
            # remember whether torch.Tensor defines the method itself or inherits it from the C
            # base class, so that __exit__ restores exactly the previous state
            self._originals[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._originals.clear()
        return False
