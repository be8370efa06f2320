"""Python integers and floats the hooks read that keep changing, compiled as symbolic values by
the compiled engine.

The engines compile with ``dynamic=False``, so that the batch shapes stay static: dynamo then
compiles every number a hook reads as a constant, behind a guard, and a new value compiles the
hook again. A LightningModule that weighs its loss by ``self.current_epoch``, anneals by
``self.global_step`` or branches on ``batch_idx % 100``, or a trainer whose callback sets a loss
weight before each step, compiled once per value, and at dynamo's recompile limit (8) ran eagerly
for the rest of the run.

The compiled engine notes the guards that made one of its functions compile again (dynamo keeps
them per code object in ``guard_failures``; one dict lookup per call while nothing recompiles). A
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
  static graph.

Only the compiled engine does this: a CUDA graph would replay a symbolic value as captured, so the
graphed engine keeps its constants (and its guard checks, step_guards.py).
"""

from __future__ import annotations

import re
import types
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

#: "<frame>/<entry>: <guard>  # <source line comment>": an equality guard on an integer or a float
#: reached from the function's arguments, as dynamo records it in ``guard_failures`` (torch 2.11
#: writes a float it specialized after tracing it symbolic as ``___as_tensor(<source>).item()``)
_SCALAR_GUARD = re.compile(
    r"^\d+/\d+: (?:___as_tensor\((?=.*\)\.item\(\) ==))?([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*|\[[^\]\s]+\])*)"
    r"(?:\)\.item\(\))? == (?:(-?\d+)|(-?(?:\d+\.\d*|\d+(?=e))(?:e[-+]?\d+)?))$"
)
#: copies compiled with more symbolic values before the engine stops adding them (a function
#: whose numbers keep appearing one by one meets dynamo's recompile limit instead)
MAX_COPIES = 3


def _failures() -> dict:
    return getattr(torch._dynamo.utils, "guard_failures", {})


def scalar_source(failure: str) -> Optional[Tuple[str, bool]]:
    """The source name dynamo gives the number whose equality guard ``failure`` records
    (``L['ctx'].trainer.batch_idx``) and whether it is a float; None for any other guard."""
    first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
    guard = " ".join(first.split("  #")[0].split())
    match = _SCALAR_GUARD.match(guard)
    if match is None:
        return None
    name, path, _, as_float = match.groups()
    return f"L[{name!r}]{path}", as_float is not None


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


class ChangingInts:
    """Per compiled function, the numbers (integers and floats) whose guards keep failing.

    :param code: the code object whose dynamo cache the function compiles into.
    """

    def __init__(self, code: types.CodeType):
        self.code = code
        self._seen = 0
        self._failed: Dict[str, int] = {}
        #: the sources made symbolic so far, and which of them are floats
        self.symbolic: Set[str] = set()
        self.floats: Set[str] = set()
        #: whether a guard on the value of a source made symbolic failed: the copy compiled for
        #: it specialized it again (dynamo does for a float given to ``torch.tensor`` or
        #: ``math.exp``), so the copy compiles once per value as the original did
        self.specialized_again = False

    def newly_changing(self) -> Optional[List[str]]:
        """After a call: the sources to make symbolic now (every one so far), or None. Host only."""
        failures = _failures().get(self.code)
        if not failures or len(failures) == self._seen:
            return None
        new, self._seen = failures[self._seen:], len(failures)
        grown = False
        # one call records a failure per compiled variant: a source made symbolic by this call's
        # first one is not specialized again by its second
        compiled_symbolic = set(self.symbolic)
        for failure in new:
            found = scalar_source(failure)
            if found is None:
                continue
            if found[0] in self.symbolic:
                self.specialized_again |= found[0] in compiled_symbolic
                continue
            source, is_float = found
            self._failed[source] = self._failed.get(source, 0) + 1
            if self._failed[source] >= 2:
                self.symbolic.add(source)
                if is_float:
                    self.floats.add(source)
                grown = True
        return sorted(self.symbolic) if grown else None
