"""The two halves of global-norm clipping for sharded gradients (kernels/clip_norm_sharded.py):
``grad_sumsq`` on each process's shards, then ``clip_grad_norm_from_sumsq_`` with the summed
value. Split over simulated "processes" (lists of tensors), they must give exactly what
``clip_grad_norm_`` gives on all the tensors at once."""
import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

import fasttrain.kernels as K


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
    norm = C.clip_split(grads, 1.0, triton=True, **sizes)
    C.assert_norm_close(norm, K.clip_grad_norm_reference(expected, 1.0))
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
    norm = C.clip_split(grads, 1.0, found_inf=found, triton=True, **C.SMALL_LAUNCH)
    ref = K.clip_grad_norm_reference(expected, 1.0, found_inf=found_ref)
    C.assert_norm_close(norm, ref)
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
    C.assert_norm_close(norm, K.clip_grad_norm_reference(C.clone_all(before), 1e6))
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
    norm = C.clip_split(grads, 0.7, found_inf=found)
    # torch's clip_grad_norm_ in fp32 on the same values (it reduces fp16 in fp16 itself)
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in expected]
    for p, g in zip(params, expected):
        p.grad = g.float()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, 0.7)
    C.assert_norm_close(norm, ref_norm)
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
        norm = compiled(list(C.split_in_two(grads)), torch.tensor(max_norm), found)
        ref = K.clip_grad_norm_reference(expected, max_norm, found_inf=found_ref)
        C.assert_norm_close(norm, ref)
        C.assert_grads_close(grads, expected)
        assert torch.equal(found, found_ref)
    assert backend.frame_count == 1
    assert not counters["graph_break"]
