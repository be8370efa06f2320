"""What was alive on the device when a run's allocated memory peaked, read from the CUDA caching
allocator's event history (``torch.cuda.memory._record_memory_history``).

``max_memory_allocated`` says how high the memory went, not what held it. The GPU memory tests
record the allocator's history around a training run and, when a peak is above its limit, name
the blocks alive at that moment: their sizes, and where they were allocated (the innermost Python
frame of the model, fasttrain or the tests; allocations made by autograd's backward thread carry
no Python frames). Comparing eager's list with a compiled or graphed engine's shows which tensors
an engine keeps beside the ones eager keeps.

The reading of a history is plain Python over the snapshot's trace entries, tested on the CPU
(tests/test_memory_trace.py); only recording needs CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Tuple

#: path fragments of the frames that say where an allocation comes from: the model (in the
#: tests' cases), fasttrain, or a third-party model's package
_OWN_FRAMES = ("/fasttrain/", "/tests/", "/transformers/")
_MIB = 2**20


def live_at_peak(trace: Iterable[dict], segments: bool = False) -> Tuple[int, int, List[dict]]:
    """``(peak bytes, index of the event that reached it, entries alive then)``, counting only
    what the history saw allocated: a block allocated before recording started and freed during
    it is ignored. Bytes are released when the free is requested, as the allocator's
    ``allocated_bytes`` counter does (``free_completed`` only tells when the block is reusable).
    ``segments``: the same for the segments the allocator reserved from the device (the
    reserved peak), each entry carrying the frames of the allocation that made it reserve."""
    grow, shrink = ("segment_alloc", "segment_free") if segments else ("alloc", "free_requested")
    live = {}
    total = peak = 0
    peak_at = -1
    at_peak: List[dict] = []
    for index, entry in enumerate(trace):
        action = entry.get("action")
        if action == grow:
            live[entry["addr"]] = entry
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, index
                at_peak = list(live.values())
        elif action == shrink:
            freed = live.pop(entry["addr"], None)
            if freed is not None:
                total -= freed["size"]
    return peak, peak_at, at_peak


def allocation_site(frames: Optional[list]) -> str:
    """The innermost frame in the model, fasttrain or the tests, else the innermost frame."""
    if not frames:
        return "no Python frames (autograd's backward thread or C++)"
    for frame in frames:
        if any(part in frame.get("filename", "") for part in _OWN_FRAMES) and "memory_trace" not in frame.get("filename", ""):
            return _frame_text(frame)
    return _frame_text(frames[0])


def _frame_text(frame: dict) -> str:
    filename = frame.get("filename", "?")
    for marker in _OWN_FRAMES:
        if marker in filename:
            filename = marker.strip("/") + "/" + filename.split(marker, 1)[1]
            break
    else:
        filename = filename.rsplit("/", 1)[-1]
    return f"{filename}:{frame.get('line', '?')} {frame.get('name', '?')}"


def describe_peak(trace: List[dict], top: int = 8, min_bytes: int = _MIB, segments: bool = False) -> str:
    """One line: the traced peak and the largest groups of blocks alive at it, by size and site
    (and by pool, for ``segments``), largest first (blocks under ``min_bytes`` are summed apart)."""
    peak, peak_at, live = live_at_peak(trace, segments)
    if peak_at < 0:
        return "no segment traced" if segments else "no allocation traced"
    groups = {}
    small = 0
    for entry in live:
        if entry["size"] < min_bytes:
            small += entry["size"]
            continue
        site = allocation_site(entry.get("frames"))
        if segments:
            site = f"{site} (pool {tuple(entry.get('pool_id') or ())})"
        key = (entry["size"], site)
        groups[key] = groups.get(key, 0) + 1
    ranked = sorted(groups.items(), key=lambda item: (-item[0][0] * item[1], item[0][1]))
    parts = [f"{count} x {size / _MIB:.1f} MiB at {site}" for (size, site), count in ranked[:top]]
    rest = sum(size * count for (size, _), count in ranked[top:])
    if rest:
        parts.append(f"{rest / _MIB:.1f} MiB in {len(ranked) - top} other groups")
    if small:
        parts.append(f"{small / _MIB:.1f} MiB in blocks under {min_bytes / _MIB:.0f} MiB")
    reached_by = allocation_site(trace[peak_at].get("frames"))
    what = "reserved" if segments else "allocated"
    return (f"traced {what} peak {peak / _MIB:.1f} MiB at event {peak_at + 1} of {len(trace)} (reached by an "
            f"allocation at {reached_by}): " + "; ".join(parts))


@contextlib.contextmanager
def recorded_history(notes: list, max_entries: int = 500_000):
    """Record the allocator's history (Python frames) inside the block and append its
    :func:`describe_peak` to ``notes``. A diagnostic: when recording is not available the note
    says so and the block runs unrecorded."""
    import torch

    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail the test it explains
        notes.append(f"(memory history not recorded: {exc!r})")
        yield
        return
    try:
        yield
        device = torch.cuda.current_device()
        traces = torch.cuda.memory._snapshot().get("device_traces") or []
        trace = traces[device] if device < len(traces) else []
        notes.append(describe_peak(trace))
        notes.append(describe_peak(trace, segments=True))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
