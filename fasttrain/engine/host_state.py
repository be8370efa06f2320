"""The Python state a captured step changes, which a CUDA graph's replay would not change again.

A replay runs the kernels its capture recorded and no Python: an attribute a hook changes inside
the compiled step (a counter on the trainer, ``self.calls += 1`` on the model, predictions
appended to a list) changes once, during the capture, and never at the replays that follow, with
no error. Dynamo does not always recompile for it either: a counter on the trainer that changed
during the warm-up is traced as a dynamic integer, so the capture sees no new compile.

:class:`HostStateWatch` compares the attributes of the objects whose hooks the step runs (the
trainer, the model and the module under its wrapper) before and after a capture: plain values
(numbers, strings, flags, None) by value, and lists, dicts and sets changed in place by length.
Such a change refuses the capture, and the values are put back, so that the step that runs
instead changes them once, as eager does. A tensor (or a container of tensors) assigned anew is
not a change a replay misses: it holds the graph's outputs, which each replay overwrites
(``self.last_output = output`` shows the latest step, as in eager).

Lightning's ``self.log`` calls are not among them: fasttrain.lightning records those inside the
step and hands them back after every replay (``HostEffects``), on the trainer's result collection,
not on the module.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

_PLAIN = (int, float, bool, str, bytes, complex, type(None))
_CONTAINERS = (list, dict, set)


def _state_of(value) -> tuple:
    if isinstance(value, _PLAIN):
        return ("value", type(value), value)
    if isinstance(value, _CONTAINERS):
        return ("container", id(value), len(value))
    return ("object",)


def _copy_of(value):
    return copy.copy(value) if isinstance(value, _CONTAINERS) else None


def _replay_misses(before: tuple, after: tuple) -> bool:
    """Whether a change from state ``before`` to ``after`` is one a replay would not redo.

    A new plain value (a counter, a flag, a length) is computed on the host; so is a container
    that grew or shrank in place (an appended prediction). A tensor, or a container of tensors,
    assigned anew is not: it holds the graph's outputs, which every replay overwrites, so the
    attribute shows the latest step's values as in eager."""
    if before[0] == "value" or after[0] == "value":
        return before != after
    if before[0] == after[0] == "container" and before[1] == after[1]:
        return before[2] != after[2]
    return False


class HostStateWatch:
    """The attributes of ``owners``, ``(object, label)`` pairs, as a capture starts."""

    def __init__(self, owners):
        self._entries: List[Tuple[object, str, Dict[str, object], Dict[str, tuple], Dict[str, object]]] = []
        for owner, label in owners:
            attributes = getattr(owner, "__dict__", None)
            if attributes is None:
                continue
            values = dict(attributes)
            states = {name: _state_of(value) for name, value in values.items()}
            copies = {name: _copy_of(value) for name, value in values.items() if isinstance(value, _CONTAINERS)}
            self._entries.append((owner, label, values, states, copies))

    def changed(self) -> Optional[str]:
        """The first attribute that changed since the watch began in a way a replay would not
        change it again, as ``"Trainer.calls (int: 3 -> 4)"``; None when none did."""
        for owner, label, values, states, _ in self._entries:
            now = owner.__dict__
            for name in sorted(set(values) | set(now)):
                if name not in now:
                    return f"{label}.{name} (deleted)"
                state = _state_of(now[name])
                if name not in values:
                    if state[0] == "value":
                        return f"{label}.{name} (set for the first time, to {now[name]!r})"
                    continue
                if _replay_misses(states[name], state):
                    return f"{label}.{name} ({_describe(values[name], states[name], now[name], state)})"
        return None

    def restore(self) -> None:
        """Put every watched attribute back as it was (the contents of lists, dicts and sets too)."""
        for owner, _, values, _, copies in self._entries:
            now = owner.__dict__
            for name in [name for name in now if name not in values]:
                del now[name]
            for name, value in values.items():
                now[name] = value
                original = copies.get(name)
                if original is None:
                    continue
                if isinstance(value, list):
                    value[:] = original
                else:
                    value.clear()
                    value.update(original)


def _describe(before, before_state: tuple, after, after_state: tuple) -> str:
    if before_state[0] == after_state[0] == "container":
        return f"a {type(after).__name__} changed in place: {before_state[2]} -> {after_state[2]} items"
    return f"{type(after).__name__}: {before!r} -> {after!r}"
