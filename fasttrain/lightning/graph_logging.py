"""``self.log`` inside a step that the graphed engine captures.

Inside a compiled step, ``self.log`` only records the call (:meth:`ResultStore.log`): the values are
graph outputs, filed by the loop after the step. A CUDA graph's replay runs the recorded kernels
and none of that Python, so nothing would be recorded for a replayed step. :class:`LoggedCalls`
takes the calls a step recorded while it was being captured and hands them back after every
replay, each value a copy of what that replay wrote (the graph overwrites its outputs at the next
replay; a value the loggers or callbacks hold must not change under them).

Other Python side effects of a step cannot be redone: a replay would leave them out without an
error. Lightning's documented way to gather a step's results for the epoch end,
``self.validation_step_outputs.append(loss)``, is one; a step counter kept in an attribute is
another. So a capture that changed the module's own attributes (a list, dict or set that grew or
shrank, a number or another object bound anew) is refused, as is a torchmetrics ``Metric`` logged
inside the step (its update keeps counters in Python): such a step runs compiled instead, and the
engine's fallback warning names the attribute. What the refused capture did to those attributes is
undone first (the step is run again on the fallback), so that a list gathering the step's results
holds each step's once.
"""

from __future__ import annotations

import contextlib
import copy
import numbers

import torch

from fasttrain.engine.capture_policy import HostStateChanged
from fasttrain.engine.context import HostEffects
from fasttrain.lightning.hooks import CAPTURED_CALLBACK_HOOKS

#: where the logged value sits in a call that ResultStore.log recorded
_VALUE = 2
#: attributes fasttrain itself sets on the module around a step
_OWN_ATTRIBUTES = frozenset({"_current_fx_name", "log", "_fasttrain_step_module"})
_CONTAINERS = (list, dict, set)


def _saved_attributes(module) -> dict:
    """The module's attributes, with a shallow copy of each list, dict and set, to undo a step's
    Python changes to them."""
    return {
        key: (value, copy.copy(value) if isinstance(value, _CONTAINERS) else None)
        for key, value in module.__dict__.items()
        if key not in _OWN_ATTRIBUTES
    }


def _restore_attributes(module, saved: dict) -> None:
    state = module.__dict__
    for key in [key for key in state if key not in _OWN_ATTRIBUTES and key not in saved]:
        del state[key]
    for key, (value, contents) in saved.items():
        state[key] = value
        if isinstance(value, list):
            value[:] = contents
        elif isinstance(value, (dict, set)):
            value.clear()
            value.update(contents)


def _python_state(module) -> dict:
    """What a step's Python could change on the module, host-only: each attribute's object and,
    for a list, dict or set, its length."""
    return {
        key: (id(value), len(value) if isinstance(value, _CONTAINERS) else None)
        for key, value in module.__dict__.items()
        if key not in _OWN_ATTRIBUTES
    }


def _changed(before: dict, after: dict):
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            return key
    return None


class LoggedCalls(HostEffects):
    """The ``self.log`` calls of the step being captured, redone after each replay of its graph."""

    def __init__(self, lightning_trainer):
        self.lt = lightning_trainer
        self._apart_calls: list = []

    def _watched(self) -> list:
        # the module, and the callbacks whose hooks run inside the captured step (compiled with
        # the update, or through graphed_hooks.py), with how a warning names each
        hooks = self.lt._hooks
        watched = [(self.lt.lightning_module, "the module")]
        seen = set()
        for name in CAPTURED_CALLBACK_HOOKS:
            for callback, _ in hooks.callback_methods(name):
                if id(callback) not in seen:
                    seen.add(id(callback))
                    watched.append((callback, f"the callback {type(callback).__name__}"))
        return watched

    def mark(self):
        store = self.lt._results
        if store is None:
            return None
        # the hooks the capture runs apart from the compiled step (the backward hooks, compiled
        # on their own: graphed_hooks.py) record their calls too, instead of filing them once
        store.recording = True
        watched = [(owner, label, _python_state(owner), _saved_attributes(owner)) for owner, label in self._watched()]
        return store, len(store.pending), watched

    def taken_since(self, mark):
        if mark is None:
            return None
        store, start, watched = mark
        store.recording = False
        calls = store.pending[start:]
        del store.pending[start:]
        for owner, label, state, _ in watched:
            changed = _changed(state, _python_state(owner))
            if changed is not None:
                raise HostStateChanged(
                    f"the step changed {label}'s attribute {changed!r} in Python (an append, a counter), "
                    "which a CUDA graph's replay would not do again"
                )
        if not calls:
            return None
        for call in calls:
            # a Python number is a constant of the captured step, as the tensor made of it was
            # (logged_numbers.py); the replay guards check it before each replay
            if not isinstance(call[_VALUE], (torch.Tensor, numbers.Number)):
                raise HostStateChanged(
                    f"self.log({call[1]!r}, <{type(call[_VALUE]).__name__}>) inside {call[0]}: a logged "
                    "torchmetrics Metric keeps counters in Python that a CUDA graph's replay does not advance"
                )
        return store, _ReplayedCalls(calls)

    def discard(self, mark) -> None:
        if mark is not None:
            store, start, watched = mark
            store.recording = False
            del store.pending[start:]
            for owner, _, _, saved in watched:
                _restore_attributes(owner, saved)

    def guarded_calls(self) -> list:
        # the backward hooks, compiled while the graphed engine runs (graphed_hooks.py)
        calls = getattr(self.lt._backward_hooks, "replay_calls", None)
        return [] if calls is None else calls()

    @contextlib.contextmanager
    def kept_apart(self):
        # the calls of the update (or of a compiled backward hook) go to a list of their own,
        # empty at every call: its compiled code, whose guards are also checked before each
        # replay, sees the same list then
        store = self.lt._results
        if store is None:
            yield
            return
        forward_calls, own_calls = store.pending, self._apart_calls
        store.pending = own_calls
        try:
            yield
        finally:
            store.pending = forward_calls
            forward_calls.extend(own_calls)
            own_calls.clear()

    def redo(self, effects) -> None:
        if effects is None:
            return
        store, calls = effects
        # calls filed before the step (its eager hooks') go first, as the loop's drain would
        if store.pending or not calls.file_into(store):
            store.pending.extend(calls.with_fresh_values())


