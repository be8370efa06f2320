"""Whether a captured step's Python would still run the compiled code it was captured with:
dynamo's own guards, checked on the host before each replay.

Dynamo compiles a hook that reads a Python value (the batch index, Lightning's ``current_epoch``
or ``global_step``, an attribute a callback sets) with that value as a constant, behind a guard,
and keeps one compiled variant per value seen. A CUDA graph replays the kernels of the variant
its capture ran, without running the Python that would choose one. When the warm-up compiled the
variants of every value before the capture (the batch index over a whole first epoch, say), no
compile marks the capture as stale (compile_events.py) and the replays would train with the
captured value for good, with no error.

So the graphed engine keeps, for each compiled function a capture ran, the guards of the variant
it ran (dynamo moves the entry a call runs to the front of the function's cache, so right after
the capture it is the first one), and checks them before each replay against the values the call
would get now: the step context and the static batch the graph reads. Where they fail, the call
would run another variant (or compile one), and the step is not replayed. A check costs what
dynamo's own guard check costs on every call of a compiled function (microseconds, on the host,
no device read); ``torch.compile(mode="reduce-overhead")`` pays the same per call.

The guards cover the compiled function's frame and what it inlines. A hook compiled with graph
breaks runs parts of itself in frames of their own, whose guards the check does not see: values
read only after a graph break are covered by the compile check at capture alone.
"""

from __future__ import annotations

import types
from typing import Callable, List, Optional, Tuple

try:  # dynamo's view of a code object's cache of compiled variants (torch >= 2.1)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as _cache_entries
except ImportError:  # pragma: no cover - a torch without it: replays rely on the capture's compile check
    _cache_entries = None


def compiled_variants(code: types.CodeType) -> list:
    """The compiled variants dynamo keeps for ``code``, the one its last call ran first; empty
    where it keeps none (nothing compiled yet, or a torch that does not show its cache)."""
    return _cache_entries(code) if _cache_entries is not None else []


def variant_in_use(code: types.CodeType):
    """The guards of the compiled variant of ``code`` that its last call ran, or None where dynamo
    keeps none."""
    entries = compiled_variants(code)
    if not entries:
        return None
    return getattr(entries[0], "guard_manager", None)


class ReplayGuards:
    """The guards of the variants one capture ran, with the arguments each call gets.

    :param checks: ``(name, guards, frame_locals)`` per compiled function the capture ran, where
        ``frame_locals()`` gives the function's arguments by name, as the replay's call would get
        them, and ``name`` is the hook it compiles (for the warning).
    """

    __slots__ = ("_checks",)

    def __init__(self, checks: List[Tuple[str, object, Callable[[], dict]]]):
        self._checks = checks

    @classmethod
    def taken(cls, calls: List[Tuple[str, types.CodeType, Callable[[], dict]]]) -> "ReplayGuards":
        """Right after a capture: the guards of the variant each of ``calls`` (``(name, code,
        frame_locals)``) ran."""
        checks = []
        for name, code, frame_locals in calls:
            guards = variant_in_use(code)
            if guards is not None:
                checks.append((name, guards, frame_locals))
        return cls(checks)

    def failure(self) -> Optional[Tuple[str, str]]:
        """``(hook, guard)`` for the first guard that fails now, or None when every compiled
        function would run the variant the graph was captured from. Host only."""
        for name, guards, frame_locals in self._checks:
            values = frame_locals()
            if not guards.check(values):
                parts = guards.check_verbose(values).verbose_code_parts
                return name, " ".join(str(parts[0]).split()) if parts else "a guard"
        return None


def changed_value_reason(guard: str) -> str:
    """What changed when a graph's guards fail, for a warning."""
    return f"a Python value the step's hooks read changed (dynamo's guard that fails now: {guard[:300]})"
