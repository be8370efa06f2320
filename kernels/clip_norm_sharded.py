"""Global-norm clipping split in two halves, for gradients sharded over several processes.

:func:`clip_grad_norm_` needs every gradient in one process. When each process holds only
shards (FSDP2's DTensors), the sum of squares must be added up over the processes between
measuring and scaling, so the same three launches are split around one all-reduce::

    s_local = sum_i sum_j float32(g_i[j]) ** 2        # grad_sumsq: this process's shards
    s       = all_reduce(s_local, SUM)                # the caller's collective
    norm    = sqrt(s)                                 # clip_grad_norm_from_sumsq_
    scale   = min(1, max_norm / (norm + eps))
    g_i    <- round_to(g_i.dtype, float32(g_i) * scale)

The norm, the scale and the flag follow :func:`clip_grad_norm_` exactly (``found_inf`` is set
to 1.0 when the norm is not finite and never reset here).

Launch plan (``N`` = this process's gradient bytes, ``C`` = chunks):

1. ``grad_sumsq``: ``clip_norm._sumsq_kernel`` writes one fp32 partial per chunk (reads ``N``),
   then one ``sum`` of the ``C`` partials (``4*C`` bytes).
2. ``clip_grad_norm_from_sumsq_``: ``_scale_by_sumsq_kernel``, one program per chunk. Each
   program derives the norm and the scale from the reduced sum (a few flops, so no separate
   finalize launch); program 0 stores the norm and raises the flag; programs return at once
   when the scale is exactly 1. Reads and writes ``N`` when clipping, nothing otherwise.

So the fused path keeps its single pass over the gradients (plus the scaling pass when it
clips) and no host read: the collective in between is the caller's, on the device.
"""
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._multi_tensor import tl, triton  # both None where triton is not installed
from .clip_norm import _check_max_norm, scale_to_norm_reference

if triton is not None:
    from .clip_norm import _scale_block, _sumsq_kernel

__all__ = [
    "clip_grad_norm_from_sumsq_",
    "clip_grad_norm_from_sumsq_reference",
    "clip_grad_norm_from_sumsq_triton",
    "grad_sumsq",
    "grad_sumsq_reference",
    "grad_sumsq_triton",
]

