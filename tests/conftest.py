import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported (torch._dynamo imports it) and when each
# @triton.jit kernel is defined, so the CPU kernel tests need it set here, before any test
# module is collected. Only without CUDA: on a GPU machine the kernels must compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The Tensor methods that read a device value on the host (a synchronisation on CUDA).
SYNC_METHODS = ("item", "tolist", "__float__", "__bool__", "cpu", "__int__", "numpy", "__index__")


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts every call of :data:`SYNC_METHODS` in ``counts["n"]`` while the test runs."""
    counts = {"n": 0}
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts
