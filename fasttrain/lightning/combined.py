"""Several loaders as one: Lightning's ``CombinedLoader`` in the fit and evaluation loops.

Lightning wraps every training source in a ``CombinedLoader`` (mode ``"max_size_cycle"`` unless
one is given) and every evaluation source in one of mode ``"sequential"``. fasttrain keeps a
single loader with a length as it is (its batches need no wrapping), and gives the loops a
:class:`CombinedData` for the rest: a list, tuple or dict of loaders (nested too), a
``CombinedLoader`` passed in, and a loader whose ``len()`` raises, which Lightning counts as
unsized. Batches come from Lightning's own ``CombinedLoader`` iteration, so each mode gives the
batch structure, the cycling of the shorter loaders (a fresh iterator of each, drawing its
shuffle where Lightning's does) and the ``None`` entries of ``"max_size"`` that Lightning gives.

The epoch length follows Lightning's rule: each flattened loader is counted under the run's
``limit_*_batches`` (and sharded over the processes), and the mode combines the counts (the
longest for ``"max_size_cycle"`` and ``"max_size"``, the shortest for ``"min_size"``, their sum
for ``"sequential"``). An evaluation over a ``"sequential"`` source runs its loaders one after the
other with their ``dataloader_idx``, as a list of loaders does; another mode gives one loader of
combined batches.
"""

from __future__ import annotations

import collections
import math
import operator
from typing import Callable, List

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.utilities import CombinedLoader

#: how a mode combines the batch counts of its loaders into the epoch's length
_LENGTH = {"max_size_cycle": max, "max_size": max, "min_size": min, "sequential": sum}
_batch_of = operator.itemgetter(0)
#: what Lightning's CombinedLoader takes apart into several loaders (torch's pytree containers)
_COLLECTIONS = (list, tuple, dict, collections.deque)
_NEVER = object()  # no batch is this: the batches end when the CombinedLoader's iteration does


class CombinedData:
    """A ``CombinedLoader`` as fasttrain's loops read a loader: iterating gives the batches,
    ``len()`` the batches of an epoch (a ``TypeError`` when unknown, as for a loader without a
    length), and :meth:`count` Lightning's count under a limit."""

    def __init__(self, combined: CombinedLoader):
        self.combined = combined
        #: the epoch's batches, set when a loop counts them (inf: unknown)
        self.length = float("inf")

    @property
    def mode(self) -> str:
        return self.combined._mode

    @property
    def flattened(self) -> list:
        return self.combined.flattened

    @property
    def iterables(self):
        """The collection of loaders the user gave (what ``trainer.train_dataloader`` reads)."""
        return self.combined.iterables

    def map(self, fn: Callable) -> "CombinedData":
        """The same combination over ``fn(loader)`` of each flattened loader."""
        self.combined.flattened = [fn(loader) for loader in self.flattened]
        return self

    def count(self, per_loader: Callable) -> float:
        """The batches of an epoch: ``per_loader(loader)`` (a loader's batches under the limit)
        for each flattened loader, combined by the mode."""
        counts = [per_loader(loader) for loader in self.flattened]
        if not counts:
            return 0
        return _LENGTH[self.mode](counts)

    def set_limits(self, per_loader: Callable) -> None:
        """Lightning's per-loader limits on the ``CombinedLoader`` (a sequential iteration stops
        each loader there)."""
        self.combined.limits = [per_loader(loader) for loader in self.flattened]

    def __len__(self) -> int:
        if math.isinf(self.length):
            raise TypeError("the combined loaders have no length")
        return int(self.length)

    def __iter__(self):
        # iter() now, not at the first batch: each loader's iterator draws its shuffle when it
        # is created, and Lightning creates them here. A CombinedLoader is its own iterator, whose
        # iter() starts the loaders again: the batches are read through its __next__ only
        return map(_batch_of, iter(iter(self.combined).__next__, _NEVER))


