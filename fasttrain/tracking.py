"""Run history (metric values per name) and the device-side epoch loss accumulator."""

from __future__ import annotations

import numbers
from collections import defaultdict
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterable, List, Optional

import torch

__all__ = ["RunHistory", "InMemoryRunHistory", "LossTracker"]


class RunHistory(ABC):
    """The interface through which a trainer records metrics and the current epoch.

    Subclass it to keep metrics elsewhere (a database, a tracking service). Metric names are
    prefixed with :attr:`metric_name_prefix` when recorded, not when read.
    """

    @abstractmethod
    def get_metric_names(self) -> Iterable:
        """Return the set of names that have been recorded."""

    @abstractmethod
    def get_metric_values(self, metric_name) -> Iterable:
        """Return the values recorded for ``metric_name``, oldest first."""

    @abstractmethod
    def get_latest_metric(self, metric_name):
        """Return the last value recorded for ``metric_name``."""

    @abstractmethod
    def set_metric_name_prefix(self, prefix=""):
        """Prepend ``prefix`` to the names of metrics recorded from now on."""

    @property
    @abstractmethod
    def metric_name_prefix(self):
        """The prefix prepended to recorded metric names."""

    @abstractmethod
    def update_metric(self, metric_name, metric_value):
        """Record ``metric_value`` for the (prefixed) ``metric_name``."""

    @abstractmethod
    def delete_metric(self, metric_name):
        """Remove ``metric_name`` and its values."""

    @property
    @abstractmethod
    def current_epoch(self) -> int:
        """The current epoch, starting at 1."""

    @abstractmethod
    def _increment_epoch(self):
        """Advance the current epoch by one."""

    @abstractmethod
    def _set_epoch(self, epoch: int):
        """Set the current epoch, as when resuming a run."""

    @abstractmethod
    def reset(self):
        """Forget all metrics and return to epoch 1."""


def _plain(value: Any, where: str):
    """Convert a recorded value to plain Python types that ``torch.load(weights_only=True)``
    reads back."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        # SYNC(save): a checkpoint is written from host values
        return value.detach().cpu().tolist()
    if isinstance(value, numbers.Number) and hasattr(value, "item"):
        return value.item()  # SYNC(none): a NumPy scalar, already on the host
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item, where) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item, where) for key, item in value.items()}
    raise TypeError(
        f"Cannot save the value {value!r} ({type(value).__name__}) recorded for {where}: the run "
        "history's state holds numbers, strings, None, lists and dicts of these, and tensors. "
        "Record a number instead, or delete the metric before saving."
    )


class InMemoryRunHistory(RunHistory):
    """A :class:`RunHistory` that keeps every recorded value in memory.

    Reading a metric that was never recorded does not create it: ``get_metric_values`` returns
    an empty list and ``get_latest_metric`` raises ``ValueError``.
    """

    def __init__(self):
        self._current_epoch = 1
        # a defaultdict, as in pytorch-accelerated, whose users append to ``_metrics[name]``
        # directly; the public readers use ``get`` so that reading creates nothing
        self._metrics: Dict[str, List[Any]] = defaultdict(list)
        self._prefix = ""

    def get_metric_names(self) -> set:
        return set(self._metrics)

    def get_metric_values(self, metric_name) -> list:
        return self._metrics.get(metric_name, [])

    def get_latest_metric(self, metric_name):
        values = self._metrics.get(metric_name)
        if not values:
            raise ValueError(f"No values have been recorded for the metric {metric_name}")
        return values[-1]

    def update_metric(self, metric_name, metric_value):
        self._metrics.setdefault(f"{self._prefix}{metric_name}", []).append(metric_value)

    def set_metric_name_prefix(self, prefix=""):
        self._prefix = prefix

    def delete_metric(self, metric_name):
        del self._metrics[metric_name]

    @property
    def metric_name_prefix(self) -> str:
        return self._prefix

    @property
    def current_epoch(self) -> int:
        return self._current_epoch

    def _increment_epoch(self):
        self._current_epoch += 1

    def _set_epoch(self, epoch: int):
        self._current_epoch = epoch

    def reset(self):
        """Forget all metrics and return to epoch 1; the prefix is kept."""
        self._current_epoch = 1
        self._metrics = defaultdict(list)

    def state_dict(self) -> dict:
        """Return the epoch, prefix and metrics as plain Python values (tensors become
        numbers or lists)."""
        return {
            "current_epoch": int(self._current_epoch),
            "metric_name_prefix": self._prefix,
            "metrics": {
                name: [_plain(value, f"metric {name!r}") for value in values]
                for name, values in self._metrics.items()
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the history with one saved by :meth:`state_dict`."""
        self._current_epoch = state_dict["current_epoch"]
        self._prefix = state_dict.get("metric_name_prefix", "")
        self._metrics = defaultdict(list, {name: list(values) for name, values in state_dict["metrics"].items()})


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; elsewhere a float64 scalar costs nothing and keeps long sums exact.
    return torch.float32 if device.type == "mps" else torch.float64


