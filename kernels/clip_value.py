"""Clip gradients by value in one fused launch.

Math, for every element x of every gradient (fp32 / fp16 / bf16, one device)::

    x <- min(max(x, -clip_value), clip_value)      # evaluated in fp32, stored in the grad dtype
    found_inf <- 1.0  if any x was NaN or +-inf before clamping

This is ``torch.clamp(x, -c, c)`` element for element: NaN stays NaN, +-inf become +-c, and a
negative ``clip_value`` gives ``c`` everywhere as torch's min/max order does. ``found_inf`` is
never reset here.

Launch plan: one program per chunk of one tensor, through the same cached chunk table as
``clip_norm`` (program id -> address, length, dtype). Traffic: reads ``N`` bytes, and writes
only the elements that actually change (masked stores), so a typical step where few values
exceed the limit writes almost nothing; torch's foreach path reads and writes ``N`` twice
(clamp_min, then clamp_max).
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from .clip_norm import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    _DTYPE_CODES,
    _is_dense,
    _result_device,
    _triton_targets,
    as_grad_list,
    check_found_inf,
    check_launch_device,
    check_sizes,
    chunk_table,
    device_guard,
    triton_can_clip,
    warn_fallback_once,
)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

__all__ = ["clip_grad_value_", "clip_grad_value_reference", "clip_grad_value_triton"]

_NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _clamp_block(p, x, lo, hi, inside):
        # Comparisons with NaN are false, so NaN lanes are neither changed nor stored; only
        # lanes that change are written.
        y = tl.where(x < lo, lo, x)
        y = tl.where(y > hi, hi, y)
        tl.store(p, y.to(p.dtype.element_ty), mask=inside & ((x < lo) | (x > hi)))
        return ((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32)

    @triton.jit
    def _clamp_range(ptr, n, lo, hi, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # Same loop shape as clip_norm._sumsq_range. Returns a per-lane "saw a non-finite value"
        # flag; the caller reduces it once.
        offs = tl.arange(0, BLOCK)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, CHUNK, BLOCK):
            if start + BLOCK <= n:
                p = ptr + start + offs
                if ALIGNED:
                    p = tl.multiple_of(p, 16)
                x = tl.load(p).to(tl.float32)
                bad = tl.maximum(bad, _clamp_block(p, x, lo, hi, offs < BLOCK))
            elif start < n:
                inside = start + offs < n
                x = tl.load(ptr + start + offs, mask=inside, other=0.0).to(tl.float32)
                bad = tl.maximum(bad, _clamp_block(ptr + start + offs, x, lo, hi, inside))
        return bad

    @triton.jit
    def _clamp_kernel(
        table_ptr,
        num_chunks,
        lo,
        hi,
        found_inf_ptr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
    ):
        pid = tl.program_id(0)
        addr = tl.load(table_ptr + pid)
        n = tl.load(table_ptr + num_chunks + pid).to(tl.int32)
        code = tl.load(table_ptr + 2 * num_chunks + pid)
        if code == 0:
            bad = _clamp_range(addr.to(tl.pointer_type(tl.float32)), n, lo, hi, CHUNK, BLOCK, ALIGNED)
        elif code == 1:
            bad = _clamp_range(addr.to(tl.pointer_type(tl.float16)), n, lo, hi, CHUNK, BLOCK, ALIGNED)
        else:
            bad = _clamp_range(addr.to(tl.pointer_type(tl.bfloat16)), n, lo, hi, CHUNK, BLOCK, ALIGNED)
        if HAS_FOUND_INF:
            # Several programs may store 1.0 at once; they all write the same value.
            if tl.max(bad, axis=0) > 0:
                tl.store(found_inf_ptr, 1.0)


def _launch(
    grads: List[Tensor],
    clip_value: float,
    found_inf: Optional[Tensor],
    chunk_size: int = DEFAULT_CHUNK,
    block_size: int = DEFAULT_BLOCK,
) -> None:
    info = chunk_table(grads, chunk_size)
    if info.num_chunks == 0:
        return
    device = grads[0].device
    with device_guard(device):
        _clamp_kernel[(info.num_chunks,)](
            info.table, info.num_chunks, -clip_value, clip_value,
            found_inf if found_inf is not None else info.table,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned,
            HAS_FOUND_INF=found_inf is not None,
            num_warps=_NUM_WARPS,
        )


def _check_clip_value(clip_value) -> float:
    if isinstance(clip_value, Tensor):
        raise TypeError(
            "clip_grad_value_: clip_value must be a Python number (it is a launch constant)"
        )
    return float(clip_value)


def clip_grad_value_triton(
    grads: Sequence[Tensor],
    clip_value: float,
    found_inf: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    block_size: int = DEFAULT_BLOCK,
) -> None:
    """Run the fused Triton kernel directly (CUDA tensors, or CPU tensors under the interpreter)."""
    grads = as_grad_list(grads, "clip_grad_value_triton")
    clip_value = _check_clip_value(clip_value)
    check_found_inf(found_inf, _result_device(grads, found_inf), "clip_grad_value_triton")
    check_sizes(chunk_size, block_size)
    if not grads:
        return
    check_launch_device(grads[0].device, "clip_grad_value_triton")
    for i, g in enumerate(grads):
        if g.numel() and g.dtype not in _DTYPE_CODES:
            raise TypeError(f"clip_grad_value_triton: grads[{i}] is {g.dtype}; kernels take fp32/fp16/bf16")
        if g.numel() and not _is_dense(g):
            raise ValueError(f"clip_grad_value_triton: grads[{i}] is not dense in memory; pass .contiguous()")
    _launch(grads, clip_value, found_inf, chunk_size, block_size)


def clip_grad_value_reference(
    grads: Sequence[Tensor], clip_value: float, found_inf: Optional[Tensor] = None
) -> None:
    """Plain PyTorch version of :func:`clip_grad_value_` (a few launches per tensor, no sync)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return
    if found_inf is not None:
        # Read before clamping: clamping turns +-inf into finite values.
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        found_inf.copy_(torch.where(finite, found_inf, 1.0))
    torch._foreach_clamp_min_(grads, -clip_value)
    torch._foreach_clamp_max_(grads, clip_value)


