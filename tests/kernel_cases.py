"""Shared inputs and switches for the kernel tests (tests/test_kernels_*.py).

Triton chooses compiled or interpreted kernels when ``@triton.jit`` runs and decorates its own
library when ``triton`` is imported, so ``TRITON_INTERPRET=1`` only works if it is set before the
first ``import triton`` in the process (``torch._dynamo`` imports it). tests/conftest.py sets it on
machines without CUDA; importing this module first does the same when it is still early enough,
so a kernel test file also works when run on its own.
"""
import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import fasttrain.kernels as K  # noqa: E402
from fasttrain.kernels import _multi_tensor  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# CPU runs of the Triton launchers need the interpreter, set up before triton was imported.
requires_interpreter = pytest.mark.skipif(
    not (K.triton_interpreted() and _multi_tensor._MODE_CONSISTENT),
    reason="needs TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py does this "
    "on machines without CUDA)",
)
requires_triton_gpu = pytest.mark.skipif(
    not (HAS_CUDA and K.triton_available() and not K.triton_interpreted()),
    reason="needs a CUDA device and compiled (not interpreted) Triton",
)

# Small launch sizes so a few thousand elements already span several chunks and block tails.
SMALL_LAUNCH = dict(chunk_size=256, block_size=64)

# Shape lists: non-powers of two, one ~1e5-element tensor (interpreter speed), many tiny tensors,
# empty tensors among non-empty ones, only empty tensors, and an empty list.
SHAPE_CASES = {
    "mixed": [(1000,), (37, 29), (1,), (0,), (3, 0, 5), (513,), (4097,), (2, 3, 7)],
    "large": [(100_003,)],
    "many_tiny": [(1 + i % 17,) for i in range(64)],
    "only_empty": [(0,), (0, 3)],
    "empty_list": [],
}


def make_grads(shapes, dtype, device="cpu", seed=0, scale=1.0):
    """Gradients with mean-zero values; ``dtype`` may be a list giving one dtype per tensor."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
    return [
        (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dt)
        for shape, dt in zip(shapes, dtypes)
    ]


def mixed_dtypes(n):
    return [torch.float32 if i % 2 == 0 else torch.float16 for i in range(n)]


def inject(grads, kind):
    """Put one non-finite value (``nan``, ``inf`` or ``-inf``) into the last non-empty tensor."""
    if kind == "finite":
        return grads
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[kind]
    for g in reversed(grads):
        if g.numel():
            g.view(-1)[g.numel() // 2] = value
            break
    return grads


def clone_all(grads):
    return [g.clone() for g in grads]


def params_holding(grads):
    """Parameters whose ``.grad`` are copies of ``grads`` (for torch.nn.utils' clipping)."""
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def tolerances(dtype):
    """(rtol, atol) for Triton vs reference on clipped gradients.

    Both sides compute the norm in fp32 over the same values, in different orders (blocked tree
    vs torch's vectorised reduction): for positive summands the relative error of either is a few
    times log2(n) * 2**-24 ~ 1e-6 for n ~ 1e5, halved by the sqrt. So the scales agree to ~1e-6
    and fp32 results to ~1e-6 relative: rtol 1e-5 leaves 10x margin. fp16 results are rounded
    once from fp32 products that differ by ~1e-6, which can flip one rounding: one fp16 ulp is
    2**-10 ~ 9.8e-4 relative, hence rtol 1e-3; atol covers fp16 subnormals.
    """
    if dtype == torch.float16:
        return 1e-3, 1e-5
    if dtype == torch.bfloat16:
        return 8e-3, 1e-5  # one bf16 ulp is 2**-7 ~ 7.8e-3 relative
    return 1e-5, 1e-7


def assert_grads_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        rtol, atol = tolerances(a.dtype)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)


GPU_DTYPES = ["fp32", "fp16", "bf16", "mixed"]


def gpu_grads(dtype_name, kind, extra_shapes, scale=1.0):
    """CUDA gradients of the "mixed" shapes plus ``extra_shapes``, all of one dtype ("fp32",
    "fp16", "bf16") or cycling through the three ("mixed"), with ``inject(..., kind)`` applied."""
    shapes = SHAPE_CASES["mixed"] + list(extra_shapes)
    if dtype_name == "mixed":
        dtype = [(torch.float32, torch.float16, torch.bfloat16)[i % 3] for i in range(len(shapes))]
    else:
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    return inject(make_grads(shapes, dtype, "cuda", scale=scale), kind)


def capture_after_warmup(fn):
    """Run ``fn()`` once on a side stream (it builds and caches the chunk tables), then capture
    it in a CUDA graph holding the tables it uses. Returns ``(graph, output, held_tables)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with K.hold_chunk_tables() as held, torch.cuda.graph(graph):
        out = fn()
    return graph, out, held


def assert_norm_close(actual, expected):
    """Norms from the same fp32 squares summed in other orders or groupings; see tolerances."""
    assert actual.dtype == torch.float32 and actual.dim() == 0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def split_in_two(grads):
    """Two 'processes': alternate tensors, so each holds a mix of shapes and dtypes."""
    return grads[0::2], grads[1::2]


def clip_split(grads, max_norm, found_inf=None, triton=False, check=True, **sizes):
    """Global-norm clipping split over two 'processes': each measures its part
    (``grad_sumsq``), the sums are added (the all-reduce), each scales its part
    (``clip_grad_norm_from_sumsq_``). Returns the norm both parts agree on; with ``check`` it
    asserts that they agree, a host read (pass False inside CUDA graph capture)."""
    sumsq = K.grad_sumsq_triton if triton else K.grad_sumsq
    scale = K.clip_grad_norm_from_sumsq_triton if triton else K.clip_grad_norm_from_sumsq_
    parts = split_in_two(grads)
    total = sum(sumsq(part, **sizes) for part in parts).float()
    norms = [scale(part, total, max_norm, found_inf=found_inf, **sizes) for part in parts]
    if check:
        assert torch.equal(norms[0], norms[1]) or not torch.isfinite(norms[0])
    return norms[0]
