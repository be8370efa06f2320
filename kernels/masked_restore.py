"""Save a list of tensors in one launch, and put them back in one launch where a flag is raised.

An optimizer step that must not apply when its gradients were not finite (``nonfinite="skip"``
with an optimizer that cannot read the flag itself) is undone on the device: the parameters and
their optimizer state are saved before the step and put back after it where ``found_inf > 0``::

    snapshot = save_snapshot(tensors)               # before the step: one byte buffer
    restore_where_(tensors, snapshot, found_inf)    # after it: tensors <- snapshot if found_inf > 0

Both copy bytes, whatever the dtype, so a restored tensor is bit for bit what was saved.

Launch plan: one program per chunk of one tensor, through a cached table (program id -> the
tensor's byte address, the chunk's byte offset in the snapshot, its length in bytes); the
snapshot's address is a launch argument, so the table depends only on the tensors and survives
from step to step, as a CUDA graph capture needs. The snapshot lays the tensors end to end, each
starting on a 16-byte boundary, so full blocks move as 16-byte vectors when the tensors are
aligned too. Traffic: the save reads and writes ``N`` bytes; the restore reads the flag and, only
where it is raised, ``N`` bytes more; an update that applies costs the restore one load per
program. A plain PyTorch undo (clone each tensor, then one ``torch.where`` per tensor and a copy
back) moves ``7N`` bytes in ``2n + 1`` launches for ``n`` tensors.

On the CPU and for tensors the kernel cannot walk as one block of memory, the PyTorch reference
(a multi-tensor copy each way, the restore through ``torch.where``) does the same.
"""
from typing import List, Sequence

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._multi_tensor import tl, triton  # both None where triton is not installed

__all__ = [
    "prepare_snapshot_table",
    "restore_where_",
    "restore_where_reference",
    "restore_where_triton",
    "save_snapshot",
    "save_snapshot_reference",
    "save_snapshot_triton",
    "snapshot_nbytes",
]

ALIGN = 16  # bytes: each tensor's place in the snapshot starts on a vector boundary
DEFAULT_CHUNK_BYTES = 131072  # the clip kernels' 32768 fp32 elements per program
DEFAULT_BLOCK_BYTES = 16384  # 64 bytes per thread with 8 warps: four 16-byte vectors


