"""Python integers and floats the hooks read that keep changing, compiled as symbolic values by
the compiled engine.

The engines compile with ``dynamic=False``, so that the batch shapes stay static: dynamo then
compiles every number a hook reads as a constant, behind a guard, and a new value compiles the
hook again. A LightningModule that weighs its loss by ``self.current_epoch``, anneals by
``self.global_step`` or branches on ``batch_idx % 100``, or a trainer whose callback sets a loss
weight before each step, compiled once per value, and at dynamo's recompile limit (8) ran eagerly
for the rest of the run.

The compiled engine notes the guards that made one of its functions compile again (dynamo keeps
them per code object in ``guard_failures``; while nothing compiles, a call costs one read of
dynamo's compile counters before it and one after). A
number whose guard failed twice (three values: a value that changed once, such as a stage set at
the start, stays a constant) makes later calls run a fresh copy of that function, compiled once
for all its values:

- an integer is named in ``torch.compiler.config.dynamic_sources`` while the copy runs: dynamo
  traces it as a symbolic integer, dominant over ``dynamic=False`` (a branch on it guards on the
  branch's condition only);
- a float has no such switch: the copy is compiled with ``dynamic=None`` (dynamo's automatic
  dynamic). The copy's code has the original's file, line and name, under which dynamo keeps what
  it saw of each value, so the float, already seen with several values, is traced as a symbolic
  float at the copy's first compile. A batch whose shape changes (a last, smaller batch) is then
  also compiled with a symbolic size in that copy, once, where the original compiles one more
  static graph;
- a number read by a frame dynamo compiles on its own inside the call (the hook's code after a
  graph break: a mixup coefficient drawn with ``random`` or numpy, which dynamo cannot trace,
  reaches the rest of the hook as a local) has a source that no switch can name from outside
  that frame. Its guard failures are recorded under that frame's code, and the engine counts
  those recorded during its function's calls too: the copy is compiled with ``dynamic=None``,
  under which dynamo compiles the value symbolic in that frame at its next new value.

A value the copy specializes again (dynamo does for a float given to ``torch.tensor``,
``math.exp`` or ``round``) fails the copy's guards as it failed the original's: the copy is dropped
at that failure and the hook goes on with its constants, towards dynamo's recompile limit.

Only the compiled engine does this: a CUDA graph would replay a symbolic value as captured, so the
graphed engine keeps its constants (and its guard checks, step_guards.py).
"""

from __future__ import annotations

import re
import types
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from fasttrain.engine.compile_events import compile_activity, failure_counts, recorded_guard_failures
from fasttrain.engine.step_guards import compiled_variants

#: "<frame>/<variant>: <guard>  # <source line comment>": an equality guard on an integer or a float
#: reached from the function's arguments, as dynamo records it in ``guard_failures`` (torch 2.11
#: writes a float it specialized after tracing it symbolic as ``___as_tensor(<source>).item()``)
_SCALAR_GUARD = re.compile(
    r"^\d+/(\d+): (?:___as_tensor\((?=.*\)\.item\(\) ==))?([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*|\[[^\]\s]+\])*)"
    r"(?:\)\.item\(\))? == (?:(-?\d+)|(-?(?:\d+\.\d*|\d+(?=e))(?:e[-+]?\d+)?))$"
)
#: copies compiled with more symbolic values before the engine stops adding them (a function
#: whose numbers keep appearing one by one meets dynamo's recompile limit instead)
MAX_COPIES = 3


def _scalar_guard(failure: str) -> Optional[Tuple[str, bool, str, int]]:
    """``(source, is_float, value, variant)`` of a number's equality guard, else None."""
    first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
    guard = " ".join(first.split("  #")[0].split())
    match = _SCALAR_GUARD.match(guard)
    if match is None:
        return None
    variant, name, path, as_int, as_float = match.groups()
    return f"L[{name!r}]{path}", as_float is not None, as_int if as_float is None else as_float, int(variant)


def scalar_source(failure: str) -> Optional[Tuple[str, bool]]:
    """The source name dynamo gives the number whose equality guard ``failure`` records
    (``L['ctx'].trainer.batch_idx``) and whether it is a float; None for any other guard."""
    found = _scalar_guard(failure)
    return None if found is None else found[:2]


class WithDynamicSources:
    """Calls ``fn`` with ``sources`` added to ``torch.compiler.config.dynamic_sources`` (read when
    dynamo traces; two attribute writes per call)."""

    __slots__ = ("fn", "sources")

    def __init__(self, fn: Callable, sources: str):
        self.fn = fn
        self.sources = sources

    def __call__(self, *args):
        config = torch.compiler.config
        previous = config.dynamic_sources
        config.dynamic_sources = f"{previous},{self.sources}" if previous else self.sources
        try:
            return self.fn(*args)
        finally:
            config.dynamic_sources = previous


