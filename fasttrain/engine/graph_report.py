"""How many graphs a compiled hook became, and why it broke: read from dynamo's own records.

Dynamo counts every graph it hands to the backend (``counters["stats"]["unique_graphs"]``) and
every graph break by its reason (``counters["graph_break"]``). :class:`CountingCall` reads both
around the first call of a compiled function that succeeds (the call that traces it) and keeps
the difference as a :class:`HookGraphs`. Later calls pass straight through; a new shape that
traces again later (the last, partial batch) adds graphs that are not counted here."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Tuple

from torch._dynamo.utils import counters

__all__ = ["CountingCall", "HookGraphs"]


@dataclass(frozen=True)
class HookGraphs:
    """What one compiled hook became at its first traced call."""

    #: graphs dynamo compiled for it: 1 when traced whole; with graph breaks, one per piece
    #: (including graphs of functions it calls that were compiled as frames of their own)
    graphs: int
    #: graph breaks dynamo recorded while tracing it
    breaks: int
    #: the distinct reasons of those breaks, as dynamo words them (first line)
    reasons: Tuple[str, ...] = ()


def _break_counts() -> Counter:
    return Counter(counters["graph_break"])


class CountingCall:
    """``fn``, counting the graphs and graph breaks of its first successful call."""

    __slots__ = ("fn", "report")

    def __init__(self, fn):
        self.fn = fn
        self.report: Optional[HookGraphs] = None

    def __call__(self, *args, **kwargs):
        if self.report is not None:
            return self.fn(*args, **kwargs)
        graphs_before = counters["stats"]["unique_graphs"]
        breaks_before = _break_counts()
        result = self.fn(*args, **kwargs)
        new_breaks = _break_counts() - breaks_before
        reasons = tuple(dict.fromkeys(reason.strip().splitlines()[0] for reason in new_breaks if reason.strip()))
        self.report = HookGraphs(
            graphs=counters["stats"]["unique_graphs"] - graphs_before,
            breaks=sum(new_breaks.values()),
            reasons=reasons,
        )
        return result
