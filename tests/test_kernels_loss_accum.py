"""Device-side loss accumulation: Triton (interpreter on CPU, compiled on GPU) vs reference.

Each call does one fp32 multiply and adds, so Triton and the reference agree exactly on the CPU
(the interpreter rounds each operation like torch); on the GPU the compiler may fuse
``sum + loss * weight`` into one FMA, one rounding fewer, so GPU comparisons allow 1e-6 relative.
"""
import math

import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

import fasttrain.kernels as K

# Finite, non-finite in between (the flag must stick and the sum must show it), fp16 and
# non-power-of-two values; 7 calls with a ring of 3 wrap around twice.
SEQUENCE = [
    (2.5, torch.float32, 32.0),
    (1.25, torch.float16, 32.0),
    (float("nan"), torch.float32, 32.0),
    (0.1, torch.float32, 7.0),
    (float("inf"), torch.float16, 32.0),
    (3.0, torch.float32, 1.0),
    (-0.75, torch.float16, 5.0),
]


def _run(fn, counters, ring, sequence, device="cpu"):
    history = []
    for value, dtype, weight in sequence:
        fn(counters, torch.tensor(value, dtype=dtype, device=device), torch.tensor(weight, device=device), ring)
        history.append((counters.clone(), None if ring is None else ring.clone()))
    return history


def _expected(sequence, ring_size):
    loss_sum = weight_sum = 0.0
    flag = 0.0
    ring = [0.0] * ring_size
    for i, (value, dtype, weight) in enumerate(sequence):
        value = torch.tensor(value, dtype=dtype).float().item()
        loss_sum += value * weight
        weight_sum += weight
        flag = max(flag, 0.0 if math.isfinite(value) else 1.0)
        if ring_size:
            ring[i % ring_size] = value
    return loss_sum, weight_sum, flag, len(sequence), ring


