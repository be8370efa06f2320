"""How batches are copied to the device: asynchronously exactly when the batch is page-locked."""

from collections import namedtuple

import pytest
import torch

import fasttrain.data as data
from fasttrain.data import DeviceLoader, copies_asynchronously


@pytest.fixture
def pinned(monkeypatch):
    """Marks chosen CPU tensors as page-locked; pinning for real needs a CUDA driver."""
    marked = set()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: self.data_ptr() in marked)

    def pin(tensor):
        marked.add(tensor.data_ptr())
        return tensor

    return pin


def test_pinned_batch_copies_asynchronously(pinned):
    x, y = pinned(torch.ones(4, 3)), pinned(torch.zeros(4))
    assert copies_asynchronously((x, y)) is True
    assert copies_asynchronously({"inputs": [x], "labels": y}) is True


def test_pageable_batch_copies_blocking_even_when_the_loader_pins(pinned):
    # the DataLoader's flag is only the answer for batches without any visible tensor
    assert copies_asynchronously((torch.ones(2), torch.ones(2)), default=True) is False


def test_one_pinned_tensor_is_enough(pinned):
    Batch = namedtuple("Batch", "x y")
    assert copies_asynchronously(Batch(torch.ones(2), {"deep": [pinned(torch.ones(2))]})) is True


def test_batch_without_tensors_takes_the_loader_flag():
    class Custom:
        pass

    assert copies_asynchronously(Custom(), default=True) is True
    assert copies_asynchronously(Custom(), default=False) is False
    assert copies_asynchronously([], default=True) is True


def test_device_loader_decides_per_batch(pinned, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "send_to_device", lambda batch, device, non_blocking: calls.append(non_blocking) or batch)
    buffer = pinned(torch.arange(8.0))
    # views of one pinned buffer, served by a DataLoader whose pin_memory flag is off
    batches = [(buffer, torch.ones(1)), (torch.ones(2), torch.ones(1)), (buffer, torch.ones(1))]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=False)
    moved = list(DeviceLoader(loader, torch.device("cpu")))
    assert [tuple(b) for b in moved] == batches
    assert calls == [True, False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_view_copies_without_synchronizing():
    buffer = torch.arange(64.0).pin_memory()
    loader = torch.utils.data.DataLoader([(buffer[:32], buffer[32:])], batch_size=None, pin_memory=False)
    torch.cuda.set_sync_debug_mode("error")
    try:
        (x, y), = list(DeviceLoader(loader, torch.device("cuda")))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.is_cuda and torch.equal(y.cpu(), buffer[32:])