def _zero_accumulator(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=_accumulation_dtype(device), device=device)


def _scalar_like(value, accumulator: torch.Tensor):
    """Return a tensor ``value`` as a 0-d tensor on the accumulator's device and dtype (an
    asynchronous copy at most; nothing is read on the host); numbers pass through."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=accumulator.device, dtype=accumulator.dtype)
    return value


class LossTracker:
    """Batch-size-weighted running mean of a loss.

    ``update`` accepts Python numbers or tensors. Tensor losses are summed on their own device
    (``loss * batch_size`` and ``batch_size``, in float64, float32 on MPS) without reading them
    back, so updating every step never synchronises the host with the device. ``average``,
    ``total_loss`` and ``running_count`` return host numbers and therefore synchronise once;
    read them at epoch ends. ``loss_value`` is the last value passed (detached if a tensor).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new mean."""
        self.loss_value = 0
        self._host_total = 0
        self._host_count = 0
        self._device_total: Optional[torch.Tensor] = None
        self._device_count: Optional[torch.Tensor] = None

    def update(self, loss_batch_value, batch_size=1) -> None:
        """Add a batch's mean loss, weighted by its ``batch_size`` (each a number or a tensor)."""
        loss_is_tensor = isinstance(loss_batch_value, torch.Tensor)
        # Detached, so that holding the last loss does not keep its autograd graph alive.
        self.loss_value = loss_batch_value.detach() if loss_is_tensor else loss_batch_value
        if loss_is_tensor and loss_batch_value.numel() != 1:
            raise ValueError(
                "LossTracker.update expects the batch's mean loss as one value, got a tensor "
                f"of shape {tuple(loss_batch_value.shape)}; reduce it (e.g. .mean()) first."
            )

        if loss_is_tensor or isinstance(batch_size, torch.Tensor):
            reference = loss_batch_value if loss_is_tensor else batch_size
            if self._device_total is None:
                self._device_total = _zero_accumulator(reference.device)
            total = self._device_total
            total.add_(_scalar_like(loss_batch_value, total) * _scalar_like(batch_size, total))
        else:
            self._host_total += loss_batch_value * batch_size

        if isinstance(batch_size, torch.Tensor):
            if self._device_count is None:
                self._device_count = _zero_accumulator(batch_size.device)
            self._device_count.add_(_scalar_like(batch_size, self._device_count))
        else:
            self._host_count += batch_size

    def totals(self, device=None) -> torch.Tensor:
        """Return ``[total_loss, running_count]`` as one float tensor without synchronising.

        Meant for gathering across processes in one collective: sum the tensors of all
        processes and divide. ``device`` defaults to the device of the summed losses (the CPU
        when only numbers were passed).
        """
        if device is None:
            reference = self._device_total if self._device_total is not None else self._device_count
            device = reference.device if reference is not None else torch.device("cpu")
        device = torch.device(device)
        dtype = _accumulation_dtype(device)
        result = torch.tensor(
            [float(self._host_total), float(self._host_count)], dtype=dtype
        ).to(device, non_blocking=True)
        if self._device_total is not None:
            result[0] += self._device_total.to(device=device, dtype=dtype)
        if self._device_count is not None:
            result[1] += self._device_count.to(device=device, dtype=dtype)
        return result

    @property
    def total_loss(self):
        """The sum of ``loss * batch_size`` so far, as a host number (synchronises)."""
        if self._device_total is None:
            return self._host_total
        return self._host_total + self._device_total.item()  # SYNC(epoch-end): the epoch's total

    @property
    def running_count(self):
        """The sum of the batch sizes so far, as a host number (synchronises)."""
        if self._device_count is None:
            return self._host_count
        count = self._device_count.item()  # SYNC(epoch-end): the epoch's total
        if isinstance(self._host_count, numbers.Integral) and float(count).is_integer():
            count = int(count)
        return self._host_count + count

    @property
    def average(self):
        """The batch-size-weighted mean loss so far (0 before any update); synchronises."""
        if self._device_total is None and self._device_count is None:
            total, count = self._host_total, self._host_count
        else:
            total, count = self.totals().tolist()  # SYNC(epoch-end): one copy for both
        if count == 0:
            return 0
        return total / count

    def state_dict(self) -> dict:
        """Return the running sums as plain Python numbers (synchronises)."""
        return {
            "total_loss": self.total_loss,
            "running_count": self.running_count,
            "loss_value": _plain(self.loss_value, "loss_value"),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue the mean from sums saved by :meth:`state_dict`."""
        self.reset()
        self._host_total = state_dict["total_loss"]
        self._host_count = state_dict["running_count"]
        self.loss_value = state_dict.get("loss_value", 0)
