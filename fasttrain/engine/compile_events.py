"""What dynamo compiled while part of a step ran, and which of its guards failed to make it.

A hook that reads a Python value that changes between steps (a counter kept on the trainer, the
batch index, Lightning's ``self.global_step``) is compiled with that value as a constant, behind a
guard; a new value fails the guard and dynamo compiles the hook again. The compiled engine pays
for that in compile time only. A CUDA graph cannot: it replays the kernels its capture recorded
without running the Python that chose them, so the value seen at capture would be replayed for
good. The graphed engine therefore notes what compiles while it captures (:class:`CompileMark`)
and keeps no graph of a step that compiled: it would have been captured with the step's Python
state of that moment, which the warm-up steps before it did not share.

Dynamo counts compilations in two places, neither of them public: ``FRAME_COMPILE_COUNTER`` (every
frame compiled, the ``fullgraph=True`` path included, which ``counters["frames"]`` leaves out) and
``counters["stats"]["unique_graphs"]``, the fallback where the first is missing. The guard that
failed is in ``guard_failures``, per code object, in dynamo's words.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def compiles_so_far() -> int:
    """Frames dynamo compiled in this process (a count that only grows)."""
    from torch._dynamo import convert_frame

    counter = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    if counter is not None:
        return sum(counter.values())
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_activity() -> int:
    """A count that changes whenever dynamo compiles, cheap enough to read around every call of a
    compiled function (two dict lookups, where :func:`compiles_so_far` sums a counter over every
    frame): the graphs it made, and the frames it was asked to compile through its
    graph-break-tolerant entry (a whole-graph compile counts no frame there). Not a number of
    compiles: only whether it changed says anything."""
    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"] + counters["frames"]["total"]


def recorded_guard_failures() -> Dict[object, list]:
    """Dynamo's record of the guards that failed, per code object (the lists only grow)."""
    return getattr(torch._dynamo.utils, "guard_failures", {})


def failure_counts() -> Dict[object, int]:
    """How many guard failures dynamo has recorded so far, per code object."""
    return {code: len(reasons) for code, reasons in list(recorded_guard_failures().items())}


class CompileMark:
    """Taken before some part of a step runs: afterwards, how many frames compiled since and the
    guard failures dynamo recorded for them."""

    def __init__(self) -> None:
        self._compiles = compiles_so_far()
        self._failures = failure_counts()

    def compiled(self) -> int:
        return compiles_so_far() - self._compiles

    def guard_failures(self) -> List[Tuple[str, str]]:
        """``(function name, failed guard)`` for each guard failure dynamo recorded since the
        mark (its text's first line)."""
        found = []
        for code, reasons in list(recorded_guard_failures().items()):
            for reason in reasons[self._failures.get(code, 0):]:
                lines = str(reason).splitlines()
                if lines:
                    found.append((getattr(code, "co_name", "?"), " ".join(lines[0].split())))
        return found

    def saw_changed_values(self) -> bool:
        """Whether what compiled since the mark says the step's Python now reads other values
        than before: a frame compiled again for a guard on a value or object the hooks read, or
        compiled for the first time (a branch the warm-up did not take). Compiles for dynamo's
        global state alone (grad mode, autocast, the torch function mode stack) say nothing of
        the hooks' values: a capture context that differs there from the warm-up's would differ
        the same way at every capture."""
        if not self.compiled():
            return False
        failures = self.guard_failures()
        return not failures or any(not _is_global_state(text) for _, text in failures)


def _is_global_state(guard: str) -> bool:
    lowered = guard.lower()
    return "global_state" in lowered or "global state" in lowered or "torch_function_mode_stack" in lowered


#: what a user whose hooks read Python values that change between steps can do (the graphed
#: engine's warnings, for a capture that compiled and for a replay whose guards failed)
CHANGING_VALUE_ADVICE = (
    "A CUDA graph replays the values its capture saw: keep values such as the batch index, the "
    "epoch or step counters out of the compiled hooks (log from a callback), or pass them as tensors."
)


def stale_capture_reason(mark: CompileMark) -> str:
    """Why a step that compiled while it was captured is not kept as a graph (for a warning)."""
    failures = mark.guard_failures()
    which = f" (dynamo's guard that failed: {failures[-1][1][:300]})" if failures else ""
    return (
        "the step compiled again while it was captured: its hooks read a Python value that changes "
        f"between steps{which}. {CHANGING_VALUE_ADVICE}"
    )


class StaleCapture(RuntimeError):
    """Raised by the graphed engine after a capture during which the hooks compiled again."""


def is_stale(error: BaseException, mark: CompileMark, refusals: type) -> bool:
    """Whether a capture that failed with ``error`` failed for what compiled during it: refused
    for that, or, on a device, failed because of it (a compile may run device work a capture does
    not allow). A refusal for another reason (``refusals``, or a ``ValueError`` from the step's
    Python effects) keeps that reason."""
    return isinstance(error, StaleCapture) or (
        mark.saw_changed_values() and not isinstance(error, (refusals, ValueError))
    )


#: the hook each compiled function of the step runs, by its code's name (fasttrain.lightning adds
#: the backward hooks, compiled on the graphed engine)
HOOKS_OF_COMPILED_CODE = {"_train_forward": "calculate_train_batch_loss", "_update": "optimizer_step"}


def compiling_hook(mark: CompileMark, running: Optional[str]) -> Optional[str]:
    """The trainer hook whose compiled function failed a guard since ``mark``, for a warning;
    else ``running``, the hook the engine was in."""
    names = {name for name, _ in mark.guard_failures()}
    for code_name, hook in HOOKS_OF_COMPILED_CODE.items():
        if code_name in names:
            return hook
    return running


class StaleCaptures:
    """Per graph (phase, last batch, update), the captures in a row that compiled again.

    One such capture is a value that changed once since the warm-up (Lightning's stage from the
    sanity check to validation, a model swapped in for a step, an optimizer state created anew):
    the step runs as one more warm-up step and the next one is captured. The second in a row
    (:data:`MAX_IN_A_ROW`) is a value that changes every step: the phase runs compiled."""

    MAX_IN_A_ROW = 2

    def __init__(self) -> None:
        self._in_a_row: Dict[tuple, int] = {}

    def capture_again_later(self, graph: tuple) -> bool:
        """Note a dropped capture of ``graph``; whether to warm up once more and capture again."""
        self._in_a_row[graph] = self._in_a_row.get(graph, 0) + 1
        return self._in_a_row[graph] < self.MAX_IN_A_ROW

    def kept(self, graph: tuple) -> None:
        self._in_a_row[graph] = 0