@torch.library.custom_op("fasttrain::clip_grad_value", mutates_args=("grads", "found_inf"))
def _clip_grad_value_op(grads: List[Tensor], clip_value: float, found_inf: Optional[Tensor]) -> None:
    clip_grad_value_reference(grads, clip_value, found_inf)


@_clip_grad_value_op.register_fake
def _clip_grad_value_fake(grads, clip_value, found_inf):
    return None


@_clip_grad_value_op.register_kernel("cuda")
def _clip_grad_value_cuda(grads, clip_value, found_inf):
    if triton_can_clip(grads):
        _launch(grads, clip_value, found_inf)
        return
    if _triton_targets(grads[0].device):
        warn_fallback_once("clip_grad_value_")
    clip_grad_value_reference(grads, clip_value, found_inf)


def clip_grad_value_(
    grads: Union[Tensor, Sequence[Tensor]],
    clip_value: float,
    found_inf: Optional[Tensor] = None,
) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` in place.

    NaN stays NaN (as ``torch.clamp``); ``found_inf`` (fp32, shape (1,)) is set to 1.0 when any
    element is NaN or infinite and otherwise left alone. Fused Triton kernel on CUDA, PyTorch
    reference elsewhere; traceable by ``torch.compile(fullgraph=True)`` and capturable in a CUDA
    graph after one warm-up call.
    """
    grads = as_grad_list(grads, "clip_grad_value_")
    clip_value = _check_clip_value(clip_value)
    check_found_inf(found_inf, _result_device(grads, found_inf), "clip_grad_value_")
    if not grads:
        return
    _clip_grad_value_op(grads, clip_value, found_inf)
