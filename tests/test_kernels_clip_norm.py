"""Fused global-norm clipping: Triton (interpreter on CPU, compiled on GPU) vs reference vs torch."""
import functools
import subprocess
import sys
import textwrap

import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

import fasttrain.kernels as K

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "mixed": "mixed"}


def _grads(case, dtype_name, kind="finite", device="cpu", seed=0, scale=1.0):
    shapes = C.SHAPE_CASES[case]
    dtype = C.mixed_dtypes(len(shapes)) if dtype_name == "mixed" else DTYPES[dtype_name]
    return C.inject(C.make_grads(shapes, dtype, device, seed, scale), kind)


# ---------------------------------------------------------------- Triton (interpreter) vs reference
# Every shape case in fp32 and fp16 with the production launch sizes; mixed dtypes and the small
# launch (many chunks per tensor, block tails) on the cases where they change the chunk table.
# The interpreter runs each program in Python, so the grid stays small.
TRITON_CASES = (
    [(case, dt, "default") for case in C.SHAPE_CASES for dt in ("fp32", "fp16")]
    + [("mixed", "mixed", "default"), ("many_tiny", "mixed", "default")]
    + [("mixed", dt, "small") for dt in DTYPES]
    + [("many_tiny", "fp16", "small")]
)


@C.requires_interpreter
@pytest.mark.parametrize("case, dtype_name, launch", TRITON_CASES)
def test_triton_matches_reference(case, dtype_name, launch):
    sizes = C.SMALL_LAUNCH if launch == "small" else {}
    grads = _grads(case, dtype_name, scale=0.5)
    expected = C.clone_all(grads)
    # max_norm 1.0 clips every case here (norms are >= ~2 for any non-empty case).
    norm = K.clip_grad_norm_triton(grads, 1.0, **sizes)
    ref = K.clip_grad_norm_reference(expected, 1.0)
    C.assert_norm_close(norm, ref)
    C.assert_grads_close(grads, expected)


@C.requires_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf * 0
@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16"])
def test_triton_nonfinite_matches_reference_and_sets_flag(kind, dtype_name):
    grads = _grads("mixed", dtype_name, kind)
    expected = C.clone_all(grads)
    found, found_ref = torch.zeros(1), torch.zeros(1)
    norm = K.clip_grad_norm_triton(grads, 1.0, found_inf=found, **C.SMALL_LAUNCH)
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    C.assert_norm_close(norm, ref)
    assert not torch.isfinite(norm)
    C.assert_grads_close(grads, expected)
    assert found.item() == 1.0 and found_ref.item() == 1.0


@C.requires_interpreter
def test_triton_no_clip_leaves_grads_bit_identical_and_flag_alone():
    grads = _grads("mixed", "mixed")
    before = C.clone_all(grads)
    found = torch.ones(1)  # set by an earlier op: must stay set
    norm = K.clip_grad_norm_triton(grads, 1e6, found_inf=found, **C.SMALL_LAUNCH)
    C.assert_norm_close(norm, K.clip_grad_norm_reference(C.clone_all(before), 1e6))
    for g, b in zip(grads, before):
        assert torch.equal(g, b)
    assert found.item() == 1.0
    found.zero_()
    K.clip_grad_norm_triton(grads, 1e6, found_inf=found)
    assert found.item() == 0.0


@C.requires_interpreter
def test_triton_max_norm_tensor_equals_float():
    grads = _grads("mixed", "fp32")
    other = C.clone_all(grads)
    n1 = K.clip_grad_norm_triton(grads, torch.tensor(0.25), **C.SMALL_LAUNCH)
    n2 = K.clip_grad_norm_triton(other, 0.25, **C.SMALL_LAUNCH)
    assert torch.equal(n1, n2)
    for a, b in zip(grads, other):
        assert torch.equal(a, b)


@C.requires_interpreter
def test_triton_table_cache_reused_and_correct_after_new_tensors():
    grads = _grads("mixed", "fp32")
    K.clip_grad_norm_triton(grads, 1.0)
    cached = len(K._multi_tensor._TABLE_CACHE)
    K.clip_grad_norm_triton(grads, 1.0)
    assert len(K._multi_tensor._TABLE_CACHE) == cached
    fresh = _grads("mixed", "fp32", seed=3)
    expected = C.clone_all(fresh)
    C.assert_norm_close(K.clip_grad_norm_triton(fresh, 1.0), K.clip_grad_norm_reference(expected, 1.0))
    C.assert_grads_close(fresh, expected)


