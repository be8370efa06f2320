"""Clip gradients by their global L2 norm in three fused launches.

Math, for gradients g_1..g_k (any mix of fp32 / fp16 / bf16, all on one device)::

    norm  = sqrt(sum_i sum_j float32(g_i[j]) ** 2)          # accumulated in fp32
    scale = min(1, max_norm / (norm + eps))                  # NaN stays NaN, as torch.clamp
    g_i  <- round_to(g_i.dtype, float32(g_i) * scale)        # in place, every tensor

This is ``torch.nn.utils.clip_grad_norm_`` with ``norm_type=2``: the returned norm is the one
before clipping, and a non-finite norm gives a NaN or zero scale exactly as torch does (the caller
skips the update through ``found_inf``, which is set to 1.0 and never reset here).

Launch plan (``N`` = total gradient bytes, ``C`` = number of chunks):

1. ``_sumsq_kernel``: one program per chunk of one tensor (a host-built, cached table maps
   program id -> address, length, dtype) writes one fp32 partial sum of squares.
   Traffic: reads ``N``, writes ``4*C`` bytes.
2. ``_finalize_kernel``: one program reduces the ``C`` partials, writes the norm and the scale and
   raises ``found_inf``. Traffic: ``~4*C`` bytes.
3. ``_scale_kernel``: one program per chunk multiplies in place. Programs return at once when the
   scale is exactly 1 (multiplying by 1 is the identity, so skipping is bit-exact). Chunks are
   walked in reverse so the first ones visited are those pass 1 read last, often still in L2.
   Traffic: reads and writes ``N`` when clipping (less what L2 still holds), nothing otherwise.

Total: ``3N`` bytes when clipping, ``N`` when the norm is within ``max_norm``; torch's foreach
path moves ``3N`` in both cases. No step reads a device value on the host: the table depends only
on addresses, sizes and dtypes, and is built once per set of gradient tensors (call once before
CUDA graph capture so the capture finds it cached, and capture inside :func:`~._multi_tensor.hold_chunk_tables`
so the graph keeps the tables it points at).
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._multi_tensor import tl, triton  # both None where triton is not installed

__all__ = [
    "clip_grad_norm_",
    "clip_grad_norm_reference",
    "clip_grad_norm_triton",
]

_FINALIZE_BLOCK = 1024


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sumsq_block(p, x, inside, acc, a, b, MASKED: tl.constexpr):
        # lanes outside the chunk were loaded as 0 and add nothing
        return acc + x * x

    @triton.jit
    def _sumsq_kernel(
        table_ptr, partial_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        pid = tl.program_id(0)
        acc = mt.walk_chunk(
            table_ptr, num_chunks, pid, tl.zeros([BLOCK], dtype=tl.float32), 0.0, 0.0,
            _sumsq_block, CHUNK, BLOCK, ALIGNED,
        )
        tl.store(partial_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _finalize_kernel(
        partial_ptr,
        num_partials,
        max_norm_ptr,
        max_norm_value,
        eps,
        norm_ptr,
        scale_ptr,
        found_inf_ptr,
        MAX_NORM_IS_TENSOR: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        SPAN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # SPAN (num_partials rounded up to a power of two) is a constant trip count for the same
        # reason as in _multi_tensor._walk_range; rounding keeps the number of compiled variants
        # small.
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, SPAN, BLOCK):
            if start < num_partials:
                idx = start + offs
                acc += tl.load(partial_ptr + idx, mask=idx < num_partials, other=0.0)
        norm = tl.sqrt_rn(tl.sum(acc, axis=0))
        if MAX_NORM_IS_TENSOR:
            max_norm = tl.load(max_norm_ptr).to(tl.float32)
        else:
            max_norm = max_norm_value
        scale = tl.div_rn(max_norm, norm + eps)
        # Written as "> 1 -> 1" so a NaN scale survives, as torch.clamp(max=1) lets it.
        scale = tl.where(scale > 1.0, 1.0, scale)
        tl.store(norm_ptr, norm)
        tl.store(scale_ptr, scale)
        if HAS_FOUND_INF:
            if (norm != norm) | (norm > 3.4028234663852886e38):
                tl.store(found_inf_ptr, 1.0)

    @triton.jit
    def _scale_block(p, x, inside, acc, scale, b, MASKED: tl.constexpr):
        y = (x * scale).to(p.dtype.element_ty)
        if MASKED:
            tl.store(p, y, mask=inside)
        else:
            tl.store(p, y)
        return acc

    @triton.jit
    def _scale_kernel(
        table_ptr, num_chunks, scale_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        scale = tl.load(scale_ptr)
        if scale != 1.0:
            # Walk the chunks in reverse: the last ones pass 1 read are likely still in L2.
            mt.walk_chunk(
                table_ptr, num_chunks, num_chunks - 1 - tl.program_id(0), tl.zeros([BLOCK], dtype=tl.float32),
                scale, 0.0, _scale_block, CHUNK, BLOCK, ALIGNED,
            )


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _launch(
    grads: List[Tensor],
    max_norm_tensor: Optional[Tensor],
    max_norm: float,
    eps: float,
    found_inf: Optional[Tensor],
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> Tensor:
    device = grads[0].device
    norm = torch.empty((), dtype=torch.float32, device=device)
    info = mt.chunk_table(grads, chunk_size)
    if info.num_chunks == 0:
        return norm.zero_()
    partials = torch.empty(info.num_chunks, dtype=torch.float32, device=device)
    scale = torch.empty(1, dtype=torch.float32, device=device)
    grid = (info.num_chunks,)
    with mt.device_guard(device):
        _sumsq_kernel[grid](
            info.table, partials, info.num_chunks,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=mt.NUM_WARPS,
        )
        _finalize_kernel[(1,)](
            partials, info.num_chunks,
            max_norm_tensor if max_norm_tensor is not None else norm, max_norm, eps,
            norm, scale, found_inf if found_inf is not None else norm,
            MAX_NORM_IS_TENSOR=max_norm_tensor is not None,
            HAS_FOUND_INF=found_inf is not None,
            SPAN=triton.next_power_of_2(max(info.num_chunks, _FINALIZE_BLOCK)),
            BLOCK=_FINALIZE_BLOCK, num_warps=4,
        )
        _scale_kernel[grid](
            info.table, info.num_chunks, scale,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=mt.NUM_WARPS,
        )
    return norm


def _check_max_norm(max_norm: Union[float, Tensor], device: Optional[torch.device]) -> None:
    if isinstance(max_norm, Tensor):
        if max_norm.numel() != 1 or not max_norm.is_floating_point():
            raise TypeError("clip_grad_norm_: a max_norm tensor must be a one-element float tensor")
        if device is not None and max_norm.device != device:
            raise ValueError(
                f"clip_grad_norm_: max_norm is on {max_norm.device} but the gradients are on "
                f"{device}; keep it on the gradients' device so no host copy is needed"
            )


def clip_grad_norm_triton(
    grads: Sequence[Tensor],
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
    *,
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> Tensor:
    """Run the fused Triton kernels directly (CUDA tensors, or CPU tensors under the interpreter).

    Same contract as :func:`clip_grad_norm_`; ``chunk_size`` / ``block_size`` let tests cover
    multi-chunk tensors and block tails with small shapes.
    """
    grads = mt.as_grad_list(grads, "clip_grad_norm_triton")
    device = mt.result_device(grads, found_inf, max_norm)
    mt.check_found_inf(found_inf, device, "clip_grad_norm_triton")
    _check_max_norm(max_norm, device)
    mt.check_sizes(chunk_size, block_size)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    mt.check_launch_device(device, "clip_grad_norm_triton")
    mt.check_kernel_grads(grads, "clip_grad_norm_triton")
    is_tensor = isinstance(max_norm, Tensor)
    return _launch(
        grads, max_norm if is_tensor else None, 0.0 if is_tensor else float(max_norm), float(eps),
        found_inf, chunk_size, block_size,
    )


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def clip_grad_norm_reference(
    grads: Sequence[Tensor],
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
) -> Tensor:
    """Plain PyTorch version of :func:`clip_grad_norm_` (one launch or more per tensor, no sync)."""
    grads = [g for g in grads if g.numel()]
    device = mt.result_device(grads, found_inf, max_norm)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    # fp16/bf16 norms are reduced in fp32 (torch's own path rounds them to the grad dtype).
    norms = [
        torch.linalg.vector_norm(g, dtype=torch.float32) if g.dtype in (torch.float16, torch.bfloat16)
        else torch.linalg.vector_norm(g).float()
        for g in grads
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    return scale_to_norm_reference(grads, total, max_norm, eps, found_inf)


def scale_to_norm_reference(
    grads: List[Tensor], norm: Tensor, max_norm: Union[float, Tensor], eps: float, found_inf: Optional[Tensor]
) -> Tensor:
    """The references' second half: scale the non-empty ``grads`` in place by
    ``min(1, max_norm / (norm + eps))``, raise ``found_inf`` when ``norm`` is not finite, and
    return ``norm``."""
    limit = max_norm.detach().reshape(()).float() if isinstance(max_norm, Tensor) else max_norm
    scale = torch.clamp(limit / (norm + eps), max=1.0)
    wide = [g for g in grads if g.dtype in (torch.float32, torch.float64)]
    if wide:
        torch._foreach_mul_(wide, scale)
    for g in grads:
        if g.dtype not in (torch.float32, torch.float64):
            g.copy_(g.float().mul_(scale))
    if found_inf is not None:
        found_inf.copy_(torch.where(torch.isfinite(norm), found_inf, 1.0))
    return norm


# --------------------------------------------------------------------------------------------
# Custom op: reference on CPU and by default, Triton on CUDA where it can run
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::clip_grad_norm", mutates_args=("grads", "found_inf"))
def _clip_grad_norm_op(
    grads: List[Tensor],
    max_norm_tensor: Optional[Tensor],
    max_norm: float,
    eps: float,
    found_inf: Optional[Tensor],
) -> Tensor:
    limit = max_norm_tensor if max_norm_tensor is not None else max_norm
    return clip_grad_norm_reference(grads, limit, eps, found_inf)


@_clip_grad_norm_op.register_fake
def _clip_grad_norm_fake(grads, max_norm_tensor, max_norm, eps, found_inf):
    return grads[0].new_empty((), dtype=torch.float32)


@_clip_grad_norm_op.register_kernel("cuda")
def _clip_grad_norm_cuda(grads, max_norm_tensor, max_norm, eps, found_inf):
    if mt.triton_can_clip(grads):
        return _launch(grads, max_norm_tensor, max_norm, eps, found_inf)
    if mt.triton_targets(grads[0].device):
        mt.warn_fallback_once("clip_grad_norm_")
    limit = max_norm_tensor if max_norm_tensor is not None else max_norm
    return clip_grad_norm_reference(grads, limit, eps, found_inf)


def clip_grad_norm_(
    grads: Union[Tensor, Sequence[Tensor]],
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
) -> Tensor:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``.

    Returns the norm before clipping as a 0-dim fp32 tensor on the gradients' device. ``max_norm``
    may be a one-element tensor on that device (changing its value needs no recompile and no host
    read). ``found_inf`` (fp32, shape (1,)) is set to 1.0 when the norm is not finite and is
    otherwise left alone. Empty tensors are skipped; an empty list returns a zero norm. Runs the
    fused Triton kernels on CUDA and the PyTorch reference elsewhere; traceable by
    ``torch.compile(fullgraph=True)`` and capturable in a CUDA graph after one warm-up call.
    """
    grads = mt.as_grad_list(grads, "clip_grad_norm_")
    device = mt.result_device(grads, found_inf, max_norm)
    mt.check_found_inf(found_inf, device, "clip_grad_norm_")
    _check_max_norm(max_norm, device)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if isinstance(max_norm, Tensor):
        return _clip_grad_norm_op(grads, max_norm, 0.0, float(eps), found_inf)
    return _clip_grad_norm_op(grads, None, float(max_norm), float(eps), found_inf)
