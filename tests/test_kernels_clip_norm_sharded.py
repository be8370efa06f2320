"""The two halves of global-norm clipping for sharded gradients (kernels/clip_norm_sharded.py):
``grad_sumsq`` on each process's shards, then ``clip_grad_norm_from_sumsq_`` with the summed
value. Split over simulated "processes" (lists of tensors), they must give exactly what
``clip_grad_norm_`` gives on all the tensors at once."""
import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

import fasttrain.kernels as K


def _split(grads):
    """Two 'processes': alternate tensors, so each holds a mix of shapes and dtypes."""
    return grads[0::2], grads[1::2]


def _norm_close(actual, expected):
    # sums of the same fp32 squares in other groupings; see kernel_cases.tolerances
    assert actual.dtype == torch.float32 and actual.dim() == 0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def _clip_split(grads, max_norm, found_inf=None, triton=False, **sizes):
    """Each 'process' measures its part, the sums are added (the all-reduce), each scales its part."""
    sumsq = K.grad_sumsq_triton if triton else K.grad_sumsq
    scale = K.clip_grad_norm_from_sumsq_triton if triton else K.clip_grad_norm_from_sumsq_
    parts = _split(grads)
    total = sum(sumsq(part, **sizes) for part in parts).float()
    norms = [scale(part, total, max_norm, found_inf=found_inf, **sizes) for part in parts]
    assert torch.equal(norms[0], norms[1]) or not torch.isfinite(norms[0])
    return norms[0]


SPLIT_CASES = [("mixed", "fp32"), ("mixed", "fp16"), ("mixed", "mixed"), ("many_tiny", "mixed"), ("large", "fp32")]


def _grads(case, dtype_name, kind="finite", scale=0.5):
    shapes = C.SHAPE_CASES[case]
    dtype = C.mixed_dtypes(len(shapes)) if dtype_name == "mixed" else {"fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    return C.inject(C.make_grads(shapes, dtype, scale=scale), kind)


# ---------------------------------------------------------------- Triton (interpreter)
@C.requires_interpreter
@pytest.mark.parametrize("case, dtype_name", SPLIT_CASES)
@pytest.mark.parametrize("launch", ["default", "small"])
def test_triton_split_equals_whole(case, dtype_name, launch):
    sizes = C.SMALL_LAUNCH if launch == "small" else {}
    grads = _grads(case, dtype_name)
    expected = C.clone_all(grads)
    norm = _clip_split(grads, 1.0, triton=True, **sizes)
    _norm_close(norm, K.clip_grad_norm_reference(expected, 1.0))
    C.assert_grads_close(grads, expected)


@C.requires_interpreter
@pytest.mark.parametrize("case", ["mixed", "many_tiny", "only_empty", "empty_list"])
def test_triton_sumsq_matches_reference(case):
    grads = _grads(case, "mixed")
    torch.testing.assert_close(K.grad_sumsq_triton(grads, **C.SMALL_LAUNCH), K.grad_sumsq_reference(grads), rtol=1e-5, atol=1e-6)


@C.requires_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf * 0
@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
def test_triton_nonfinite_sets_the_flag_on_every_part(kind):
    grads = _grads("mixed", "mixed", kind)
    expected = C.clone_all(grads)
    found, found_ref = torch.zeros(1), torch.zeros(1)
    norm = _clip_split(grads, 1.0, found_inf=found, triton=True, **C.SMALL_LAUNCH)
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    _norm_close(norm, ref)
    assert not torch.isfinite(norm) and found.item() == 1.0 == found_ref.item()
    C.assert_grads_close(grads, expected)


@C.requires_interpreter
def test_triton_no_clip_is_bit_exact_and_a_part_without_elements_gets_the_norm():
    grads = _grads("mixed", "mixed")
    before = C.clone_all(grads)
    found = torch.zeros(1)
    total = K.grad_sumsq_triton(grads)
    norm = K.clip_grad_norm_from_sumsq_triton(grads, total, torch.tensor(1e6), found_inf=found)
    assert all(torch.equal(g, b) for g, b in zip(grads, before)) and found.item() == 0.0
    _norm_close(norm, K.clip_grad_norm_reference(C.clone_all(before), 1e6))
    # a process whose shards are all empty still learns the norm (and raises the flag)
    empty = [torch.empty(0), torch.empty(0, 3)]
    assert torch.equal(K.clip_grad_norm_from_sumsq_triton(empty, total, 1.0), norm)
    K.clip_grad_norm_from_sumsq_triton(empty, torch.tensor([float("inf")]), 1.0, found_inf=found)
    assert found.item() == 1.0


# ---------------------------------------------------------------- reference / public functions
@pytest.mark.parametrize("case, dtype_name", SPLIT_CASES)
@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])
def test_public_split_equals_torch(case, dtype_name, kind):
    grads = _grads(case, dtype_name, kind)
    expected = C.clone_all(grads)
    found = torch.zeros(1)
    norm = _clip_split(grads, 0.7, found_inf=found)
    # torch's clip_grad_norm_ in fp32 on the same values (it reduces fp16 in fp16 itself)
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in expected]
    for p, g in zip(params, expected):
        p.grad = g.float()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, 0.7)
    _norm_close(norm, ref_norm)
    assert found.item() == (0.0 if kind == "finite" else 1.0)
    if kind == "finite":
        for g, p in zip(grads, params):
            rtol, atol = C.tolerances(g.dtype)
            torch.testing.assert_close(g.float(), p.grad, rtol=rtol, atol=atol)


