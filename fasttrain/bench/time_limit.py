"""Fitting a benchmark into a time limit: ``fasttrain bench --time-limit SECONDS``.

A GPU machine lends a command a fixed time, and a benchmark cut off by it keeps only the repeats
every peer finished. So, given a limit, the run is sized to end inside it:

1. After the first peer's set-up, its steady step time (from its untimed counting runs, after
   compiling) estimates the whole run, as the command line's estimate does. When the step work of
   every peer's set-up (``3W + N`` steps) and repeats (``2W + N`` each) would take more than
   ``STEP_WORK_SHARE`` of the time left, at ``PEER_SPREAD`` times the first peer's step time,
   the repeats are cut (to ``MIN_REPEATS``), then the steps and warm-up (in proportion, to
   ``MIN_STEPS`` and ``MIN_WARMUP``), then the repeats to one. The rest of the time is for what
   no step time predicts: compiling, capturing and building the other peers.
2. A later peer's set-up may use the time left less what the repeats need: one repeat of the
   peers set up by then (at ``REPEAT_MARGIN``), and at least ``TIMING_SHARE`` of the limit
   (``repeat_room``). When that is gone, the peer and the ones after it are skipped, and a set-up
   still running at that point is stopped and the peer skipped.
3. Before each repeat: the repeat must fit, at ``REPEAT_MARGIN`` times the last repeat's (or the
   counting runs') duration; the first repeat's steps are cut to fit. Then the run stops, keeping
   the repeats done.
4. At the limit itself the run stops as on Ctrl-C: the repeat in progress is dropped for every
   peer, what completed is written.

What was cut is said in the result's ``settings["time_limit_notes"]``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional, Tuple

#: the share of the time left after the first set-up that the planned step work may take
STEP_WORK_SHARE = 0.4
#: how many times slower than the first peer another peer's step may be (Lightning ran at half
#: the bare loop's speed on the H200's MLP)
PEER_SPREAD = 2.0
MIN_REPEATS = 2
MIN_STEPS = 20
#: the fewest warm-up steps a cut leaves (fewer only where fewer were asked for): a peer that
#: starts a run anew on each call (a Lightning ``fit``) warms up and captures its CUDA graphs
#: in its first steps each time; the shorter call of a timed pair must hold them, or the
#: pair's difference bills them to the measured steps
MIN_WARMUP = 8
#: a repeat starts only when this many times its expected duration is left
REPEAT_MARGIN = 1.2
#: the share of the limit that set-ups always leave to the timed repeats
TIMING_SHARE = 0.15


def step_work(steps: int, warmup: int, repeats: int) -> int:
    """Steps one peer runs: set-up (warm-up call, two counting calls) and the timed pairs."""
    return 3 * warmup + steps + repeats * (2 * warmup + steps)


def fit_schedule(
    per_step: float, num_peers: int, seconds: float, steps: int, warmup: int, repeats: int
) -> Tuple[int, int, int]:
    """``(steps, warmup, repeats)`` whose step work for ``num_peers`` peers, at ``PEER_SPREAD *
    per_step`` seconds a step, takes at most ``STEP_WORK_SHARE * seconds`` (or the smallest
    schedule, when even that does not)."""
    budget = STEP_WORK_SHARE * seconds

    def cost(n: int, w: int, r: int) -> float:
        return num_peers * step_work(n, w, r) * PEER_SPREAD * per_step

    while cost(steps, warmup, repeats) > budget:
        if repeats > MIN_REPEATS:
            repeats -= 1
        elif steps > MIN_STEPS:
            new_steps = max(MIN_STEPS, steps // 2)
            warmup = max(min(warmup, MIN_WARMUP), round(warmup * new_steps / steps))
            steps = new_steps
        elif repeats > 1:
            repeats = 1
        else:
            break
    return steps, warmup, repeats


def steps_that_fit(pair_seconds: Iterable[Tuple[float, int]], warmup: int, steps: int, seconds: float) -> int:
    """The measured steps per timed pair such that one repeat takes at most ``seconds / REPEAT_MARGIN``,
    given each peer's ``(seconds, steps)`` of a pair of calls run before; at least 1, at most ``steps``."""
    per_step = sum(s / n for s, n in pair_seconds if n > 0)
    if per_step <= 0:
        return steps
    fit = int(seconds / REPEAT_MARGIN / per_step) - 2 * warmup
    return max(1, min(steps, fit))


class TimeLimit:
    """The end of the run, and what was cut to reach it. ``start`` defaults to now; the command
    line passes the moment it started, so imports and building the workload count too."""

    def __init__(self, seconds: float, start: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        if not seconds > 0:
            raise ValueError(f"a time limit must be positive, got {seconds}")
        self.seconds = seconds
        self.clock = clock
        self.end = (clock() if start is None else start) + seconds
        self.notes: List[str] = []

    def left(self) -> float:
        return self.end - self.clock()

    def repeat_room(self, pair_seconds: Iterable[float]) -> float:
        """Seconds a set-up may still take: the time left less one repeat of the peers whose
        pairs take ``pair_seconds`` (at ``REPEAT_MARGIN``), and less at least ``TIMING_SHARE`` of
        the limit."""
        return self.left() - max(REPEAT_MARGIN * sum(pair_seconds), TIMING_SHARE * self.seconds)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
