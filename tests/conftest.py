import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported (torch._dynamo imports it) and when each
# @triton.jit kernel is defined, so the CPU kernel tests need it set here, before any test
# module is collected. Only without CUDA: on a GPU machine the kernels must compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # a time limit's TERM ends the run as Ctrl-C does, with its summary and JUnit report
    from term_as_interrupt import interrupt_on_term

    interrupt_on_term()


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


@pytest.fixture
def exact_cuda():
    """Fresh dynamo state and counters, TF32 off while the test runs so that eager and graphed
    matmuls round alike (the graphed-engine GPU tests)."""
    from torch._dynamo.utils import counters  # here, not above: after TRITON_INTERPRET is set

    torch._dynamo.reset()
    counters.clear()
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch._dynamo.reset()


@pytest.fixture
def dynamos_own_limits():
    """dynamo's own recompile limits while the test runs: without isolation (torch before 2.12)
    every trainer of the earlier tests in the process raised them (fasttrain.engine.recompile_limit),
    so a test that must meet the limit would not."""
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        yield


@pytest.fixture
def dynamos_own_limits_from_empty_caches(dynamos_own_limits):
    """:func:`dynamos_own_limits` with dynamo's caches emptied before and after the test: without
    isolation, the compiled frames of torch's optimizer steps hold an entry for every optimizer
    an earlier test compiled an update for, which would count against the limit the test
    restores (and the test's own optimizers against a later test's)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def original():
    """pytorch-accelerated, as a :class:`differential_scripts.Lib` (the differential tests)."""
    import differential_scripts as ds

    return ds.load_lib(ds.ORIGINAL)


@pytest.fixture(scope="module")
def ours():
    """fasttrain, as a :class:`differential_scripts.Lib` (the differential tests)."""
    import differential_scripts as ds

    return ds.load_lib(ds.FASTTRAIN)