class ChangingValues:
    """Per compiled function, the numbers (integers and floats) whose guards keep failing while it
    runs: in its own code, and in the frames dynamo compiles on their own inside its calls (a
    hook's code after a graph break, where a local such as a mixup coefficient drawn by
    ``random`` or numpy is read).

    The engine calls :meth:`before_call` and :meth:`newly_changing` around each call of the
    function; while nothing compiles, each is one read of dynamo's compile counters. Every failure
    under the function's own code counts; under other code, those recorded during its calls.

    :param code: the code object whose dynamo cache the function compiles into.
    :param carried: the copy's predecessor, whose symbolic values the copy was compiled for.
    """

    def __init__(self, code: types.CodeType, carried: "Optional[ChangingValues]" = None):
        self.code = code
        self._compiles = compile_activity()
        # the function's own code is its own: every failure under it counts, also those of calls
        # made before the engine watched (the graphed engine's captures, before it fell back)
        self._seen = failure_counts()
        self._seen[code] = 0
        self._failed: Dict[object, Set[str]] = {}
        #: the sources of the function's own code made symbolic so far, and the floats among them
        self.symbolic: Set[str] = set(carried.symbolic) if carried else set()
        self.floats: Set[str] = set(carried.floats) if carried else set()
        #: (code, source) of numbers that keep changing in other frames compiled inside the calls:
        #: the copy for them is compiled with dynamo's automatic dynamic, which takes them symbolic
        #: at their next new value
        self.nested: Set[tuple] = set(carried.nested) if carried else set()
        #: the integers among them, by source name: automatic dynamic keeps an integer attribute of
        #: a module a constant, ``dynamic_sources`` does not (a name no other frame of the call has)
        self.nested_ints: Set[str] = set(carried.nested_ints) if carried else set()
        self._compiled_for = (set(self.symbolic), set(self.nested))
        # the variants the other frames had before this copy: theirs are the constants' failures
        self._entries_before = {code: len(compiled_variants(code)) for code, _ in self.nested}
        #: whether a value the copy was compiled for failed its guard as a constant again: dynamo
        #: specialized it (as it does for a float given to ``torch.tensor`` or ``math.exp``), so the
        #: copy compiles once per value as the original did
        self.specialized_again = False
        #: dynamo's record of the guard failure that marked the last value found changing
        self.marked_by: Optional[str] = None

    @property
    def dynamic(self) -> bool:
        """Whether the copy must be compiled with dynamo's automatic dynamic (floats, or numbers
        in other frames, which ``dynamic_sources`` cannot name)."""
        return bool(self.floats or self.nested)

    def before_call(self) -> None:
        if compile_activity() != self._compiles:  # compiles outside the calls: not this function's
            self._compiles = compile_activity()
            own = self._seen.get(self.code, 0)
            self._seen = failure_counts()
            self._seen[self.code] = own

    def newly_changing(self) -> Optional[List[str]]:
        """After a call: the sources of the function's own code to make symbolic now (every one so
        far; empty when only other frames' numbers changed), or None. Host only."""
        count = compile_activity()
        if count == self._compiles:
            return None
        self._compiles = count
        own_before, nested_before = self._compiled_for
        # a guard failure names the value a compiled variant holds; one call records one per
        # variant. A value is counted by the distinct values of its failed variants: two of them
        # (a third value is running) mark it
        grown = False
        for code, failures in list(recorded_guard_failures().items()):
            seen = self._seen.get(code, 0)
            if len(failures) == seen:
                continue
            self._seen[code] = len(failures)
            own = code is self.code
            before = self._entries_before.get(code, 0)
            for failure in failures[seen:]:
                found = _scalar_guard(failure)
                if found is None:
                    continue
                source, is_float, value, variant = found
                if own and source in own_before:
                    self.specialized_again = True  # the copy was compiled with it symbolic
                    continue
                key = source if own else (code, source)
                if key in self.symbolic or (key in self.nested and key not in nested_before):
                    continue  # marked already
                if key in nested_before and variant < before:
                    continue  # a constant compiled before this copy, not a variant of it
                values = self._failed.setdefault(key, set())
                values.add(value)
                if len(values) < 2:
                    continue
                if key in nested_before:
                    # automatic dynamic compiles it symbolic at the copy's first new value; two
                    # constants compiled for the copy mean dynamo specialized it
                    self.specialized_again = True
                    continue
                grown = True
                self.marked_by = str(failure)
                if not own:
                    self.nested.add(key)
                    if not is_float:
                        self.nested_ints.add(source)
                    continue
                self.symbolic.add(key)
                if is_float:
                    self.floats.add(key)
        return sorted(self.symbolic) if grown else None