class _ReplayedCalls:
    """The calls a captured step recorded, filed again after each replay. Filed straight into
    the store's entries (:meth:`file_into`), a value stays the replay's output tensor and the
    entry copies it where it is read. Filed through the pending list (a call the store has not
    filed alike yet), the values are copies of what the replay wrote (:meth:`with_fresh_values`:
    the next replay overwrites its outputs, and a value the loggers or callbacks hold must not
    change under them; a number is immutable): the scalars of one dtype and device, which is what
    ``self.log`` is given, copied together, one ``stack`` and views of it."""

    __slots__ = ("calls", "_stacked", "_cloned", "_entries", "_entries_loader")

    def __init__(self, calls: list):
        self.calls = calls
        #: ``(entry, its given arguments, batch_size)`` each call files into, as last resolved
        #: (file_into), and the evaluation loader it was resolved for (its index names the entries)
        self._entries = None
        self._entries_loader = None
        groups: dict = {}
        cloned = []
        for i, call in enumerate(calls):
            value = call[_VALUE]
            if isinstance(value, torch.Tensor):
                if value.dim() == 0:
                    groups.setdefault((value.dtype, value.device), []).append(i)
                else:
                    cloned.append(i)
        self._stacked = [(positions, [calls[i][_VALUE] for i in positions])
                         for positions in groups.values() if len(positions) > 1]
        self._cloned = cloned + [positions[0] for positions in groups.values() if len(positions) == 1]

    def fresh_values(self) -> list:
        """The calls' values, each tensor a copy of what the last replay wrote into it."""
        values = [call[_VALUE] for call in self.calls]
        for i in self._cloned:
            values[i] = values[i].detach().clone()  # detached: a copy records no autograd history
        if self._stacked:
            with torch.no_grad():
                for positions, scalars in self._stacked:
                    for i, value in zip(positions, torch.stack(scalars).unbind()):
                        values[i] = value
        return values

    def with_fresh_values(self) -> list:
        return [(*call[:_VALUE], value, *call[_VALUE + 1:]) for call, value in zip(self.calls, self.fresh_values())]

    def file_into(self, store) -> bool:
        """File the calls into ``store``, as its ``drain`` would, where each is one the store has
        filed before with the same arguments (from the second replay on, every
        one): straight into their entries, without the pending list. False, filing nothing,
        where one is not."""
        entries = self._entries
        if entries is not None and self._entries_loader == store.dataloader_idx:
            for entry, given, _ in entries:
                if entry.given_arguments is not given:  # logged since with other arguments
                    entries = None
                    break
        else:
            entries = None
        if entries is None:
            entries = self._entries = store.filed_entries(self.calls)
            self._entries_loader = store.dataloader_idx
            if entries is None:
                return False
        # the replay's own output tensors: an entry copies one where it is read (read_step_value),
        # where a copy here would cost a kernel launch per value and step
        for (entry, _, batch_size), call in zip(entries, self.calls):
            value = call[_VALUE]
            if not entry.holds_live(value):
                store.update_entry(entry, value, batch_size, True)
        return True
