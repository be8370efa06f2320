"""Accumulate the running loss on the device in one launch per step.

``counters`` is a float32 tensor of shape (4,); one call with a batch-mean ``loss`` and a
``weight`` (the batch size) does::

    counters[0] += float32(loss) * weight       # weighted loss sum
    counters[1] += weight                       # sample count
    counters[2]  = max(counters[2], 1.0 if loss is NaN or +-inf else 0.0)   # non-finite flag
    ring[int(counters[3]) % R] = float32(loss)  # optional ring of recent losses, old counter
    counters[3] += 1                            # calls since reset (ring slot index)

A non-finite loss is added to the sum like any other, so the epoch mean reads NaN/inf exactly as
an unfused trainer would report it; ``counters[2]`` tells the flush that it happened. The call
counter is exact up to 2**24 calls between resets (float32 integers).

Traffic: reads 4 + 4 + loss-size bytes, writes 16 (+4 with the ring). Everything is read from
device memory by one program, so the launch is replayable inside a CUDA graph with no host value.
``LossCounters`` keeps counters and ring in one buffer so a flush is a single device-to-host copy.
"""
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._multi_tensor import tl, triton  # both None where triton is not installed

__all__ = [
    "LossCounters",
    "LossSnapshot",
    "accumulate_loss_",
    "accumulate_loss_reference",
    "accumulate_loss_triton",
    "reset_counters_",
]

NUM_COUNTERS = 4

if triton is not None:

    @triton.jit
    def _accumulate_kernel(counters_ptr, loss_ptr, weight_ptr, ring_ptr, ring_size, HAS_RING: tl.constexpr):
        loss = tl.load(loss_ptr).to(tl.float32)
        weight = tl.load(weight_ptr).to(tl.float32)
        loss_sum = tl.load(counters_ptr)
        weight_sum = tl.load(counters_ptr + 1)
        flag = tl.load(counters_ptr + 2)
        calls = tl.load(counters_ptr + 3)
        nonfinite = (loss != loss) | (tl.abs(loss) > 3.4028234663852886e38)
        tl.store(counters_ptr, loss_sum + loss * weight)
        tl.store(counters_ptr + 1, weight_sum + weight)
        tl.store(counters_ptr + 2, tl.maximum(flag, nonfinite.to(tl.float32)))
        if HAS_RING:
            slot = calls.to(tl.int32) % ring_size
            tl.store(ring_ptr + slot, loss)
        tl.store(counters_ptr + 3, calls + 1.0)


def _check(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor], fn_name: str) -> None:
    if not isinstance(counters, Tensor) or counters.dtype != torch.float32 or counters.shape != (NUM_COUNTERS,):
        got = f"{counters.dtype} {tuple(counters.shape)}" if isinstance(counters, Tensor) else type(counters).__name__
        raise TypeError(f"{fn_name}: counters must be a float32 tensor of shape (4,), got {got}")
    if not counters.is_contiguous():
        raise ValueError(f"{fn_name}: counters must be contiguous")
    for name, t in (("loss", loss), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{fn_name}: {name} must be a one-element tensor on {counters.device}, got "
                f"{type(t).__name__} (a Python number would cost a host-to-device copy per step)"
            )
        if t.numel() != 1 or not t.is_floating_point():
            raise TypeError(f"{fn_name}: {name} must be a one-element float tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != counters.device:
            raise ValueError(f"{fn_name}: {name} is on {t.device} but counters are on {counters.device}")
    if ring is not None:
        if not isinstance(ring, Tensor) or ring.dtype != torch.float32 or ring.dim() != 1 or ring.numel() == 0:
            raise TypeError(f"{fn_name}: ring must be a non-empty 1-D float32 tensor")
        if not ring.is_contiguous():
            raise ValueError(f"{fn_name}: ring must be contiguous")
        if ring.device != counters.device:
            raise ValueError(f"{fn_name}: ring is on {ring.device} but counters are on {counters.device}")


def _launch(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor]) -> None:
    with mt.device_guard(counters.device):
        _accumulate_kernel[(1,)](
            counters, loss, weight, ring if ring is not None else counters,
            ring.numel() if ring is not None else 1, HAS_RING=ring is not None, num_warps=1,
        )


