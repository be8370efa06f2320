"""Dataloaders for a single process.

With several processes, accelerate's prepared dataloaders shard the batches. With one process
they only move batches to the device, yet cost about 20 microseconds per batch in bookkeeping,
which is several percent of a small model's step; fasttrain moves batches itself there.
"""

from __future__ import annotations

import torch
from accelerate.utils import send_to_device


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
