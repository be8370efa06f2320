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
from fasttrain.kernels import clip_norm as _clip_norm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# CPU runs of the Triton launchers need the interpreter, set up before triton was imported.
requires_interpreter = pytest.mark.skipif(
    not (K.triton_interpreted() and _clip_norm._MODE_CONSISTENT),
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