def _place(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def snapshot_nbytes(tensors: Sequence[Tensor]) -> int:
    """Size in bytes of the snapshot of ``tensors``."""
    return sum(_place(_nbytes(t)) for t in tensors)


def _empty_snapshot(tensors: Sequence[Tensor]) -> Tensor:
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty(snapshot_nbytes(tensors), dtype=torch.uint8, device=device)


def _offsets(tensors: Sequence[Tensor]) -> List[int]:
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += _place(_nbytes(t))
    return offsets


if triton is not None:

    @triton.jit
    def _copy_bytes(src, dst, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # Full blocks move without a mask (16-byte vectors when the table says every chunk is
        # aligned, hinted on the pointers as in _multi_tensor._walk_range); the tail is masked.
        # A constant trip count for the interpreter, as there.
        offs = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            if start + BLOCK <= n:
                s = src + start + offs
                d = dst + start + offs
                if ALIGNED:
                    s = tl.multiple_of(s, 16)
                    d = tl.multiple_of(d, 16)
                tl.store(d, tl.load(s))
            elif start < n:
                idx = start + offs
                inside = idx < n
                tl.store(dst + idx, tl.load(src + idx, mask=inside), mask=inside)

    @triton.jit
    def _snapshot_kernel(
        table_ptr,
        num_chunks,
        snapshot_ptr,
        found_inf_ptr,
        SAVE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        tensor = tl.load(table_ptr + chunk).to(tl.pointer_type(tl.uint8))
        saved = snapshot_ptr + tl.load(table_ptr + num_chunks + chunk)
        n = tl.load(table_ptr + 2 * num_chunks + chunk).to(tl.int32)
        if SAVE:
            _copy_bytes(tensor, saved, n, CHUNK, BLOCK, ALIGNED)
        else:
            # the flag is one element every program reads; where it is down, nothing moves
            if tl.load(found_inf_ptr) > 0:
                _copy_bytes(saved, tensor, n, CHUNK, BLOCK, ALIGNED)


def _table(tensors: Sequence[Tensor], chunk: int) -> mt.ChunkTable:
    device = tensors[0].device
    key = ("snapshot", device, chunk, tuple((t.data_ptr(), _nbytes(t)) for t in tensors))

    def rows():
        addrs: List[int] = []
        places: List[int] = []
        sizes: List[int] = []
        aligned = True
        for t, offset in zip(tensors, _offsets(tensors)):
            n = _nbytes(t)
            aligned = aligned and (n == 0 or t.data_ptr() % ALIGN == 0)
            for start in range(0, n, chunk):
                addrs.append(t.data_ptr() + start)
                places.append(offset + start)
                sizes.append(min(chunk, n - start))
        return [addrs, places, sizes], aligned

    return mt.cached_table(key, device, rows, "the snapshot table")


def _walkable(tensors: Sequence[Tensor]) -> bool:
    """True when the kernel handles ``tensors`` on their device (else use the reference)."""
    return bool(tensors) and mt.triton_targets(tensors[0].device) and all(mt.is_dense(t) for t in tensors)


def _launch(tensors, snapshot, found_inf, save, chunk_size=DEFAULT_CHUNK_BYTES, block_size=DEFAULT_BLOCK_BYTES):
    info = _table(tensors, chunk_size)
    if info.num_chunks == 0:
        return
    with mt.device_guard(tensors[0].device):
        _snapshot_kernel[(info.num_chunks,)](
            info.table, info.num_chunks, snapshot, found_inf if found_inf is not None else info.table,
            SAVE=save, CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned,
            num_warps=mt.NUM_WARPS,
        )


# --------------------------------------------------------------------------------------------
# The PyTorch reference
# --------------------------------------------------------------------------------------------
def _views(tensors: Sequence[Tensor], snapshot: Tensor) -> List[Tensor]:
    """Each tensor's place in ``snapshot``, typed and shaped like it; a tensor that is one block
    of memory keeps its strides there (so the bytes are the kernel's), any other is contiguous."""
    views = []
    for t, offset in zip(tensors, _offsets(tensors)):
        place = snapshot[offset : offset + _nbytes(t)].view(t.dtype)
        views.append(place.as_strided(t.shape, t.stride()) if mt.is_dense(t) else place.view(t.shape))
    return views


def save_snapshot_reference(tensors: Sequence[Tensor]) -> Tensor:
    """Plain PyTorch version of :func:`save_snapshot` (one multi-tensor copy, no sync)."""
    tensors = list(tensors)
    snapshot = _empty_snapshot(tensors)
    if tensors:
        torch._foreach_copy_(_views(tensors, snapshot), tensors)
    return snapshot


def restore_where_reference(tensors: Sequence[Tensor], snapshot: Tensor, found_inf: Tensor) -> None:
    """Plain PyTorch version of :func:`restore_where_` (one ``torch.where`` per tensor, no sync)."""
    if not tensors:
        return
    skip = found_inf.reshape(()) > 0
    for t, saved in zip(tensors, _views(tensors, snapshot)):
        # a select picks its operand bit for bit; it writes the tensor it reads, element by element
        torch.where(skip, saved, t, out=t)


# --------------------------------------------------------------------------------------------
# Checks and the direct launchers
# --------------------------------------------------------------------------------------------
def _check_snapshot(tensors: Sequence[Tensor], snapshot: Tensor, fn_name: str) -> None:
    expected = snapshot_nbytes(tensors)
    if not isinstance(snapshot, Tensor) or snapshot.dtype != torch.uint8 or snapshot.dim() != 1:
        raise TypeError(f"{fn_name}: snapshot must be the 1-D uint8 tensor save_snapshot() returned")
    if snapshot.numel() != expected or not snapshot.is_contiguous():
        raise ValueError(
            f"{fn_name}: the snapshot holds {snapshot.numel()} bytes but these tensors need {expected}; "
            "restore the same tensors, in the same order, that were saved"
        )
    if tensors and snapshot.device != tensors[0].device:
        raise ValueError(f"{fn_name}: the snapshot is on {snapshot.device} but the tensors on {tensors[0].device}")


def _check_launch(tensors: Sequence[Tensor], fn_name: str) -> None:
    mt.check_launch_device(tensors[0].device, fn_name)
    for i, t in enumerate(tensors):
        if not mt.is_dense(t):
            raise ValueError(f"{fn_name}: tensors[{i}] is not dense in memory; use the reference")


def save_snapshot_triton(
    tensors: Sequence[Tensor], *, chunk_size: int = DEFAULT_CHUNK_BYTES, block_size: int = DEFAULT_BLOCK_BYTES
) -> Tensor:
    """Run the save kernel directly (CUDA tensors, or CPU tensors under the interpreter)."""
    tensors = mt.as_tensor_list(tensors, "save_snapshot_triton")
    mt.check_sizes(chunk_size, block_size)
    if not tensors:
        return _empty_snapshot(tensors)
    _check_launch(tensors, "save_snapshot_triton")
    snapshot = _empty_snapshot(tensors)
    _launch(tensors, snapshot, None, True, chunk_size, block_size)
    return snapshot


def restore_where_triton(
    tensors: Sequence[Tensor],
    snapshot: Tensor,
    found_inf: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    block_size: int = DEFAULT_BLOCK_BYTES,
) -> None:
    """Run the restore kernel directly (CUDA tensors, or CPU tensors under the interpreter)."""
    tensors = mt.as_tensor_list(tensors, "restore_where_triton")
    _check_snapshot(tensors, snapshot, "restore_where_triton")
    mt.check_found_inf(found_inf, mt.result_device(tensors, found_inf), "restore_where_triton")
    mt.check_sizes(chunk_size, block_size)
    if not tensors:
        return
    _check_launch(tensors, "restore_where_triton")
    _launch(tensors, snapshot, found_inf, False, chunk_size, block_size)


def prepare_snapshot_table(tensors: Sequence[Tensor]) -> None:
    """Build (or refresh in the cache) the table the kernels will use for ``tensors``, where they
    run on them. A CUDA graph capture cannot copy a new table to the device, so whoever captures
    a save or a restore calls this first (as ``prepare_chunk_tables`` for the clip kernels)."""
    tensors = list(tensors)
    if _walkable(tensors):
        _table(tensors, DEFAULT_CHUNK_BYTES)


# --------------------------------------------------------------------------------------------
# Custom ops and the public functions
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::save_snapshot", mutates_args=())
def _save_snapshot_op(tensors: List[Tensor]) -> Tensor:
    return save_snapshot_reference(tensors)


@_save_snapshot_op.register_fake
def _save_snapshot_fake(tensors):
    return tensors[0].new_empty(snapshot_nbytes(tensors), dtype=torch.uint8)


@_save_snapshot_op.register_kernel("cuda")
def _save_snapshot_cuda(tensors):
    if not _walkable(tensors):
        return save_snapshot_reference(tensors)
    snapshot = _empty_snapshot(tensors)
    _launch(tensors, snapshot, None, True)
    return snapshot


@torch.library.custom_op("fasttrain::restore_where", mutates_args=("tensors",))
def _restore_where_op(tensors: List[Tensor], snapshot: Tensor, found_inf: Tensor) -> None:
    restore_where_reference(tensors, snapshot, found_inf)


@_restore_where_op.register_fake
def _restore_where_fake(tensors, snapshot, found_inf):
    return None


@_restore_where_op.register_kernel("cuda")
def _restore_where_cuda(tensors, snapshot, found_inf):
    if _walkable(tensors):
        _launch(tensors, snapshot, found_inf, False)
    else:
        restore_where_reference(tensors, snapshot, found_inf)


def save_snapshot(tensors: Sequence[Tensor]) -> Tensor:
    """A copy of the bytes of every tensor in ``tensors`` (one device, any dtypes and layouts),
    as one 1-D uint8 tensor for :func:`restore_where_`. Fused Triton kernel on CUDA, PyTorch
    reference elsewhere; no host read; traceable by ``torch.compile`` and capturable in a CUDA
    graph once :func:`prepare_snapshot_table` (or a first call) has built the table."""
    tensors = mt.as_tensor_list(tensors, "save_snapshot")
    if not tensors:
        raise ValueError("save_snapshot: no tensors to save")
    return _save_snapshot_op(tensors)


def restore_where_(tensors: Sequence[Tensor], snapshot: Tensor, found_inf: Tensor) -> None:
    """Put ``snapshot`` (from :func:`save_snapshot` of the same tensors) back into ``tensors``,
    bit for bit, where ``found_inf`` (fp32, shape (1,)) is above 0; otherwise leave them alone.
    The flag is read on the device: no host synchronisation."""
    tensors = mt.as_tensor_list(tensors, "restore_where_")
    _check_snapshot(tensors, snapshot, "restore_where_")
    mt.check_found_inf(found_inf, mt.result_device(tensors, found_inf), "restore_where_")
    if not tensors:
        return
    _restore_where_op(tensors, snapshot, found_inf)
