"""Every bench peer gets the same data path: views of one page-locked pool, copied non-blocking."""

import pytest
import torch

pytest.importorskip("pytorch_accelerated")

from fasttrain.bench.peers import PyTorchAcceleratedPeer, loader_kwargs  # noqa: E402
from fasttrain.bench.workloads import make_workload  # noqa: E402


def test_batches_are_views_of_the_pool():
    wl = make_workload("mlp", size="tiny", device="cpu", batch_size=4, num_batches=3)
    x, y = wl.dataset.__getitems__([4, 5, 6, 7])
    # a view keeps the pool's memory, so a pinned pool gives pinned batches
    assert x._base is wl.dataset.inputs and y._base is wl.dataset.targets
    assert loader_kwargs(wl)["pin_memory"] is False


def test_pytorch_accelerated_copies_non_blocking():
    peer = PyTorchAcceleratedPeer(make_workload("mlp", size="tiny", device="cpu", batch_size=4, num_batches=3))
    peer.setup()
    assert peer.trainer._create_accelerator().non_blocking is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_are_pinned_so_fasttrain_copies_them_non_blocking():
    from fasttrain.data import copies_asynchronously

    wl = make_workload("mlp", size="tiny", device="cuda", batch_size=4, num_batches=3)
    batch = wl.dataset.__getitems__([0, 1, 2, 3])
    assert batch[0].is_pinned() and batch[1].is_pinned()
    assert copies_asynchronously(batch)
