"""Logger calls inside compiled hooks are left out of the trace instead of breaking the graph.

Dynamo cannot trace a ``logging.Logger`` method: each call in a forward (transformers' models call
``logger.warning_once`` in theirs) is a graph break, or a failed trace under ``fullgraph=True``.
``torch._dynamo.config.ignore_logging_functions`` (torch >= 2.11; ``ignore_logger_methods`` is its
older name) lists functions that tracing treats as no-ops. fasttrain adds the Logger's methods to
it only while one of its compiled functions is called (tracing, if any, happens inside that call)
and takes them out again after, so a ``torch.compile`` of the user's own is not affected. The cost
is one read of dynamo's config and two set updates per call, about 2.6 microseconds on a 2-core Xeon
(5.4 when the exit read the config again and the methods were looked up on every call;
``torch._dynamo.config.patch`` costs about a hundred). The methods are looked up again when the
``Logger`` class gains or loses an attribute (transformers adds its ``*_once`` methods when it is
imported); a method replaced in place keeps its old function in the list, so calls to the new one
break the graph as they would without fasttrain.

What it means for the messages: a call left out of a compiled graph does not run, so a message a
model logs from inside its compiled forward is not printed (it is when the hook runs eagerly).

Dynamo logs its configuration with every compiled frame's metrics, sorting each set in it. Torch
2.13 leaves this setting out of that record; torch 2.11 sorts it too, and a set of functions cannot
be sorted, so each compile logged an ERROR with a traceback ("Unexpected exception logging
compilation metrics"). Where a probe shows this torch does so, :func:`_record_config_without_ignored`
makes the record leave the setting out as newer torch does (installed once, at the first compiled
call).
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "LOGGER_METHOD_NAMES", "ignored_logging_functions", "ignoring_logger_calls", "logger_methods",
    "with_logger_calls_ignored",
]

#: the methods of ``logging.Logger`` whose calls are left out; the ``*_once`` and ``warning_advice``
#: methods are the ones transformers adds to the class when it is imported
LOGGER_METHOD_NAMES = (
    "debug", "info", "warning", "warn", "error", "exception", "critical", "log",
    "warning_once", "info_once", "warning_advice",
)


def logger_methods() -> set:
    """The Logger methods to ignore now (transformers may have added some since the last call)."""
    return {method for method in (getattr(logging.Logger, name, None) for name in LOGGER_METHOD_NAMES) if method}


#: (the number of attributes of ``logging.Logger`` they were looked up at, the methods)
_methods_seen = (-1, ())


def _current_logger_methods() -> tuple:
    """:func:`logger_methods`, looked up again only when ``logging.Logger``'s attributes changed
    in number (one ``len`` per call instead of a lookup per name)."""
    global _methods_seen
    size = len(logging.Logger.__dict__)
    if size != _methods_seen[0]:
        _methods_seen = (size, tuple(logger_methods()))
    return _methods_seen[1]


def ignored_logging_functions():
    """Dynamo's set of logging functions it traces as no-ops (the object itself, not a copy)."""
    # the older name where this torch has only that one; None where it has neither: logger calls
    # then break the graph as before
    config = torch._dynamo.config
    for name in ("ignore_logging_functions", "ignore_logger_methods"):
        ignored = getattr(config, name, None)
        if ignored is not None:
            return ignored
    return None


def _config_record_sorts_ignored_functions(ignored: set) -> bool:
    """Whether dynamo's record of its configuration (``torch._dynamo.utils``' private
    ``_get_dynamo_config_for_logging``, called for every compiled frame's metrics) fails on a set of
    ignored logging functions, as it does on torch 2.11."""
    record = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    if record is None:
        return False
    probe = tuple(method for method in (logging.Logger.debug, logging.Logger.info) if method not in ignored)
    ignored.update(probe)
    try:
        record()
    except TypeError:
        return True
    finally:
        ignored.difference_update(probe)
    return False


def _record_config_without_ignored(record):
    """``record`` (dynamo's configuration record) taken with the ignored logging functions left out
    for its duration, as torch 2.13 leaves them out of it."""

    def without_ignored():
        ignored = ignored_logging_functions()
        held = set(ignored)
        ignored.clear()
        try:
            return record()
        finally:
            ignored.update(held)

    without_ignored.wrapped = record
    return without_ignored


_config_record_checked = False


def _keep_config_record_working(ignored: set) -> None:
    global _config_record_checked
    if _config_record_checked:
        return
    _config_record_checked = True
    if _config_record_sorts_ignored_functions(ignored):
        utils = torch._dynamo.utils
        utils._get_dynamo_config_for_logging = _record_config_without_ignored(utils._get_dynamo_config_for_logging)


class ignoring_logger_calls:
    """A context in which dynamo traces Logger method calls as no-ops (the ones it did not ignore
    already are added, and removed again on exit)."""

    __slots__ = ("added", "ignored")

    def __enter__(self):
        ignored = self.ignored = ignored_logging_functions()
        self.added = ()
        if ignored is not None:
            _keep_config_record_working(ignored)
            self.added = tuple(method for method in _current_logger_methods() if method not in ignored)
            ignored.update(self.added)
        return self

    def __exit__(self, *exc_info):
        # the set entered with: nothing inside a compiled call replaces dynamo's config
        if self.ignored is not None:
            self.ignored.difference_update(self.added)
        return False


def with_logger_calls_ignored(compiled):
    """``compiled`` (a ``torch.compile``d function) called inside :class:`ignoring_logger_calls`."""

    def call(*args, **kwargs):
        with ignoring_logger_calls():
            return compiled(*args, **kwargs)

    call.compiled = compiled
    return call
