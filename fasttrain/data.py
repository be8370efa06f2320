"""Dataloaders for a single process.

With several processes, accelerate's prepared dataloaders shard the batches. With one process
they only move batches to the device, yet cost about 20 microseconds per batch in bookkeeping,
which is several percent of a small model's step; fasttrain moves batches itself there.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from accelerate.utils import send_to_device

from fasttrain.utils import worker_init_fn


class DeviceLoader:
    """Iterates a dataloader and moves each batch to ``device`` (asynchronously when the
    dataloader pins memory). Other attributes are those of the wrapped dataloader."""

    def __init__(self, dataloader, device: torch.device):
        self.dataloader = dataloader
        self.device = device
        self.non_blocking = bool(getattr(dataloader, "pin_memory", False))

    def __iter__(self):
        device, non_blocking = self.device, self.non_blocking
        for batch in self.dataloader:
            yield send_to_device(batch, device, non_blocking=non_blocking)

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
