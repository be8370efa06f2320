"""Clip gradients by value in one fused launch.

Math, for every element x of every gradient (fp32 / fp16 / bf16, one device)::

    x <- min(max(x, -clip_value), clip_value)      # evaluated in fp32, stored in the grad dtype
    found_inf <- 1.0  if any x was NaN or +-inf before clamping

This is ``torch.clamp(x, -c, c)`` element for element: NaN stays NaN, +-inf become +-c, and a
negative ``clip_value`` gives ``c`` everywhere as torch's min/max order does. ``found_inf`` is
never reset here.

Launch plan: one program per chunk of one tensor, through the cached chunk table that
``clip_norm`` uses too (``_multi_tensor``: program id -> address, length, dtype). Traffic: reads
``N`` bytes, and writes only the elements whose stored value changes (masked stores, compared in
the gradient's dtype, where a clamped value rounds to the limit's nearest representable number), so
a typical step where few values exceed the limit writes almost nothing; torch's foreach path reads and writes
``N`` twice (clamp_min, then clamp_max).
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._multi_tensor import tl, triton  # both None where triton is not installed

__all__ = ["clip_grad_value_", "clip_grad_value_reference", "clip_grad_value_triton"]

if triton is not None:

    @triton.jit
    def _clamp_block(p, x, inside, bad, lo, hi, MASKED: tl.constexpr):
        # Comparisons with NaN are false, so NaN lanes are neither changed nor stored; only
        # lanes whose stored value changes are written. "Changes" is decided in the gradient's
        # dtype: in fp16/bf16 the limit rounds to the nearest representable value, which can lie
        # outside [lo, hi] (bf16(1e-4) > 1e-4), so a lane clamped by an earlier call is still
        # "outside" in fp32 and would be rewritten, unchanged, on every call. `bad` is a per-lane
        # "saw a non-finite value" flag that the kernel reduces once.
        y = tl.where(x < lo, lo, x)
        y = tl.where(y > hi, hi, y)
        out = y.to(p.dtype.element_ty)
        changed = ((x < lo) | (x > hi)) & (out.to(tl.float32) != x)
        tl.store(p, out, mask=inside & changed)
        return tl.maximum(bad, ((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32))

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
        bad = mt.walk_chunk(
            table_ptr, num_chunks, tl.program_id(0), tl.zeros([BLOCK], dtype=tl.int32), lo, hi,
            _clamp_block, CHUNK, BLOCK, ALIGNED,
        )
        if HAS_FOUND_INF:
            # Several programs may store 1.0 at once; they all write the same value.
            if tl.max(bad, axis=0) > 0:
                tl.store(found_inf_ptr, 1.0)


def _launch(
    grads: List[Tensor],
    clip_value: float,
    found_inf: Optional[Tensor],
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> None:
    info = mt.chunk_table(grads, chunk_size)
    if info.num_chunks == 0:
        return
    device = grads[0].device
    with mt.device_guard(device):
        _clamp_kernel[(info.num_chunks,)](
            info.table, info.num_chunks, -clip_value, clip_value,
            found_inf if found_inf is not None else info.table,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned,
            HAS_FOUND_INF=found_inf is not None,
            num_warps=mt.NUM_WARPS,
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
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> None:
    """Run the fused Triton kernel directly (CUDA tensors, or CPU tensors under the interpreter)."""
    grads = mt.as_grad_list(grads, "clip_grad_value_triton")
    clip_value = _check_clip_value(clip_value)
    mt.check_found_inf(found_inf, mt.result_device(grads, found_inf), "clip_grad_value_triton")
    mt.check_sizes(chunk_size, block_size)
    if not grads:
        return
    mt.check_launch_device(grads[0].device, "clip_grad_value_triton")
    mt.check_kernel_grads(grads, "clip_grad_value_triton")
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
    if mt.triton_can_clip(grads):
        _launch(grads, clip_value, found_inf)
        return
    if mt.triton_targets(grads[0].device):
        mt.warn_fallback_once("clip_grad_value_")
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
    grads = mt.as_grad_list(grads, "clip_grad_value_")
    clip_value = _check_clip_value(clip_value)
    mt.check_found_inf(found_inf, mt.result_device(grads, found_inf), "clip_grad_value_")
    if not grads:
        return
    _clip_grad_value_op(grads, clip_value, found_inf)