def training_data(source):
    """The fit's training data: ``source`` itself when it is one loader (see
    :func:`_reads_as_a_loader`), else a :class:`CombinedData` (mode ``"max_size_cycle"``, as
    Lightning wraps it, unless ``source`` is a ``CombinedLoader``)."""
    if isinstance(source, CombinedLoader):
        return CombinedData(source)
    if not isinstance(source, _COLLECTIONS) and _reads_as_a_loader(source):
        return source
    return CombinedData(CombinedLoader(source, "max_size_cycle"))


def check_trainable_mode(data) -> None:
    """Lightning's error for a sequential ``CombinedLoader`` as training data, raised where its
    fit loop raises it (at the epoch's first batch, after ``on_train_epoch_start``)."""
    if isinstance(data, CombinedData) and data.mode == "sequential":
        raise ValueError(
            '`_FitLoop` does not support the `CombinedLoader(mode="sequential")` mode.'
            " The available modes are: ['min_size', 'max_size_cycle', 'max_size']"
        )


def evaluation_loaders(source) -> List:
    """The loaders an evaluation runs one after the other: a collection of loaders or a
    sequential ``CombinedLoader`` flattened (each with its ``dataloader_idx``), another
    ``CombinedLoader`` as one loader of combined batches, one loader as itself."""
    if source is None:
        return []
    if isinstance(source, CombinedLoader):
        return list(source.flattened) if source._mode == "sequential" else [CombinedData(source)]
    if not isinstance(source, _COLLECTIONS):
        return [source]
    return list(CombinedLoader(source, "sequential").flattened)


def prediction_loaders(source) -> List:
    """The loaders of ``predict()``: as for an evaluation, with Lightning's error for a
    ``CombinedLoader`` whose mode is not sequential."""
    if isinstance(source, CombinedLoader) and source._mode != "sequential":
        raise ValueError('`trainer.predict()` only supports the `CombinedLoader(mode="sequential")` mode.')
    return evaluation_loaders(source)


def set_sampler_epoch(loader, epoch: int) -> None:
    """Lightning's ``set_epoch`` on the sampler of ``loader``, or of each loader combined."""
    if isinstance(loader, CombinedData):
        for part in loader.flattened:
            _set_sampler_epoch(part, epoch)
    else:
        _set_sampler_epoch(loader, epoch)


def flat(loaders: list) -> list:
    """Every loader of ``loaders``, those combined in one counted one by one (what Lightning's
    ``num_val_batches`` and the like list)."""
    return [part for loader in loaders for part in (loader.flattened if isinstance(loader, CombinedData) else [loader])]


def limited_counts(loaders: list, limits: list) -> list:
    """The batches a run takes from each of ``loaders``, given the count of each loader of
    ``flat(loaders)`` (under the run's limit): a combination's loaders are limited so, as
    Lightning limits a ``CombinedLoader`` per loader, and its count is theirs combined by its
    mode."""
    counts, start = [], 0
    for loader in loaders:
        if not isinstance(loader, CombinedData):
            counts.append(limits[start])
            start += 1
            continue
        own = list(limits[start:start + len(loader.flattened)])
        start += len(own)
        loader.combined.limits = own
        counts.append(_LENGTH[loader.mode](own) if own else 0)
    return counts


def as_given(loader):
    """What ``trainer.train_dataloader`` returns: the loaders as the user combined them."""
    return loader.iterables if isinstance(loader, CombinedData) else loader


def plain_loader(loader):
    """A loader of ``loader``'s own kind for fasttrain's set-up (the first one combined)."""
    if isinstance(loader, CombinedData):
        return loader.flattened[0] if loader.flattened else None
    return loader


def _reads_as_a_loader(loader) -> bool:
    """Whether fasttrain's set-up reads ``loader``'s length as it is: it has one, or ``len()``
    raises ``TypeError`` (a loader over an ``IterableDataset``). Lightning also counts a loader
    whose ``len()`` raises ``NotImplementedError`` as unsized: that one is combined."""
    try:
        len(loader)
    except TypeError:
        return True
    except NotImplementedError:
        return False
    return True