@C.requires_interpreter
@pytest.mark.parametrize("ring_size", [0, 1, 3, 16])
@pytest.mark.parametrize("length", [2, 7])
def test_triton_matches_reference(ring_size, length):
    seq = SEQUENCE[:length]
    c1, c2 = torch.zeros(4), torch.zeros(4)
    r1 = torch.zeros(ring_size) if ring_size else None
    r2 = torch.zeros(ring_size) if ring_size else None
    h1 = _run(K.accumulate_loss_triton, c1, r1, seq)
    h2 = _run(K.accumulate_loss_reference, c2, r2, seq)
    for (a, ra), (b, rb) in zip(h1, h2):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        if ring_size:
            torch.testing.assert_close(ra, rb, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("ring_size", [0, 3])
def test_reference_matches_plain_python(ring_size):
    c = torch.zeros(4)
    r = torch.zeros(ring_size) if ring_size else None
    _run(K.accumulate_loss_reference, c, r, SEQUENCE)
    loss_sum, weight_sum, flag, calls, ring = _expected(SEQUENCE, ring_size)
    assert math.isnan(c[0].item()) and math.isnan(loss_sum)  # a non-finite loss shows in the mean
    assert c[1:].tolist() == [weight_sum, flag, calls]
    if ring_size:
        torch.testing.assert_close(r, torch.tensor(ring), rtol=0, atol=0, equal_nan=True)
    finite = [s for s in SEQUENCE if math.isfinite(s[0])][:2]
    c.zero_()
    _run(K.accumulate_loss_reference, c, None, finite)
    expected = _expected(finite, 0)
    torch.testing.assert_close(c, torch.tensor(expected[:4], dtype=torch.float32), rtol=1e-6, atol=0)


def test_loss_counters_read_is_one_packed_copy_in_order():
    counters = K.LossCounters("cpu", ring_size=3)
    assert counters.counters.data_ptr() == counters.buffer.data_ptr()  # views of one buffer
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        counters.accumulate(torch.tensor(value), torch.tensor(2.0))
    snap = counters.read()
    assert snap.loss_sum == 30.0 and snap.weight_sum == 10.0 and snap.calls == 5
    assert not snap.nonfinite and snap.mean == 3.0
    assert snap.recent == [3.0, 4.0, 5.0]  # oldest first across the wrap
    counters.accumulate(torch.tensor(float("inf")), torch.tensor(1.0))
    assert counters.read().nonfinite
    counters.reset()
    snap = counters.read()
    assert snap.calls == 0 and snap.recent == [] and math.isnan(snap.mean)
    plain = K.LossCounters("cpu")
    plain.accumulate(torch.tensor(1.5, dtype=torch.float16), torch.tensor(4.0))
    assert plain.read().mean == 1.5 and plain.ring is None


def test_reset_counters():
    c, r = torch.ones(4), torch.ones(3)
    K.reset_counters_(c, r)
    assert c.sum().item() == 0 and r.sum().item() == 0


def test_clear_errors():
    loss, w = torch.tensor(1.0), torch.tensor(2.0)
    with pytest.raises(TypeError, match=r"shape \(4,\)"):
        K.accumulate_loss_(torch.zeros(3), loss, w)
    with pytest.raises(TypeError, match="float32"):
        K.accumulate_loss_(torch.zeros(4, dtype=torch.float64), loss, w)
    with pytest.raises(TypeError, match="host-to-device"):
        K.accumulate_loss_(torch.zeros(4), loss, 2.0)
    with pytest.raises(TypeError, match="one-element"):
        K.accumulate_loss_(torch.zeros(4), torch.ones(2), w)
    with pytest.raises(TypeError, match="ring"):
        K.accumulate_loss_(torch.zeros(4), loss, w, torch.zeros(0))
    with pytest.raises(ValueError, match="ring_size"):
        K.LossCounters("cpu", ring_size=-1)


def test_compile_fullgraph_no_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    def step(counters_t, loss, weight, ring):
        K.accumulate_loss_(counters_t, loss * 1.0, weight, ring)

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    c1, c2, r1, r2 = torch.zeros(4), torch.zeros(4), torch.zeros(2), torch.zeros(2)
    for value in (0.5, float("nan"), 2.0):
        loss, w = torch.tensor(value), torch.tensor(8.0)
        compiled(c1, loss, w, r1)
        K.accumulate_loss_reference(c2, loss, w, r2)
    torch.testing.assert_close(c1, c2, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0, equal_nan=True)
    assert backend.frame_count == 1
    assert not counters["graph_break"]


@pytest.mark.gpu
@C.requires_triton_gpu
@pytest.mark.parametrize("ring_size", [0, 3])
def test_gpu_triton_matches_reference_with_bf16(ring_size):
    seq = SEQUENCE + [(1.0 / 3.0, torch.bfloat16, 32.0), (float("nan"), torch.bfloat16, 2.0)]
    c1, c2 = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    r1 = torch.zeros(ring_size, device="cuda") if ring_size else None
    r2 = torch.zeros(ring_size, device="cuda") if ring_size else None
    for (a, ra), (b, rb) in zip(
        _run(K.accumulate_loss_, c1, r1, seq, "cuda"), _run(K.accumulate_loss_reference, c2, r2, seq, "cuda")
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)
        if ring_size:
            torch.testing.assert_close(ra, rb, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@C.requires_triton_gpu
def test_gpu_cuda_graph_replay_counts_and_fills_ring():
    counters = K.LossCounters("cuda", ring_size=4)
    loss = torch.zeros((), device="cuda")
    weight = torch.tensor(2.0, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        counters.accumulate(loss, weight)
    torch.cuda.current_stream().wait_stream(stream)
    counters.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counters.accumulate(loss, weight)
    values = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    for v in values:
        loss.fill_(v)
        graph.replay()
    snap = counters.read()
    assert snap.calls == 6 and snap.weight_sum == 12.0 and not snap.nonfinite
    assert snap.loss_sum == pytest.approx(2.0 * sum(values), rel=1e-6)
    assert snap.recent == values[-4:]