def accumulate_loss_triton(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor] = None) -> None:
    """Run the Triton kernel directly (CUDA tensors, or CPU tensors under the interpreter)."""
    _check(counters, loss, weight, ring, "accumulate_loss_triton")
    mt.check_launch_device(counters.device, "accumulate_loss_triton")
    _launch(counters, loss.detach(), weight.detach(), ring)


def accumulate_loss_reference(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor] = None) -> None:
    """Plain PyTorch version of :func:`accumulate_loss_` (a handful of launches, no sync)."""
    loss32 = loss.detach().reshape(()).float()
    weight32 = weight.detach().reshape(()).float()
    if ring is not None:
        slot = counters[3].long().remainder(ring.numel()).reshape(1)
        ring.index_copy_(0, slot, loss32.reshape(1))
    counters[0].add_(loss32 * weight32)
    counters[1].add_(weight32)
    counters[2].copy_(torch.maximum(counters[2], (~torch.isfinite(loss32)).float()))
    counters[3].add_(1.0)


@torch.library.custom_op("fasttrain::accumulate_loss", mutates_args=("counters", "ring"))
def _accumulate_loss_op(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor]) -> None:
    accumulate_loss_reference(counters, loss, weight, ring)


@_accumulate_loss_op.register_fake
def _accumulate_loss_fake(counters, loss, weight, ring):
    return None


@_accumulate_loss_op.register_kernel("cuda")
def _accumulate_loss_cuda(counters, loss, weight, ring):
    if mt.triton_targets(counters.device):
        _launch(counters, loss, weight, ring)
    else:
        accumulate_loss_reference(counters, loss, weight, ring)


def accumulate_loss_(counters: Tensor, loss: Tensor, weight: Tensor, ring: Optional[Tensor] = None) -> None:
    """Add one step's loss to the device counters (see the module docstring for the math).

    ``loss``: batch-mean loss, one element, any float dtype. ``weight``: batch size as a
    one-element float tensor on the same device. One Triton launch on CUDA, the PyTorch reference
    elsewhere; traceable by ``torch.compile(fullgraph=True)`` and replayable in a CUDA graph.
    """
    _check(counters, loss, weight, ring, "accumulate_loss_")
    _accumulate_loss_op(counters, loss.detach(), weight.detach(), ring)


def reset_counters_(counters: Tensor, ring: Optional[Tensor] = None) -> None:
    """Zero the counters (and the ring); device-side, no sync."""
    counters.zero_()
    if ring is not None:
        ring.zero_()


@dataclass(frozen=True)
class LossSnapshot:
    """Host copy of the counters since the last reset."""

    loss_sum: float
    weight_sum: float
    nonfinite: bool
    calls: int
    recent: List[float]  # up to ring_size most recent losses, oldest first

    @property
    def mean(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum else float("nan")


class LossCounters:
    """Counters and an optional ring of recent losses in one device buffer.

    ``counters`` and ``ring`` are views of ``buffer``, so a flush is ``buffer.cpu()``: exactly
    one device-to-host copy, no concatenation kernel.
    """

    def __init__(self, device: Union[str, torch.device], ring_size: int = 0):
        if ring_size < 0:
            raise ValueError(f"LossCounters: ring_size must be >= 0, got {ring_size}")
        self.ring_size = int(ring_size)
        self.buffer = torch.zeros(NUM_COUNTERS + self.ring_size, dtype=torch.float32, device=device)
        self.counters = self.buffer[:NUM_COUNTERS]
        self.ring = self.buffer[NUM_COUNTERS:] if self.ring_size else None

    def accumulate(self, loss: Tensor, weight: Tensor) -> None:
        accumulate_loss_(self.counters, loss, weight, self.ring)

    def reset(self) -> None:
        self.buffer.zero_()

    def decode(self, host: Tensor) -> LossSnapshot:
        """Turn a host copy of ``buffer`` (possibly a slice of a larger packed copy) into values."""
        values = host.tolist()  # SYNC(none): decodes a copy already on the host
        calls = int(values[3])
        recent: List[float] = []
        if self.ring_size:
            ring = values[NUM_COUNTERS:]
            kept = min(calls, self.ring_size)
            recent = [ring[(calls - kept + i) % self.ring_size] for i in range(kept)]
        return LossSnapshot(values[0], values[1], values[2] > 0, calls, recent)

    def read(self) -> LossSnapshot:
        # SYNC(flush): one device-to-host copy of the whole buffer, at flush intervals only
        return self.decode(self.buffer.cpu())