def test_empty_inputs_and_devices():
    assert K.grad_sumsq([]).item() == 0.0
    assert K.grad_sumsq([torch.empty(0)]).item() == 0.0
    assert K.grad_sumsq([], device="meta").device.type == "meta"
    norm = K.clip_grad_norm_from_sumsq_([], torch.tensor(4.0), 1.0)
    assert norm.item() == 2.0


def test_clear_errors():
    with pytest.raises(TypeError, match="sumsq must be a one-element float32"):
        K.clip_grad_norm_from_sumsq_([torch.ones(3)], torch.ones(2), 1.0)
    with pytest.raises(TypeError, match="sumsq must be a one-element float32"):
        K.clip_grad_norm_from_sumsq_([torch.ones(3)], 4.0, 1.0)
    with pytest.raises(TypeError, match="floating"):
        K.grad_sumsq([torch.ones(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="found_inf"):
        K.clip_grad_norm_from_sumsq_([torch.ones(3)], torch.tensor(1.0), 1.0, found_inf=torch.zeros(2))


def test_compile_fullgraph_no_graph_break_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    def clip(parts, max_norm, found_inf):
        total = K.grad_sumsq(parts[0]) + K.grad_sumsq(parts[1])  # the collective's place
        return [K.clip_grad_norm_from_sumsq_(p, total, max_norm, found_inf=found_inf) for p in parts][0]

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(clip, fullgraph=True, backend=backend)
    for max_norm in (0.5, 0.25, 2.0):
        grads = _grads("mixed", "mixed", "nan" if max_norm == 2.0 else "finite")
        expected = C.clone_all(grads)
        found, found_ref = torch.zeros(1), torch.zeros(1)
        norm = compiled(list(_split(grads)), torch.tensor(max_norm), found)
        ref = K.clip_grad_norm_reference(expected, max_norm, found_inf=found_ref)
        _norm_close(norm, ref)
        C.assert_grads_close(grads, expected)
        assert torch.equal(found, found_ref)
    assert backend.frame_count == 1
    assert not counters["graph_break"]


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@C.requires_triton_gpu
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16", "mixed"])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])
def test_gpu_split_equals_whole(dtype_name, kind):
    shapes = C.SHAPE_CASES["mixed"] + [(50257, 77), (3, 100_001)]
    if dtype_name == "mixed":
        dtype = [(torch.float32, torch.float16, torch.bfloat16)[i % 3] for i in range(len(shapes))]
    else:
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    grads = C.inject(C.make_grads(shapes, dtype, "cuda", scale=0.5), kind)
    expected = C.clone_all(grads)
    found, found_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    norm = _clip_split(grads, 1.0, found_inf=found)  # the custom ops' CUDA kernels
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    _norm_close(norm, ref)
    C.assert_grads_close(grads, expected)
    assert torch.equal(found, found_ref)


@pytest.mark.gpu
@C.requires_triton_gpu
def test_gpu_cuda_graph_capture_and_replay():
    shapes = C.SHAPE_CASES["mixed"] + [(1024, 768)]
    grads = C.make_grads(shapes, C.mixed_dtypes(len(shapes)), "cuda")
    source = C.clone_all(grads)
    max_norm = torch.tensor(0.5, device="cuda")
    found = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up builds and caches the chunk tables
        _clip_split(grads, max_norm, found_inf=found)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with K.hold_chunk_tables() as held, torch.cuda.graph(graph):
        norm = _clip_split(grads, max_norm, found_inf=found)
    assert held
    for limit in (0.5, 0.1, 100.0):
        for g, s in zip(grads, source):
            g.copy_(s)
        max_norm.fill_(limit)
        graph.replay()
        expected = C.clone_all(source)
        _norm_close(norm, K.clip_grad_norm_reference(expected, limit))
        C.assert_grads_close(grads, expected)
    assert found.item() == 0.0
