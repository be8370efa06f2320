"""Where ``self.log`` values live: on the device, until a flush or an epoch end reads them.

``LightningModule.log`` hands every value to ``trainer._results.log(...)``. This store keeps, per
``(hook, name)``, the latest step value and the epoch accumulator as device tensors, with the
reductions and names of Lightning's result collection: an epoch mean is ``sum(v * batch_size) /
sum(batch_size)``, ``max``/``min`` are element-wise, ``sum`` adds; a value logged both on step and
on epoch is reported as ``name_step`` and ``name_epoch``. Logging never reads a device value on the
host, and the store is plain Python, so a ``training_step`` that logs can be traced whole by
``torch.compile``. torchmetrics objects are kept as they are: their step value is the metric's
forward cache, their epoch value ``compute()``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional

import torch

from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.logged_numbers import as_logged_tensor

REDUCTIONS = ("mean", "max", "min", "sum")
_ALL = object()  # ResultStore.metrics: the values of every loader
# the callables Lightning accepts (torch's and Python's builtins), by the reduction they name;
# every reduction runs on the device (a builtin ``max`` of two tensors would read them on the host)
_CALLABLE_REDUCTIONS = {
    torch.mean: "mean", torch.max: "max", max: "max", torch.min: "min", min: "min", torch.sum: "sum", sum: "sum",
}


def parse_reduce_fx(reduce_fx):
    """``(reduction, key)``: one of :data:`REDUCTIONS`, and the value Lightning keeps for
    ``reduce_fx`` and compares between two calls logging one key (a string becomes torch's
    function: ``"max"`` and ``torch.max`` are the same option, Python's ``max`` another). Any
    other value is Lightning's ``MisconfigurationException``."""
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        name = "mean" if name == "avg" else name
        if name in REDUCTIONS:
            return name, getattr(torch, name)
    else:
        try:
            name = _CALLABLE_REDUCTIONS.get(reduce_fx)
        except TypeError:  # not hashable
            name = None
        if name is not None:
            return name, reduce_fx
    raise LightningConfigError(
        "Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported."
        " If you need a custom reduction, please log a `torchmetrics.Metric` instance instead."
        f" Found: {reduce_fx}"
    )


def extract_batch_size(batch) -> Optional[int]:
    """The size of the first dimension of the first tensor found in ``batch`` (Lightning's rule
    for the weights of epoch means); ``None`` when the batch holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.ndim == 0 else batch.size(0)
    if isinstance(batch, (str, bytes)):
        return len(batch)
    if isinstance(batch, Mapping):
        batch = batch.values()
    if isinstance(batch, (list, tuple)) or hasattr(batch, "__iter__") and not isinstance(batch, Mapping):
        try:
            items = list(batch)
        except TypeError:
            return None
        for item in items:
            size = extract_batch_size(item)
            if size is not None:
                return size
    return None


class LoggedValue:
    """One logged key of one hook: its options, latest step value and epoch accumulator."""

    __slots__ = (
        "fx", "name", "on_step", "on_epoch", "reduce", "prog_bar", "logger", "enable_graph",
        "sync", "metric", "step_value", "step_live", "total", "count", "has_value", "_computed", "given_options",
        "suffix", "given_arguments",
        "dataloader_idx",
    )

    def __init__(self, fx, name, *, on_step, on_epoch, reduce, prog_bar, logger, enable_graph, sync, metric,
                 suffix=""):
        self.fx, self.name = fx, name
        #: ``/dataloader_idx_N`` when several evaluation loaders run: it follows the _step/_epoch
        #: fork (``x_epoch/dataloader_idx_0``), as in Lightning
        self.suffix = suffix
        #: the evaluation loader whose batch logged it (several loaders), None elsewhere
        self.dataloader_idx: Optional[int] = None
        self.on_step, self.on_epoch, self.reduce = on_step, on_epoch, reduce
        self.prog_bar, self.logger, self.enable_graph = prog_bar, logger, enable_graph
        self.sync: Optional[Callable] = sync  # reduces a tensor over processes (sync_dist=True)
        self.metric = metric  # a torchmetrics Metric, or None for tensors
        self.step_value: Optional[torch.Tensor] = None
        #: whether ``step_value`` is a captured step's output, which the step's next replay
        #: overwrites: copied when it is read (:meth:`read_step_value`), before any replay can
        self.step_live = False
        self.total: Optional[torch.Tensor] = None
        self.count = 0  # a host int: batch sizes are host values, adding them costs no sync
        self.has_value = False
        self._computed: Optional[torch.Tensor] = None
        self.given_options: tuple = ()
        #: the arguments of the last call that passed the checks (results.py: ResultStore._log)
        self.given_arguments: Optional[tuple] = None

    def update(self, value, batch_size: int, live: bool = False) -> None:
        """File ``value`` (of a step whose batch has ``batch_size`` samples). ``live``: the value
        is the output tensor of a captured step, which its next replay writes again: it is kept
        as it is for the step value, and copied only where something reads it (most steps' values
        are never read: the loggers and the progress bar read them at flushes), where copying it
        at every replay would cost a kernel launch per logged value and step."""
        self.has_value = True
        self._computed = None
        self.step_live = False
        if self.metric is not None:
            self.metric = value
            self.step_value = value._forward_cache
            return
        if not (value.dtype == torch.float32 or value.dtype == torch.float64):
            # Lightning keeps logged values in the default float dtype so means stay exact
            value = value.to(torch.get_default_dtype())
            live = False  # a new tensor
        elif live and self.sync is not None:
            value = value.clone()  # the reduction over processes may work in place
            live = False
        if self.on_step:
            self.step_value = self.sync(value, self.reduce) if self.sync is not None else value
            self.step_live = live
            if not self.on_epoch:
                return
        reduce = self.reduce
        if self.total is None:
            # the sum of a mean is a new tensor; the others start from the value itself
            self.total = value * batch_size if reduce == "mean" else (value.clone() if live else value)
        elif reduce == "mean":
            self.total = self.total + value * batch_size
        elif reduce == "sum":
            self.total = self.total + value
        elif reduce == "max":
            self.total = torch.maximum(self.total, value)
        else:
            self.total = torch.minimum(self.total, value)
        if reduce == "mean":
            self.count += batch_size

    def holds_live(self, value) -> bool:
        """Whether a replay that wrote ``value`` leaves nothing to file here: a step value only,
        which the last replay filed as this same output tensor, rewritten in place since."""
        return self.step_live and self.step_value is value and not self.on_epoch

    def read_step_value(self) -> Optional[torch.Tensor]:
        """The latest step's value, for a reader that may keep it: a captured step's output is
        copied first (once; a replay files the next one)."""
        if self.step_live:
            self.step_value = self.step_value.detach().clone()
            self.step_live = False
        return self.step_value

    def epoch_value(self) -> Optional[torch.Tensor]:
        """The epoch reduction (cached until the next update); a collective when ``sync_dist``."""
        if self._computed is not None:
            return self._computed
        if self.metric is not None:
            value = self.metric.compute()
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"The `.compute()` return of the metric logged as {self.name!r} must be a tensor. Found {value}"
                )
        elif self.total is None:
            return None
        else:
            value = self.total
            count = self.count
            if self.sync is not None:
                # a mean is the ratio of two sums over all processes
                value = self.sync(value.clone(), "sum" if self.reduce == "mean" else self.reduce)
                if self.reduce == "mean":
                    count = self.sync(torch.tensor(float(count), device=value.device), "sum")
            value = value / count if self.reduce == "mean" else value
        self._computed = value
        return value

    def reset(self) -> None:
        self.has_value = self.step_live = False
        self.step_value = self.total = self._computed = None
        self.count = 0
        if self.metric is not None:
            self.metric.reset()

    def names(self, on_step: bool) -> tuple:
        name = self.name + self.suffix
        if self.on_step and self.on_epoch:
            return name, f"{self.name}_{'step' if on_step else 'epoch'}{self.suffix}"
        return name, name


class ResultStore:
    """The values logged in one loop (training, validation, test), as ``trainer._results``.

    :param training: whether step values reach ``callback_metrics`` (Lightning gives callbacks the
        step values of training only; evaluation values arrive at the epoch end).
    """

    def __init__(self, training: bool):
        self.training = training
        self.entries: Dict[str, LoggedValue] = {}
        self.batch = None
        self._batch_size: Optional[int] = None
        self.dataloader_idx: Optional[int] = None
        self.pending: list = []
        #: set while a CUDA graph captures a step (graph_logging.py): the calls its eager hooks
        #: make are recorded as a compiled step's are, to be filed again after each replay
        self.recording = False
        #: how many values were filed through :meth:`_log` (every eager ``self.log``), so that a
        #: loop can tell whether hooks logged anything between two points
        self.filed = 0

    def start_batch(self, batch, dataloader_idx: Optional[int] = None) -> None:
        self.batch = batch
        self._batch_size = None
        self.dataloader_idx = dataloader_idx

    # the signature LightningModule.log calls
    def log(self, fx, name, value, prog_bar=False, logger=True, on_step=False, on_epoch=True, reduce_fx="mean",
            enable_graph=False, add_dataloader_idx=True, batch_size=None, sync_dist=False, sync_dist_fn=None,
            sync_dist_group=None, metric_attribute=None, rank_zero_only=False) -> None:
        if torch.compiler.is_compiling() or self.recording:
            # Inside a compiled step, only record the call: dynamo replays the append after the
            # graph with the logged tensors as graph outputs, and nothing here reads the store's
            # changing host state (counts, which keys exist), which would be guarded on and
            # recompile the step every time it changes. :meth:`drain` files the values eagerly.
            self.pending.append((fx, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph,
                                 add_dataloader_idx, batch_size, sync_dist, sync_dist_fn, sync_dist_group,
                                 metric_attribute, rank_zero_only))
            return
        self._log(fx, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph, add_dataloader_idx,
                  batch_size, sync_dist, sync_dist_fn, sync_dist_group, metric_attribute, rank_zero_only)

    def drain(self, device) -> None:
        """File the values recorded inside a compiled step; a Python number logged there (kept as
        it is while the step was traced, logged_numbers.py) becomes Lightning's tensor of it, on
        ``device``."""
        pending = self.pending
        for args in pending:
            if isinstance(args[2], numbers.Number):
                args = (args[0], args[1], as_logged_tensor(args[2], device), *args[3:])
            self._log(*args)
        pending.clear()

    def _key(self, fx, name, add_dataloader_idx) -> tuple:
        suffix = ""
        if add_dataloader_idx and self.dataloader_idx is not None:
            suffix = f"/dataloader_idx_{self.dataloader_idx}"
        return f"{fx}.{name}{suffix}", suffix

    def _log(self, fx, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph,
             add_dataloader_idx, batch_size, sync_dist, sync_dist_fn, sync_dist_group, metric_attribute=None,
             rank_zero_only=False) -> None:
        if not on_step and not on_epoch:
            raise LightningConfigError("`self.log(on_step=False, on_epoch=False)` is not useful.")
        self.filed += 1
        key, suffix = self._key(fx, name, add_dataloader_idx)
        # the exact type first: isinstance goes through torch.Tensor's metaclass (every self.log)
        is_metric = type(value) is not torch.Tensor and not isinstance(value, torch.Tensor)
        entry = self.entries.get(key)
        # the arguments as given: a key logged again with the same ones (every step) needs none of
        # the checks below, which its first call made
        given = (on_step, on_epoch, reduce_fx, prog_bar, logger, enable_graph, add_dataloader_idx, metric_attribute,
                 sync_dist, sync_dist_group, rank_zero_only, is_metric)
        if entry is not None and entry.given_arguments == given:
            self.update_entry(entry, value, batch_size)
            return
        sync = None
        if sync_dist and sync_dist_fn is not None and not is_metric:
            sync = _Sync(sync_dist_fn, sync_dist_group)
        reduce, reduce_key = parse_reduce_fx(reduce_fx)
        # what Lightning compares between two calls logging one key (its metadata)
        options = (on_step, on_epoch, reduce_key, prog_bar, logger, enable_graph, add_dataloader_idx,
                   metric_attribute, sync_dist, sync_dist_group, rank_zero_only, is_metric)
        if entry is None:
            entry = LoggedValue(
                fx, name, on_step=on_step, on_epoch=on_epoch, reduce=reduce, prog_bar=prog_bar,
                logger=logger, enable_graph=enable_graph, sync=sync, metric=value if is_metric else None,
                suffix=suffix,
            )
            entry.given_options = options
            entry.dataloader_idx = self.dataloader_idx
            self.entries[key] = entry
        elif options != entry.given_options:
            if add_dataloader_idx and self.dataloader_idx is not None:
                fx = f"{fx}.{self.dataloader_idx}"
            raise LightningConfigError(
                f"You called `self.log({name}, ...)` twice in `{fx}` with different arguments. This is not allowed"
            )
        entry.given_arguments = given
        self.update_entry(entry, value, batch_size)

    def update_entry(self, entry: LoggedValue, value, batch_size: Optional[int], live: bool = False) -> None:
        """A value for ``entry``, whose call passed the checks of its first one (``_log``);
        ``live``: a captured step's output (:meth:`LoggedValue.update`)."""
        if batch_size is None:
            batch_size = self._current_batch_size() if entry.on_epoch and entry.reduce == "mean" else 1
        entry.update(value, batch_size, live)

    def filed_entries(self, calls: list) -> Optional[list]:
        """For calls recorded by :meth:`log` (a captured step's), ``(entry, given arguments,
        batch_size)`` each would be filed into by :meth:`_log` without a check, because the
        store has filed the same key with the same arguments before; None where one would not
        be, or logs a Python number (which :meth:`drain` turns into a tensor first)."""
        found = []
        for (fx, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph, add_dataloader_idx,
             batch_size, sync_dist, _sync_dist_fn, sync_dist_group, metric_attribute, rank_zero_only) in calls:
            if type(value) is not torch.Tensor or not (on_step or on_epoch):
                return None
            entry = self.entries.get(self._key(fx, name, add_dataloader_idx)[0])
            # built as _log builds it (inline there: it runs at every self.log)
            given = (on_step, on_epoch, reduce_fx, prog_bar, logger, enable_graph, add_dataloader_idx,
                     metric_attribute, sync_dist, sync_dist_group, rank_zero_only, False)
            if entry is None or entry.given_arguments != given:
                return None
            found.append((entry, entry.given_arguments, batch_size))
        return found

    def _current_batch_size(self) -> int:
        if self._batch_size is None:
            size = extract_batch_size(self.batch)
            self._batch_size = 1 if size is None else size
        return self._batch_size

    def reset(self, metrics: Optional[bool] = None, fx: Optional[str] = None) -> None:
        """Lightning's semantics: ``metrics=True`` resets torchmetrics entries only, ``False``
        tensors only, ``None`` both; ``fx`` restricts it to one hook."""
        for entry in self.entries.values():
            is_tensor = entry.metric is None
            if (metrics is None or metrics ^ is_tensor) and (fx is None or entry.fx == fx):
                entry.reset()

    def metrics(self, on_step: bool, dataloader_idx=_ALL) -> Dict[str, Dict[str, Any]]:
        """``{"callback", "log", "pbar"}`` dicts of device tensors, as Lightning builds them;
        given ``dataloader_idx``, only the values that loader's batches logged."""
        out = {"callback": {}, "log": {}, "pbar": {}}
        for entry in self.entries.values():
            if not entry.has_value or (dataloader_idx is not _ALL and entry.dataloader_idx != dataloader_idx):
                continue
            if on_step:
                value = entry.read_step_value() if entry.on_step else None
            else:
                value = entry.epoch_value() if entry.on_epoch else None
            if not isinstance(value, torch.Tensor):
                continue
            if not entry.enable_graph:
                value = value.detach()
            name, forked = entry.names(on_step)
            if entry.logger:
                out["log"][forked] = value
            if self.training or (entry.on_epoch and not on_step):
                out["callback"][name] = value
                out["callback"][forked] = value
            if entry.prog_bar:
                out["pbar"][forked] = value
        return out

    def logged_loaders(self) -> Dict[str, Optional[int]]:
        """For each name the loggers get at the epoch end: the evaluation loader whose batches
        logged it (also without ``/dataloader_idx_N`` in the name), None for a value logged
        outside the loaders' batches (an epoch hook)."""
        return {entry.names(False)[1]: entry.dataloader_idx for entry in self.entries.values() if entry.logger}


class _Sync:
    """``sync_dist=True``: reduce over processes with the strategy's ``reduce``."""

    def __init__(self, fn, group):
        self.fn, self.group = fn, group

    def __call__(self, value: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        op = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}[reduce]
        return self.fn(value, group=self.group, reduce_op=op)
