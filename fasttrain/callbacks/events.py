"""The event system: TrainerCallback, CallbackHandler and the events the trainer fires."""

from __future__ import annotations

import difflib
import warnings
from typing import Dict, List

from fasttrain.errors import StopTrainingError  # part of the callback API

__all__ = [
    "EVENTS",
    "PER_STEP_EVENTS",
    "CallbackHandler",
    "CallbackMethodNotImplementedError",
    "StopTrainingError",
    "TrainerCallback",
]


class CallbackMethodNotImplementedError(Exception):
    """Kept for compatibility: raising it from a callback method skips that callback."""


#: Every event the trainer fires, in the order of a training run with evaluation.
EVENTS = (
    "on_init_end",
    "on_training_run_start",
    "on_train_epoch_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_metrics_flush",
    "on_train_epoch_end",
    "on_eval_epoch_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_epoch_end",
    "on_training_run_epoch_end",
    "on_training_run_end",
    "on_evaluation_run_start",
    "on_evaluation_run_end",
    "on_stop_training_error",
    "on_training_interrupted",
)

PER_STEP_EVENTS = (
    "on_train_step_start",
    "on_train_step_end",
    "on_eval_step_start",
    "on_eval_step_end",
)


class TrainerCallback:
    """Base class for callbacks. Override the events you need; every method takes
    ``(trainer, ..., **kwargs)``.

    Per-step events receive device tensors in ``batch_output``: reading them on the host
    (``.item()``, ``float()``, printing) makes the host wait for the device on every step. To
    observe losses without that cost, implement :meth:`on_metrics_flush`, which receives host
    values in batches.
    """

    def on_init_end(self, trainer, **kwargs):
        pass

    def on_training_run_start(self, trainer, **kwargs):
        pass

    def on_train_epoch_start(self, trainer, **kwargs):
        pass

    def on_train_step_start(self, trainer, **kwargs):
        pass

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        pass

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        """Host values of the step metrics since the previous flush
        (a :class:`fasttrain.metrics.FlushedMetrics`)."""

    def on_train_epoch_end(self, trainer, **kwargs):
        pass

    def on_eval_epoch_start(self, trainer, **kwargs):
        pass

    def on_eval_step_start(self, trainer, **kwargs):
        pass

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        pass

    def on_eval_epoch_end(self, trainer, **kwargs):
        pass

    def on_training_run_epoch_end(self, trainer, **kwargs):
        pass

    def on_training_run_end(self, trainer, **kwargs):
        pass

    def on_evaluation_run_start(self, trainer, **kwargs):
        pass

    def on_evaluation_run_end(self, trainer, **kwargs):
        pass

    def on_stop_training_error(self, trainer, **kwargs):
        pass

    def on_training_interrupted(self, trainer, signal_number, **kwargs):
        """Fired once when SIGINT or SIGTERM asks a training run to stop."""


def _overrides(callback, event: str) -> bool:
    """Whether ``callback`` does something on ``event`` (the base class's no-op does not count)."""
    method = getattr(type(callback), event, None)
    if method is None:
        # instance attributes (a function assigned to the object) count too
        return callable(getattr(callback, event, None))
    base = getattr(TrainerCallback, event, None)
    return method is not base


def asks_for_model_outputs(callback, phase: str) -> bool:
    """Whether ``callback`` reads ``batch_output["model_outputs"]`` of ``phase`` ("train" or
    "eval") steps. A callback says so with a ``model_outputs_phases`` attribute (the phases whose
    outputs it reads); one without it asks when it does something at that phase's step end, where
    ``batch_output`` is passed. The graphed engine keeps the outputs in graph memory only for
    phases some callback asks for (docs/engines.md)."""
    phases = getattr(callback, "model_outputs_phases", None)
    if phases is not None:
        return phase in phases
    return _overrides(callback, f"on_{phase}_step_end")


def _warn_misspelled_events(callback) -> None:
    known = set(EVENTS)
    for name in dir(type(callback)):
        if not name.startswith("on_") or name in known:
            continue
        close = difflib.get_close_matches(name, EVENTS, n=1, cutoff=0.85)
        if close:
            warnings.warn(
                f"{type(callback).__name__}.{name} is not a trainer event and will only run if "
                f"fired with call_event({name!r}); did you mean {close[0]!r}?",
                stacklevel=4,
            )


# list methods that change the list in place; each is wrapped to rebuild the dispatch table
_LIST_MUTATORS = (
    "append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
    "__setitem__", "__delitem__", "__iadd__", "__imul__",
)


