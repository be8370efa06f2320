"""Metric updates that stay off the host on a GPU: ops that synchronise, and a stand-in for one.

A torchmetrics ``update`` is device work, except where an op needs a value on the host to size
its output or to branch:

* ``torch.bincount`` (confusion-matrix style metrics: ``MulticlassAccuracy`` with a per-class
  average, ``MulticlassF1Score``, ``MulticlassConfusionMatrix``...): the CUDA kernel reads the
  input's minimum and maximum back to check it and size the result, even when ``minlength`` is
  given. torchmetrics always gives ``minlength`` (the number of bins it reshapes the counts to), so
  :class:`SyncFreeUpdates` computes the same counts with a scatter-add into ``minlength`` bins, no
  read. Values outside ``[0, minlength)`` are not counted (torch would raise or grow the result):
  with ``validate_args=False`` the metric was promised valid inputs.
* ``nonzero``, ``unique``, ``masked_select``, boolean indexing, ``repeat_interleave`` by a
  tensor and ``.item()``/``bool(tensor)`` (``aten._local_scalar_dense``): outputs sized or
  decisions taken from device values. They cannot be replaced without changing the metric; the
  mode records them so that the callback can say which metric syncs and why (for example a
  binary metric reads whether its predictions are probabilities, ``validate_args`` or not).

On the CPU none of this costs anything, and the callback does not use the mode there.
"""

from __future__ import annotations

from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: ops whose output size or result is read on the host (a synchronisation on a GPU)
SYNCING_OPS = frozenset({
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static_fallback",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "repeat_interleave",
    "bincount",
})


def scatter_bincount(values: torch.Tensor, weights, minlength: int) -> torch.Tensor:
    """``torch.bincount(values, weights, minlength)`` for values in ``[0, minlength)``, without
    reading anything on the host; out-of-range values land in a spare bin that is dropped."""
    values = values.reshape(-1).long()
    inside = (values >= 0) & (values < minlength)
    index = torch.where(inside, values, minlength)
    if weights is None:
        counts = torch.zeros(minlength + 1, dtype=torch.long, device=values.device)
        counts.scatter_add_(0, index, torch.ones_like(index))
    else:
        weights = weights.reshape(-1)
        counts = torch.zeros(minlength + 1, dtype=weights.dtype, device=values.device)
        counts.scatter_add_(0, index, weights)
    return counts[:minlength]


class SyncFreeUpdates(TorchDispatchMode):
    """While active: ``bincount`` with a ``minlength`` runs as :func:`scatter_bincount`; any
    other op of :data:`SYNCING_OPS` runs as it is and is recorded in :attr:`synced`."""

    def __init__(self):
        super().__init__()
        self.synced: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.bincount.default:
            values = args[0]
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if minlength > 0 and (weights is None or weights.is_floating_point()):
                return scatter_bincount(values, weights, minlength)
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS and not (name == "repeat_interleave" and "output_size" in kwargs):
            self.synced.append(f"aten.{name}")
        return func(*args, **kwargs)


def host_reads_matter(device) -> bool:
    """Whether an op that reads the host synchronises with a device: not on the CPU."""
    return torch.device(device).type != "cpu"