@C.requires_interpreter
def test_triton_channels_last_grad():
    g = torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)
    expected = g.clone()
    C.assert_norm_close(K.clip_grad_norm_triton([g], 1.0, **C.SMALL_LAUNCH), K.clip_grad_norm_reference([expected], 1.0))
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- reference vs torch
@pytest.mark.parametrize("case", ["mixed", "large", "many_tiny", "empty_list"])
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])
def test_reference_matches_torch(case, dtype_name, kind):
    grads = _grads(case, dtype_name, kind)
    params = C.params_holding(grads)
    expected_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    norm = K.clip_grad_norm_reference(grads, 1.0)
    if dtype_name == "fp16":
        # torch rounds each per-tensor norm and the total to fp16 (2**-11 relative each) and
        # scales by the fp16-rounded coefficient: about two fp16 roundings apart.
        rtol, atol = 2e-3, 1e-5
    else:
        rtol, atol = 1e-5, 1e-7
    torch.testing.assert_close(norm, expected_norm.float(), rtol=rtol, atol=atol, equal_nan=True)
    for g, p in zip(grads, params):
        torch.testing.assert_close(g, p.grad, rtol=rtol, atol=atol, equal_nan=True)


# ---------------------------------------------------------------- public API and custom op
def test_empty_list_and_only_empty_tensors():
    norm = K.clip_grad_norm_([], 1.0)
    assert norm.dtype == torch.float32 and norm.dim() == 0 and norm.item() == 0.0
    grads = _grads("only_empty", "fp32")
    assert K.clip_grad_norm_(grads, 1.0).item() == 0.0


def test_public_function_matches_reference_on_cpu():
    grads = _grads("mixed", "mixed", scale=0.5)
    expected = C.clone_all(grads)
    found, found_ref = torch.zeros(1), torch.zeros(1)
    norm = K.clip_grad_norm_(grads, torch.tensor(1.0), found_inf=found)
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    assert torch.equal(norm, ref) and torch.equal(found, found_ref)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)


def test_clear_errors():
    with pytest.raises(TypeError, match="found_inf"):
        K.clip_grad_norm_([torch.randn(3)], 1.0, found_inf=torch.zeros(1, dtype=torch.float16))
    with pytest.raises(TypeError, match="floating"):
        K.clip_grad_norm_([torch.ones(3, dtype=torch.int64)], 1.0)
    with pytest.raises(TypeError, match="max_norm"):
        K.clip_grad_norm_([torch.randn(3)], torch.ones(2))
    with pytest.raises(ValueError, match="block_size"):
        K.clip_grad_norm_triton([torch.randn(3)], 1.0, chunk_size=100, block_size=48)
    if C.HAS_CUDA:
        with pytest.raises(ValueError, match="one device"):
            K.clip_grad_norm_([torch.randn(3), torch.randn(3, device="cuda")], 1.0)