class _CallbackList(list):
    """The list behind :attr:`CallbackHandler.callbacks`: a plain list whose in-place changes
    (``append``, ``remove``, slice assignment, ...) rebuild the handler's dispatch table."""

    __slots__ = ("_handler",)

    def __init__(self, callbacks, handler):
        super().__init__(callbacks)
        self._handler = handler

    def __reduce_ex__(self, protocol):
        # copies and pickles are plain lists; CallbackHandler.__setstate__ wraps them again
        return list, (list(self),)


def _rebuilding(name):
    change = getattr(list, name)

    def method(self, *args, **kwargs):
        result = change(self, *args, **kwargs)
        self._handler._rebuild()
        return result

    method.__name__ = method.__qualname__ = name
    method.__doc__ = change.__doc__
    return method


for _name in _LIST_MUTATORS:
    setattr(_CallbackList, _name, _rebuilding(_name))


class CallbackHandler:
    """Holds the callbacks of a trainer and fires events on them.

    The handler keeps, for every event, the list of bound methods of the callbacks that implement
    it. Those lists are updated in place whenever the callbacks change: through
    :meth:`add_callback` and :meth:`clear_callbacks`, through the list methods of
    :attr:`callbacks` (``append``, ``insert``, ``remove``, ``pop``, ``del``, slice assignment,
    ...) and by assigning a new list to :attr:`callbacks`. So the trainer may hold on to them
    across steps, and a change takes effect at the next event, also in the middle of an epoch.

    A change made by a callback while an event is being delivered (an assignment as well as an
    in-place change) also applies to the rest of that delivery, as for a Python list changed
    while it is iterated: a callback removed after the running one gets no more calls, one
    appended is called too. Removing the running callback or one before it shifts the list by
    one, so the callback after it misses that one event; remove callbacks from an earlier or
    later event to avoid that. Nothing of this costs anything per step: the work is done when
    the callbacks change.
    """

    def __init__(self, callbacks=()):
        self._dispatch: Dict[str, List] = {}
        self._callbacks = _CallbackList((), self)
        self._enabled = True
        self.add_callbacks(callbacks)

    @property
    def callbacks(self) -> List:
        """The callback instances, in the order they are called. Changing this list, or assigning
        a new one (whose items are copied into the handler's list), changes which callbacks
        receive events from the next event on."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks):
        if callbacks is not self._callbacks:  # ``handler.callbacks += [...]`` already rebuilt
            self._callbacks = _CallbackList(callbacks, self)
            self._rebuild()

    def __setstate__(self, state):
        self.__dict__.update(state)
        # lists of its own: a shallow copy must not share (and clear) the original's, which
        # the training loop holds
        self._dispatch = {event: [] for event in state["_dispatch"]}
        self._callbacks = _CallbackList(self._callbacks, self)
        self._rebuild()

    def add_callbacks(self, callbacks):
        for callback in callbacks:
            self.add_callback(callback)

    def add_callback(self, callback):
        instance = callback() if isinstance(callback, type) else callback
        cls = type(instance)
        if any(type(existing) is cls for existing in self.callbacks):
            raise ValueError(
                f"The callback {cls.__name__} was added twice; a trainer takes one instance of "
                f"each callback class. Callbacks already present: {self.callback_list}"
            )
        _warn_misspelled_events(instance)
        self.callbacks.append(instance)  # rebuilds the dispatch table

    def clear_callbacks(self):
        self.callbacks = []  # a new list, so one a caller kept keeps its items

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self):
        return len(self.callbacks)

    @property
    def callback_list(self) -> List[str]:
        return [type(cb).__name__ for cb in self.callbacks]

    def _rebuild(self):
        for event, methods in self._dispatch.items():
            methods[:] = [getattr(cb, event) for cb in self.callbacks if _overrides(cb, event)]

    def handlers(self, event: str) -> List:
        """The bound methods that ``event`` calls, in callback order (a live list)."""
        methods = self._dispatch.get(event)
        if methods is None:
            methods = [getattr(cb, event) for cb in self.callbacks if _overrides(cb, event)]
            self._dispatch[event] = methods
        return methods

    def call_event(self, event: str, *args, **kwargs):
        """Call ``event`` on every callback that implements it; others are skipped."""
        self.call_methods(self.handlers(event), *args, **kwargs)

    def call_methods(self, methods: List, *args, **kwargs):
        """Call the bound methods returned by :meth:`handlers` (the trainer resolves per-step
        events once per epoch); a callback raising ``CallbackMethodNotImplementedError`` is
        skipped."""
        if not self._enabled:
            return
        for method in methods:
            try:
                method(*args, **kwargs)
            except CallbackMethodNotImplementedError:
                continue
