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

from typing import Dict, List, Tuple

import torch


def compiles_so_far() -> int:
    """Frames dynamo compiled in this process (a count that only grows)."""
    from torch._dynamo import convert_frame

    counter = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
    if counter is not None:
        return sum(counter.values())
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _guard_failures() -> Dict[object, list]:
    return getattr(torch._dynamo.utils, "guard_failures", {})


class CompileMark:
    """Taken before some part of a step runs: afterwards, how many frames compiled since and the
    guard failures dynamo recorded for them."""

    def __init__(self) -> None:
        self._compiles = compiles_so_far()
        self._failures = {code: len(reasons) for code, reasons in _guard_failures().items()}

    def compiled(self) -> int:
        return compiles_so_far() - self._compiles

    def guard_failures(self) -> List[Tuple[str, str]]:
        """``(function name, failed guard)`` for each guard failure dynamo recorded since the
        mark (its text's first line)."""
        found = []
        for code, reasons in list(_guard_failures().items()):
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


def stale_capture_reason(mark: CompileMark) -> str:
    """Why a step that compiled while it was captured is not kept as a graph (for a warning)."""
    failures = mark.guard_failures()
    which = f" (dynamo's guard that failed: {failures[-1][1][:300]})" if failures else ""
    return (
        "the step compiled again while it was captured: its hooks read a Python value that changes "
        f"between steps{which}, and a CUDA graph would replay the value it saw at capture. Keep "
        "values such as step counters or the batch index out of the compiled hooks (log them from "
        "a callback), or pass them as tensors"
    )
