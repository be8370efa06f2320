"""Dataloaders for a single process.

With several processes, accelerate's prepared dataloaders shard the batches. With one process
they only move batches to the device, yet cost about 20 microseconds per batch in bookkeeping,
which is several percent of a small model's step; fasttrain moves batches itself there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

import torch
from accelerate.utils import send_to_device

from fasttrain.utils import worker_init_fn


def copies_asynchronously(batch, default: bool = False) -> bool:
    """Whether ``batch`` can be copied to the GPU with ``non_blocking=True``: it holds a tensor in
    page-locked memory. The answer comes from the batch, not from the DataLoader's
    ``pin_memory`` flag, because a dataset can hand out pinned tensors itself (views of a pinned
    buffer) while the flag is off, and a custom collate can return pageable tensors while it is on.
    ``default`` answers for a batch in which no tensor can be found (a custom batch class that
    pins itself through its own ``pin_memory()``), so pass the DataLoader's flag there.

    A pageable tensor beside a pinned one is still copied correctly with ``non_blocking=True``:
    CUDA stages it through a pinned buffer before the call returns.
    """
    stack = [batch]
    found_tensor = False
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found_tensor = True
            if item.device.type == "cpu" and item.is_pinned():
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False if found_tensor else default


class DeviceLoader:
    """Iterates a dataloader and moves each batch to ``device``, asynchronously when the batch is
    in page-locked memory. Other attributes are those of the wrapped dataloader."""

    def __init__(self, dataloader, device: torch.device):
        self.dataloader = dataloader
        self.device = device

    def __iter__(self):
        device = self.device
        pin_flag = bool(getattr(self.dataloader, "pin_memory", False))
        for batch in self.dataloader:
            yield send_to_device(batch, device, non_blocking=copies_asynchronously(batch, pin_flag))

    def __len__(self):
        return len(self.dataloader)

    def __getattr__(self, name):
        return getattr(self.__dict__["dataloader"], name)


def place_single_process(dataloader, device: torch.device):
    """The dataloader to use in a one-process run on ``device``."""
    if device.type == "cpu":
        return dataloader
    return DeviceLoader(dataloader, device)


def with_device_attribute(dataloader, device: torch.device):
    """``dataloader`` with a ``device`` attribute, which accelerate's prepared dataloaders have
    and callbacks read (``metric.to(trainer._eval_dataloader.device)``). Set on the loader
    itself where possible, so that it stays the same object (no per-batch wrapper); a loader
    that refuses new attributes is wrapped. A loader that has one keeps it (accelerate's
    prepared loaders: ``None`` there means they leave batches where they are)."""
    if hasattr(dataloader, "device"):
        return dataloader
    try:
        dataloader.device = device
    except (AttributeError, TypeError, ValueError):
        return DeviceLoader(dataloader, device)
    return dataloader


def default_num_workers() -> int:
    """pytorch-accelerated's default: the CPUs per GPU, at least one."""
    cpus = os.cpu_count() or 1
    if torch.cuda.is_available():
        cpus //= max(torch.cuda.device_count(), 1)
    return max(cpus, 1)


def default_dataloader_kwargs(batch_size: int, shuffle: bool) -> dict:
    return {
        "shuffle": shuffle,
        "pin_memory": torch.cuda.is_available(),
        "batch_size": batch_size,
        "num_workers": default_num_workers(),
        "worker_init_fn": worker_init_fn,
    }


def merge_dataloader_kwargs(defaults: dict, overrides: Optional[dict]) -> dict:
    """``defaults`` updated with the user's ``overrides``."""
    kwargs = dict(defaults)
    if overrides is not None:
        if "sampler" in overrides:
            # DataLoader refuses a sampler together with shuffle
            kwargs.pop("shuffle", None)
        kwargs.update(overrides)
    return kwargs
