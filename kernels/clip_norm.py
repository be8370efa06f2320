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
CUDA graph capture so the capture finds it cached, and capture inside :func:`hold_chunk_tables`
so the graph keeps the tables it points at).

This module also holds the multi-tensor machinery that ``clip_value`` reuses.
"""
import collections
import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # the reference path below needs only torch
    triton = None
    tl = None
    JITFunction = None

__all__ = [
    "clip_grad_norm_",
    "clip_grad_norm_reference",
    "clip_grad_norm_triton",
    "hold_chunk_tables",
    "triton_available",
    "triton_interpreted",
]

DEFAULT_CHUNK = 32768  # elements per program: ~4k programs for GPT-2 124M, enough waves on H100
DEFAULT_BLOCK = 4096  # elements per loop step: 16 per thread with 8 warps (4 x 16-byte fp32 loads)
_NUM_WARPS = 8
_FINALIZE_BLOCK = 1024
_TABLE_CACHE_SIZE = 32
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sumsq_range(ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        # Full blocks load without a mask and, when every chunk starts 16-byte aligned, with a
        # divisibility hint, so the compiler emits 16-byte vector loads; only a chunk's tail
        # pays for a mask. The hint sits on the pointers because one on the table entry is not
        # carried through the int->pointer cast. The trip count is a constant (CHUNK / BLOCK;
        # steps past the end cost one scalar compare) because some interpreter versions
        # (triton 3.6 with NumPy 2.4) cannot loop to a bound known only at run time.
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, CHUNK, BLOCK):
            if start + BLOCK <= n:
                p = ptr + start + offs
                if ALIGNED:
                    p = tl.multiple_of(p, 16)
                x = tl.load(p).to(tl.float32)
                acc += x * x
            elif start < n:
                idx = start + offs
                x = tl.load(ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
                acc += x * x
        return acc

    @triton.jit
    def _sumsq_kernel(
        table_ptr, partial_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        pid = tl.program_id(0)
        addr = tl.load(table_ptr + pid)
        n = tl.load(table_ptr + num_chunks + pid).to(tl.int32)
        code = tl.load(table_ptr + 2 * num_chunks + pid)
        # `code` is uniform across the program, so the branch costs no divergence.
        if code == 0:
            acc = _sumsq_range(addr.to(tl.pointer_type(tl.float32)), n, CHUNK, BLOCK, ALIGNED)
        elif code == 1:
            acc = _sumsq_range(addr.to(tl.pointer_type(tl.float16)), n, CHUNK, BLOCK, ALIGNED)
        else:
            acc = _sumsq_range(addr.to(tl.pointer_type(tl.bfloat16)), n, CHUNK, BLOCK, ALIGNED)
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
        # reason as in _sumsq_range; rounding keeps the number of compiled variants small.
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
    def _scale_range(ptr, n, scale, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            if start + BLOCK <= n:
                p = ptr + start + offs
                if ALIGNED:
                    p = tl.multiple_of(p, 16)
                x = tl.load(p).to(tl.float32)
                tl.store(p, (x * scale).to(ptr.dtype.element_ty))
            elif start < n:
                idx = start + offs
                mask = idx < n
                x = tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)
                tl.store(ptr + idx, (x * scale).to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_kernel(
        table_ptr, num_chunks, scale_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        scale = tl.load(scale_ptr)
        if scale != 1.0:
            # Walk the chunks in reverse: the last ones pass 1 read are likely still in L2.
            pid = num_chunks - 1 - tl.program_id(0)
            addr = tl.load(table_ptr + pid)
            n = tl.load(table_ptr + num_chunks + pid).to(tl.int32)
            code = tl.load(table_ptr + 2 * num_chunks + pid)
            if code == 0:
                _scale_range(addr.to(tl.pointer_type(tl.float32)), n, scale, CHUNK, BLOCK, ALIGNED)
            elif code == 1:
                _scale_range(addr.to(tl.pointer_type(tl.float16)), n, scale, CHUNK, BLOCK, ALIGNED)
            else:
                _scale_range(addr.to(tl.pointer_type(tl.bfloat16)), n, scale, CHUNK, BLOCK, ALIGNED)

    # Triton picks compiled or interpreted kernels when `@triton.jit` runs, reading
    # TRITON_INTERPRET then. Its own library functions (tl.sum, tl.zeros) were decorated when
    # triton was imported; if the variable changed in between, kernels cannot run at all.
    _INTERPRETED = not isinstance(_sumsq_kernel, JITFunction)
    _MODE_CONSISTENT = _INTERPRETED == (not isinstance(tl.sum, JITFunction))
else:
    _INTERPRETED = False
    _MODE_CONSISTENT = True


# --------------------------------------------------------------------------------------------
# Shared multi-tensor machinery (also used by clip_value)
# --------------------------------------------------------------------------------------------
def triton_available() -> bool:
    """True when triton is importable (the kernels may still need a GPU or the interpreter)."""
    return triton is not None


def triton_interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and _INTERPRETED


def check_launch_device(device: torch.device, fn_name: str) -> None:
    """Raise a clear error when the Triton kernels cannot run on ``device`` in this process."""
    if triton is None:
        raise RuntimeError(f"{fn_name}: triton is not installed; use the reference implementation")
    if not _MODE_CONSISTENT:
        raise RuntimeError(
            f"{fn_name}: TRITON_INTERPRET changed after triton was imported, so the kernels and "
            "triton's own library disagree on interpreted vs compiled. Set it before anything "
            "imports triton (torch._dynamo imports it), e.g. at the top of tests/conftest.py."
        )
    if _INTERPRETED and device.type != "cpu":
        raise RuntimeError(
            f"{fn_name}: TRITON_INTERPRET=1 runs kernels on the host, but the tensors are on "
            f"{device}; unset TRITON_INTERPRET to run the compiled kernels"
        )
    if not _INTERPRETED and device.type != "cuda":
        raise RuntimeError(
            f"{fn_name}: the Triton kernels need CUDA tensors (got {device}); to run them on the "
            "CPU set TRITON_INTERPRET=1 before triton is imported"
        )


@functools.lru_cache(maxsize=None)
def _triton_targets(device: torch.device) -> bool:
    # Decided once per device: Triton's NVIDIA backend needs compute capability 7.0 or newer.
    if triton is None or _INTERPRETED or not _MODE_CONSISTENT or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (7, 0)


def _is_dense(t: Tensor) -> bool:
    # Clipping is elementwise and order-free, so any layout that covers one gap-free block of
    # memory (contiguous, channels_last, ...) can be walked as a flat array.
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def triton_can_clip(grads: Sequence[Tensor]) -> bool:
    """True when the fused kernels handle these grads on their device (else use the reference)."""
    if not grads or not _triton_targets(grads[0].device):
        return False
    for g in grads:
        if g.numel() and (g.dtype not in _DTYPE_CODES or not _is_dense(g)):
            return False
    return True


_warned_fallback = False


def warn_fallback_once(fn_name: str) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"{fn_name}: some gradients are not fp32/fp16/bf16 or not dense in memory, so such "
            "calls use the unfused PyTorch path (correct, but slower)",
            stacklevel=3,
        )


def as_grad_list(grads: Union[Tensor, Sequence[Tensor]], fn_name: str) -> List[Tensor]:
    """Validate a gradient list (one device, floating dtypes) and return it as a list."""
    if isinstance(grads, Tensor):
        grads = [grads]
    grads = list(grads)
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"{fn_name}: grads[{i}] is {type(g).__name__}, expected a Tensor")
        if not g.is_floating_point():
            raise TypeError(f"{fn_name}: grads[{i}] has dtype {g.dtype}; gradients must be floating")
        if g.device != grads[0].device:
            raise ValueError(
                f"{fn_name}: all gradients must be on one device, got {grads[0].device} "
                f"(grads[0]) and {g.device} (grads[{i}]); clip each device's gradients separately"
            )
    return grads


def check_found_inf(found_inf: Optional[Tensor], device: Optional[torch.device], fn_name: str) -> None:
    if found_inf is None:
        return
    if not isinstance(found_inf, Tensor) or found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise TypeError(f"{fn_name}: found_inf must be a float32 tensor of shape (1,)")
    if device is not None and found_inf.device != device:
        raise ValueError(
            f"{fn_name}: found_inf is on {found_inf.device} but the gradients are on {device}"
        )


@dataclass(frozen=True)
class ChunkTable:
    """Device table of chunks: row 0 byte addresses, row 1 lengths, row 2 dtype codes."""

    table: Tensor
    num_chunks: int
    aligned: bool  # every chunk starts on a 16-byte boundary


_TABLE_CACHE: "collections.OrderedDict[tuple, ChunkTable]" = collections.OrderedDict()
#: the lists of :func:`hold_chunk_tables` blocks now open
_HOLDERS: List[List[ChunkTable]] = []


@contextlib.contextmanager
def hold_chunk_tables():
    """Collect every chunk table the kernels use inside the block into the yielded list.

    A CUDA graph captured in the block keeps each table's device address, and the cache below
    keeps only the last few tables: once a table is evicted, its memory returns to the caching
    allocator and a later replay would read whatever was put there. Whoever keeps the graph keeps
    this list with it, so the tables live exactly as long as the graph.
    """
    held: List[ChunkTable] = []
    _HOLDERS.append(held)
    try:
        yield held
    finally:
        _HOLDERS.remove(held)


def _held(entry: ChunkTable) -> ChunkTable:
    for held in _HOLDERS:
        if not any(e is entry for e in held):
            held.append(entry)
    return entry


def chunk_table(grads: Sequence[Tensor], chunk: int) -> ChunkTable:
    """Build (or fetch from a small LRU cache) the chunk table for ``grads``.

    The key holds exactly what the table encodes (address, size, dtype per tensor), so a hit is
    always valid, even when the tensors were freed and others took their memory.
    """
    device = grads[0].device
    key = (device, chunk, tuple((g.data_ptr(), g.numel(), g.dtype) for g in grads))
    entry = _TABLE_CACHE.get(key)
    if entry is not None:
        _TABLE_CACHE.move_to_end(key)
        return _held(entry)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fused clipping: the gradient table for these tensors is not built yet and cannot be "
            "copied to the device during CUDA graph capture; run one step before capturing"
        )
    addrs: List[int] = []
    sizes: List[int] = []
    codes: List[int] = []
    aligned = True
    for g in grads:
        n = g.numel()
        if n == 0:
            continue
        base, itemsize, code = g.data_ptr(), g.element_size(), _DTYPE_CODES[g.dtype]
        aligned = aligned and base % 16 == 0
        for start in range(0, n, chunk):
            addrs.append(base + start * itemsize)
            sizes.append(min(chunk, n - start))
            codes.append(code)
    table = torch.tensor([addrs, sizes, codes], dtype=torch.int64)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the stream without a host sync.
        table = table.pin_memory().to(device, non_blocking=True)
    entry = ChunkTable(table, len(addrs), aligned)
    _TABLE_CACHE[key] = entry
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        # only the cache's reference goes: a table a graph uses is also in its holder's list
        _TABLE_CACHE.popitem(last=False)
    return _held(entry)


def check_sizes(chunk_size: int, block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of block_size ({block_size})")


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the gradients' device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _launch(
    grads: List[Tensor],
    max_norm_tensor: Optional[Tensor],
    max_norm: float,
    eps: float,
    found_inf: Optional[Tensor],
    chunk_size: int = DEFAULT_CHUNK,
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    device = grads[0].device
    norm = torch.empty((), dtype=torch.float32, device=device)
    info = chunk_table(grads, chunk_size)
    if info.num_chunks == 0:
        return norm.zero_()
    partials = torch.empty(info.num_chunks, dtype=torch.float32, device=device)
    scale = torch.empty(1, dtype=torch.float32, device=device)
    grid = (info.num_chunks,)
    with device_guard(device):
        _sumsq_kernel[grid](
            info.table, partials, info.num_chunks,
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=_NUM_WARPS,
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
            CHUNK=chunk_size, BLOCK=block_size, ALIGNED=info.aligned, num_warps=_NUM_WARPS,
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


def _result_device(grads: Sequence[Tensor], *others) -> torch.device:
    if grads:
        return grads[0].device
    for t in others:
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")


def clip_grad_norm_triton(
    grads: Sequence[Tensor],
    max_norm: Union[float, Tensor],
    eps: float = 1e-6,
    found_inf: Optional[Tensor] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    """Run the fused Triton kernels directly (CUDA tensors, or CPU tensors under the interpreter).

    Same contract as :func:`clip_grad_norm_`; ``chunk_size`` / ``block_size`` let tests cover
    multi-chunk tensors and block tails with small shapes.
    """
    grads = as_grad_list(grads, "clip_grad_norm_triton")
    device = _result_device(grads, found_inf, max_norm)
    check_found_inf(found_inf, device, "clip_grad_norm_triton")
    _check_max_norm(max_norm, device)
    check_sizes(chunk_size, block_size)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    check_launch_device(device, "clip_grad_norm_triton")
    for i, g in enumerate(grads):
        if g.numel() and g.dtype not in _DTYPE_CODES:
            raise TypeError(f"clip_grad_norm_triton: grads[{i}] is {g.dtype}; kernels take fp32/fp16/bf16")
        if g.numel() and not _is_dense(g):
            raise ValueError(f"clip_grad_norm_triton: grads[{i}] is not dense in memory; pass .contiguous()")
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
    device = _result_device(grads, found_inf, max_norm)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    # fp16/bf16 norms are reduced in fp32 (torch's own path rounds them to the grad dtype).
    norms = [
        torch.linalg.vector_norm(g, dtype=torch.float32) if g.dtype in (torch.float16, torch.bfloat16)
        else torch.linalg.vector_norm(g).float()
        for g in grads
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    limit = max_norm.detach().reshape(()).float() if isinstance(max_norm, Tensor) else max_norm
    scale = torch.clamp(limit / (total + eps), max=1.0)
    wide = [g for g in grads if g.dtype in (torch.float32, torch.float64)]
    if wide:
        torch._foreach_mul_(wide, scale)
    for g in grads:
        if g.dtype not in (torch.float32, torch.float64):
            g.copy_(g.float().mul_(scale))
    if found_inf is not None:
        found_inf.copy_(torch.where(torch.isfinite(total), found_inf, 1.0))
    return total


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
    if triton_can_clip(grads):
        return _launch(grads, max_norm_tensor, max_norm, eps, found_inf)
    if _triton_targets(grads[0].device):
        warn_fallback_once("clip_grad_norm_")
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
    grads = as_grad_list(grads, "clip_grad_norm_")
    device = _result_device(grads, found_inf, max_norm)
    check_found_inf(found_inf, device, "clip_grad_norm_")
    _check_max_norm(max_norm, device)
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if isinstance(max_norm, Tensor):
        return _clip_grad_norm_op(grads, max_norm, 0.0, float(eps), found_inf)
    return _clip_grad_norm_op(grads, None, float(max_norm), float(eps), found_inf)
