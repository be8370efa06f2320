"""Reading the allocator's history (tests/memory_trace.py) on hand-made traces: the GPU memory
tests name what was alive at a peak with it, so it must find the peak's moment, not the end's."""

from __future__ import annotations

from memory_trace import allocation_site, describe_peak, live_at_peak

MIB = 2**20


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


MODEL = [frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 3000, "cross_entropy"),
         frame("/repo/tests/engine_cases.py", 77, "forward"),
         frame("/repo/fasttrain/engine/compiled.py", 200, "train_forward")]
ENGINE = [frame("/usr/lib/python3/site-packages/torch/cuda/graphs.py", 90, "__enter__"),
          frame("/repo/fasttrain/engine/graph_buffers.py", 40, "__init__")]


def alloc(addr, mib, frames=None):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": frames or []}


def free(addr, mib):
    return {"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}


def completed(addr, mib):
    return {"action": "free_completed", "addr": addr, "size": mib * MIB, "frames": []}


TRACE = [
    alloc(1, 128, MODEL),  # logits
    alloc(2, 128, MODEL),  # log-softmax
    free(1, 128),
    completed(1, 128),
    alloc(3, 4, ENGINE),  # a static buffer
    alloc(4, 128),  # backward: no Python frames
    alloc(5, 128),  # the peak: 2 + 3 + 4 + 5 = 388 MiB
    free(5, 128),
    free(4, 128),
    alloc(6, 200, ENGINE),  # later, lower: 2 + 3 + 6 = 332 MiB
    free(99, 64),  # allocated before recording started: ignored
]


def test_the_blocks_alive_at_the_peak_are_those_of_its_moment_not_the_end():
    peak, at, live = live_at_peak(TRACE)
    assert peak == (128 + 4 + 128 + 128) * MIB
    assert at == 6
    assert sorted(e["addr"] for e in live) == [2, 3, 4, 5]


def test_a_free_is_counted_when_requested_and_completion_is_not_counted_twice():
    peak, at, live = live_at_peak([alloc(1, 10), free(1, 10), completed(1, 10), alloc(2, 5), alloc(3, 6)])
    assert (peak, at, sorted(e["addr"] for e in live)) == (11 * MIB, 4, [2, 3])


def test_the_site_is_the_innermost_frame_of_the_model_fasttrain_or_the_tests():
    assert allocation_site(MODEL) == "tests/engine_cases.py:77 forward"
    assert allocation_site(ENGINE) == "fasttrain/engine/graph_buffers.py:40 __init__"
    assert allocation_site([frame("/x/site-packages/torch/optim/adamw.py", 5, "step")]) == "adamw.py:5 step"
    assert allocation_site([]).startswith("no Python frames")


def test_the_description_groups_by_size_and_site_largest_first():
    text = describe_peak(TRACE, min_bytes=8 * MIB)
    assert text.startswith("traced allocated peak 388.0 MiB at event 7 of 11"), text
    groups = text.split(": ", 1)[1].split("; ")
    assert groups == [
        "2 x 128.0 MiB at no Python frames (autograd's backward thread or C++)",
        "1 x 128.0 MiB at tests/engine_cases.py:77 forward",
        "4.0 MiB in blocks under 8 MiB",
    ], groups


def test_groups_beyond_the_top_are_summed():
    trace = [alloc(i, 10 + i, [frame(f"/repo/fasttrain/m{i}.py", i, "f")]) for i in range(5)]
    text = describe_peak(trace, top=2)
    assert "1 x 14.0 MiB at fasttrain/m4.py:4 f; 1 x 13.0 MiB at fasttrain/m3.py:3 f; 33.0 MiB in 3 other groups" in text, text


def test_an_empty_history_says_so():
    assert describe_peak([]) == "no allocation traced"


def test_recording_that_cannot_start_runs_the_block_and_says_why(monkeypatch):
    import torch

    from memory_trace import recorded_history

    def refuse(*args, **kwargs):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    notes, ran = [], []
    with recorded_history(notes):
        ran.append(True)
    assert ran == [True]
    assert notes == ["(memory history not recorded: RuntimeError('no CUDA here'))"]


def test_the_reserved_peak_lists_the_segments_by_size_site_and_pool():
    trace = [
        {"action": "segment_alloc", "addr": 100, "size": 256 * MIB, "frames": MODEL, "pool_id": (0, 0)},
        alloc(100, 128, MODEL),
        {"action": "segment_alloc", "addr": 500, "size": 512 * MIB, "frames": ENGINE, "pool_id": (1, 2)},
        {"action": "segment_free", "addr": 100, "size": 256 * MIB, "frames": [], "pool_id": (0, 0)},
        {"action": "segment_alloc", "addr": 900, "size": 64 * MIB, "frames": ENGINE, "pool_id": (1, 2)},
    ]
    peak, at, live = live_at_peak(trace, segments=True)
    assert (peak, at, [e["addr"] for e in live]) == (768 * MIB, 2, [100, 500])
    text = describe_peak(trace, segments=True)
    assert text == (
        "traced reserved peak 768.0 MiB at event 3 of 5 (reached by an allocation at "
        "fasttrain/engine/graph_buffers.py:40 __init__): 1 x 512.0 MiB at fasttrain/engine/graph_buffers.py:40 "
        "__init__ (pool (1, 2)); 1 x 256.0 MiB at tests/engine_cases.py:77 forward (pool (0, 0))"
    ), text