def test_compile_fullgraph_no_graph_break_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    def clip(grads, max_norm, found_inf):
        return K.clip_grad_norm_(grads, max_norm, found_inf=found_inf)

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")  # exercises register_fake and functionalization
    compiled = torch.compile(clip, fullgraph=True, backend=backend)
    for max_norm in (0.5, 0.25, 2.0):  # a new tensor value must not recompile
        grads = _grads("mixed", "mixed", "nan" if max_norm == 2.0 else "finite")
        expected = C.clone_all(grads)
        found, found_ref = torch.zeros(1), torch.zeros(1)
        norm = compiled(grads, torch.tensor(max_norm), found)
        ref = K.clip_grad_norm_reference(expected, max_norm, found_inf=found_ref)
        torch.testing.assert_close(norm, ref, equal_nan=True)
        C.assert_grads_close(grads, expected)
        assert torch.equal(found, found_ref)
    assert backend.frame_count == 1
    assert not counters["graph_break"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside inductor's imports
def test_compile_inductor_all_ops_match_reference():
    # Inductor functionalizes the mutating ops and re-inplaces them; the result must still be
    # the in-place reference result.
    def step(grads, max_norm, found_inf, counters, loss, weight):
        norm = K.clip_grad_norm_(grads, max_norm, found_inf=found_inf)
        K.clip_grad_value_(grads, 0.01, found_inf=found_inf)
        K.accumulate_loss_(counters, loss, weight)
        return norm

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    grads = _grads("mixed", "mixed", scale=0.5)
    expected = C.clone_all(grads)
    found, counters = torch.zeros(1), torch.zeros(4)
    norm = compiled(grads, torch.tensor(1.0), found, counters, torch.tensor(2.0), torch.tensor(3.0))
    ref = K.clip_grad_norm_reference(expected, 1.0)
    K.clip_grad_value_reference(expected, 0.01)
    assert torch.equal(norm, ref)
    C.assert_grads_close(grads, expected)
    assert counters.tolist() == [6.0, 3.0, 0.0, 1.0] and found.item() == 0.0


def test_import_without_triton_uses_reference():
    # A fresh interpreter where `import triton` fails, as on machines without triton.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import torch
        import fasttrain.kernels as K
        assert not K.triton_available()
        g = [torch.ones(4), torch.ones(3, dtype=torch.float16)]
        norm = K.clip_grad_norm_(g, 1.0)
        assert abs(norm.item() - 7 ** 0.5) < 1e-5, norm
        K.clip_grad_value_(g, 0.1)
        c = K.LossCounters("cpu", ring_size=2)
        c.accumulate(torch.tensor(2.0), torch.tensor(3.0))
        assert c.read().loss_sum == 6.0
        assert not torch.cuda.is_initialized()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_does_not_initialise_cuda():
    assert "fasttrain.kernels" in sys.modules
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@C.requires_triton_gpu
@pytest.mark.parametrize("dtype_name", C.GPU_DTYPES)
@pytest.mark.parametrize("kind", ["finite", "nan", "inf"])
@pytest.mark.parametrize("clip", [K.clip_grad_norm_, C.clip_split], ids=["whole", "split"])
def test_gpu_triton_matches_reference(dtype_name, kind, clip):
    grads = C.gpu_grads(dtype_name, kind, [(50257, 77), (3, 100_001)], scale=0.5)
    expected = C.clone_all(grads)
    found, found_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    norm = clip(grads, 1.0, found_inf=found)  # the custom ops' CUDA kernels
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    C.assert_norm_close(norm, ref)
    C.assert_grads_close(grads, expected)
    assert torch.equal(found, found_ref)


@pytest.mark.gpu
@C.requires_triton_gpu
# the split clip without its host check, which capture forbids; both parts' gradients are compared
@pytest.mark.parametrize(
    "clip", [K.clip_grad_norm_, functools.partial(C.clip_split, check=False)], ids=["whole", "split"]
)
def test_gpu_cuda_graph_capture_and_replay(clip):
    shapes = C.SHAPE_CASES["mixed"] + [(1024, 768)]
    grads = C.make_grads(shapes, C.mixed_dtypes(len(shapes)), "cuda")
    source = C.clone_all(grads)
    max_norm = torch.tensor(0.5, device="cuda")
    found = torch.zeros(1, device="cuda")
    graph, norm, held = C.capture_after_warmup(lambda: clip(grads, max_norm, found_inf=found))
    assert held  # the graph keeps the chunk tables it reads
    for limit in (0.5, 0.1, 100.0):
        for g, s in zip(grads, source):
            g.copy_(s)
        max_norm.fill_(limit)
        graph.replay()
        expected = C.clone_all(source)
        C.assert_norm_close(norm, K.clip_grad_norm_reference(expected, limit))
        C.assert_grads_close(grads, expected)
    assert found.item() == 0.0


@pytest.mark.gpu
@C.requires_triton_gpu
def test_gpu_compile_fullgraph_matches_reference():
    def step(grads, max_norm, found_inf, counters, loss, weight):
        norm = K.clip_grad_norm_(grads, max_norm, found_inf=found_inf)
        K.accumulate_loss_(counters, loss, weight)
        return norm

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    shapes = C.SHAPE_CASES["mixed"] + [(768, 2304)]
    grads = C.make_grads(shapes, C.mixed_dtypes(len(shapes)), "cuda")
    counters = torch.zeros(4, device="cuda")
    found = torch.zeros(1, device="cuda")
    for limit in (0.5, 0.25):
        expected = C.clone_all(grads)
        loss = torch.tensor(limit, device="cuda")
        norm = compiled(grads, torch.tensor(limit, device="cuda"), found, counters, loss, torch.tensor(4.0, device="cuda"))
        C.assert_norm_close(norm, K.clip_grad_norm_reference(expected, limit))
        C.assert_grads_close(grads, expected)
    torch.testing.assert_close(counters, torch.tensor([3.0, 8.0, 0.0, 2.0], device="cuda"))