if triton is not None:

    @triton.jit
    def _scale_by_sumsq_kernel(
        table_ptr,
        num_chunks,
        sumsq_ptr,
        max_norm_ptr,
        max_norm_value,
        eps,
        norm_ptr,
        found_inf_ptr,
        MAX_NORM_IS_TENSOR: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        # the same arithmetic as clip_norm._finalize_kernel, so both paths give the same norm
        norm = tl.sqrt_rn(tl.load(sumsq_ptr).to(tl.float32))
        if MAX_NORM_IS_TENSOR:
            max_norm = tl.load(max_norm_ptr).to(tl.float32)
        else:
            max_norm = max_norm_value
        scale = tl.div_rn(max_norm, norm + eps)
        scale = tl.where(scale > 1.0, 1.0, scale)  # NaN survives, as torch.clamp(max=1)
        pid = tl.program_id(0)
        if pid == 0:
            tl.store(norm_ptr, norm)
            if HAS_FOUND_INF:
                if (norm != norm) | (norm > 3.4028234663852886e38):
                    tl.store(found_inf_ptr, 1.0)
        if scale != 1.0:
            # reverse order, as clip_norm._scale_kernel: the chunks pass 1 read last come first
            mt.walk_chunk(
                table_ptr, num_chunks, num_chunks - 1 - pid, tl.zeros([BLOCK], dtype=tl.float32),
                scale, 0.0, _scale_block, CHUNK, BLOCK, ALIGNED,
            )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _launch_sumsq(grads: List[Tensor], chunk_size: int = mt.DEFAULT_CHUNK, block_size: int = mt.DEFAULT_BLOCK) -> Tensor:
    device = grads[0].device
    info = mt.chunk_table(grads, chunk_size)
    if info.num_chunks == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    partials = torch.empty(info.num_chunks, dtype=torch.float32, device=device)
    with mt.device_guard(device):
        _sumsq_kernel[(info.num_chunks,)](
            info.table, partials, info.num_chunks,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=mt.NUM_WARPS,
        )
    return partials.sum()


def _launch_scale(
    grads: List[Tensor],
    sumsq: Tensor,
    max_norm_tensor: Optional[Tensor],
    max_norm: float,
    eps: float,
    found_inf: Optional[Tensor],
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> Tensor:
    info = mt.chunk_table(grads, chunk_size)
    if info.num_chunks == 0:  # nothing here to scale: the norm alone, as the reference has it
        limit = max_norm_tensor if max_norm_tensor is not None else max_norm
        return clip_grad_norm_from_sumsq_reference([], sumsq, limit, eps, found_inf)
    device = grads[0].device
    norm = torch.empty((), dtype=torch.float32, device=device)
    with mt.device_guard(device):
        _scale_by_sumsq_kernel[(info.num_chunks,)](
            info.table, info.num_chunks, sumsq,
            max_norm_tensor if max_norm_tensor is not None else norm, max_norm, eps,
            norm, found_inf if found_inf is not None else norm,
            MAX_NORM_IS_TENSOR=max_norm_tensor is not None,
            HAS_FOUND_INF=found_inf is not None,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=mt.NUM_WARPS,
        )
    return norm


def _check_sumsq(sumsq, device: Optional[torch.device], fn_name: str) -> None:
    if not isinstance(sumsq, Tensor) or sumsq.numel() != 1 or sumsq.dtype != torch.float32:
        raise TypeError(f"{fn_name}: sumsq must be a one-element float32 tensor (grad_sumsq's result)")
    if device is not None and sumsq.device != device:
        raise ValueError(f"{fn_name}: sumsq is on {sumsq.device} but the gradients are on {device}")


def grad_sumsq_triton(
    grads: Sequence[Tensor], *, chunk_size: int = mt.DEFAULT_CHUNK, block_size: int = mt.DEFAULT_BLOCK
) -> Tensor:
    """:func:`grad_sumsq` through the Triton kernels directly (CUDA, or CPU under the interpreter)."""
    grads = mt.as_grad_list(grads, "grad_sumsq_triton")
    mt.check_sizes(chunk_size, block_size)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    mt.check_launch_device(grads[0].device, "grad_sumsq_triton")
    mt.check_kernel_grads(grads, "grad_sumsq_triton")
    return _launch_sumsq(grads, chunk_size, block_size)


def clip_grad_norm_from_sumsq_triton(
    grads: Sequence[Tensor],
    sumsq: Tensor,
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
    *,
    chunk_size: int = mt.DEFAULT_CHUNK,
    block_size: int = mt.DEFAULT_BLOCK,
) -> Tensor:
    """:func:`clip_grad_norm_from_sumsq_` through the Triton kernel directly."""
    grads = mt.as_grad_list(grads, "clip_grad_norm_from_sumsq_triton")
    device = mt.result_device(grads, sumsq)
    _check_sumsq(sumsq, device, "clip_grad_norm_from_sumsq_triton")
    mt.check_found_inf(found_inf, device, "clip_grad_norm_from_sumsq_triton")
    _check_max_norm(max_norm, device)
    mt.check_sizes(chunk_size, block_size)
    is_tensor = isinstance(max_norm, Tensor)
    if not grads:
        return clip_grad_norm_from_sumsq_reference([], sumsq, max_norm, eps, found_inf)
    mt.check_launch_device(device, "clip_grad_norm_from_sumsq_triton")
    mt.check_kernel_grads(grads, "clip_grad_norm_from_sumsq_triton")
    return _launch_scale(
        grads, sumsq, max_norm if is_tensor else None, 0.0 if is_tensor else float(max_norm), float(eps),
        found_inf, chunk_size, block_size,
    )


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------
def grad_sumsq_reference(grads: Sequence[Tensor]) -> Tensor:
    """Plain PyTorch :func:`grad_sumsq`: the fp32 sum of squares of every element."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # torch's multi-tensor norm (one op for the list; fp16/bf16 reduced in fp32), squared back
    narrow = [g for g in grads if g.dtype != torch.float64]
    norms = list(torch._foreach_norm(narrow, 2, dtype=torch.float32)) if narrow else []
    norms += [torch.linalg.vector_norm(g).float() for g in grads if g.dtype == torch.float64]
    return torch.stack(norms).square().sum()


def clip_grad_norm_from_sumsq_reference(
    grads: Sequence[Tensor],
    sumsq: Tensor,
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
) -> Tensor:
    """Plain PyTorch :func:`clip_grad_norm_from_sumsq_` (no host read)."""
    norm = sumsq.detach().reshape(()).float().sqrt()
    return scale_to_norm_reference([g for g in grads if g.numel()], norm, max_norm, eps, found_inf)


# --------------------------------------------------------------------------------------------
# Custom ops: references on the CPU, Triton on CUDA where it can run
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fasttrain::grad_sumsq", mutates_args=())
def _grad_sumsq_op(grads: List[Tensor]) -> Tensor:
    return grad_sumsq_reference(grads).to(grads[0].device)


@_grad_sumsq_op.register_fake
def _grad_sumsq_fake(grads):
    return grads[0].new_empty((), dtype=torch.float32)


@_grad_sumsq_op.register_kernel("cuda")
def _grad_sumsq_cuda(grads):
    if mt.triton_can_clip(grads):
        return _launch_sumsq(grads)
    if mt.triton_targets(grads[0].device):
        mt.warn_fallback_once("grad_sumsq")
    return grad_sumsq_reference(grads).to(grads[0].device)


@torch.library.custom_op("fasttrain::clip_grad_norm_from_sumsq", mutates_args=("grads", "found_inf"))
def _clip_from_sumsq_op(
    grads: List[Tensor],
    sumsq: Tensor,
    max_norm_tensor: Optional[Tensor],
    max_norm: float,
    eps: float,
    found_inf: Optional[Tensor],
) -> Tensor:
    limit = max_norm_tensor if max_norm_tensor is not None else max_norm
    return clip_grad_norm_from_sumsq_reference(grads, sumsq, limit, eps, found_inf)


@_clip_from_sumsq_op.register_fake
def _clip_from_sumsq_fake(grads, sumsq, max_norm_tensor, max_norm, eps, found_inf):
    return sumsq.new_empty((), dtype=torch.float32)


@_clip_from_sumsq_op.register_kernel("cuda")
def _clip_from_sumsq_cuda(grads, sumsq, max_norm_tensor, max_norm, eps, found_inf):
    if grads and mt.triton_can_clip(grads):
        return _launch_scale(grads, sumsq, max_norm_tensor, max_norm, eps, found_inf)
    if grads and mt.triton_targets(grads[0].device):
        mt.warn_fallback_once("clip_grad_norm_from_sumsq_")
    limit = max_norm_tensor if max_norm_tensor is not None else max_norm
    return clip_grad_norm_from_sumsq_reference(grads, sumsq, limit, eps, found_inf)


def grad_sumsq(grads: Union[Tensor, Sequence[Tensor]], device: Union[str, torch.device, None] = None) -> Tensor:
    """The sum of squares of every element of ``grads``, accumulated in fp32, as a 0-dim fp32
    tensor on their device (on ``device`` for an empty list, the CPU by default). Empty tensors
    count zero. The first half of :func:`clip_grad_norm_` for gradients whose sum must be added
    up over processes before the norm is known."""
    grads = mt.as_grad_list(grads, "grad_sumsq")
    if not any(g.numel() for g in grads):
        where = grads[0].device if grads else torch.device(device or "cpu")
        return torch.zeros((), dtype=torch.float32, device=where)
    return _grad_sumsq_op(grads)


def clip_grad_norm_from_sumsq_(
    grads: Union[Tensor, Sequence[Tensor]],
    sumsq: Tensor,
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
) -> Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (sqrt(sumsq) + eps))`` and return
    ``sqrt(sumsq)`` (0-dim fp32), the norm before clipping.

    ``sumsq`` is the one-element fp32 sum of squares of the whole gradient (over every process,
    after the caller's all-reduce of :func:`grad_sumsq`). ``max_norm`` and ``found_inf`` are as
    in :func:`clip_grad_norm_`: the flag is raised when the norm is not finite, on every process
    alike since they all see the same sum. Traceable by ``torch.compile(fullgraph=True)``.
    """
    grads = mt.as_grad_list(grads, "clip_grad_norm_from_sumsq_")
    device = sumsq.device if isinstance(sumsq, Tensor) else None
    _check_sumsq(sumsq, grads[0].device if grads else None, "clip_grad_norm_from_sumsq_")
    mt.check_found_inf(found_inf, device, "clip_grad_norm_from_sumsq_")
    _check_max_norm(max_norm, device)
    if isinstance(max_norm, Tensor):
        return _clip_from_sumsq_op(grads, sumsq, max_norm, 0.0, float(eps), found_inf)
    return _clip_from_sumsq_op(grads, sumsq, None, float(max_norm), float(eps), found_inf)
