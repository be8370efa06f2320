"""What the kernels share: device checks, the chunk table, and the device-side walk over it.

The multi-tensor kernels (``clip_norm``, ``clip_norm_sharded``, ``clip_value``) launch one program
per chunk of one gradient. A host-built table, cached by the tensors' addresses, sizes and dtypes,
maps a program id to the chunk's address, length and dtype code; :func:`walk_chunk` reads one
table entry and walks that chunk block by block, calling the kernel's block function on each
block. So every kernel gets the same loop: full blocks load without a mask (16-byte vector loads
when the table says every chunk is aligned), and only a chunk's tail pays for a mask.

``masked_restore`` copies bytes rather than walking values, so it has its own walk; it shares the
table cache (:func:`cached_table`) and the holders that keep a captured graph's tables alive.
``loss_accum`` uses only the device checks.
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
except ImportError:  # the reference paths need only torch
    triton = None
    tl = None
    JITFunction = None

DEFAULT_CHUNK = 32768  # elements per program: ~4k programs for GPT-2 124M, enough waves on H100
DEFAULT_BLOCK = 4096  # elements per loop step: 16 per thread with 8 warps (4 x 16-byte fp32 loads)
NUM_WARPS = 8
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TABLE_CACHE_SIZE = 32


# --------------------------------------------------------------------------------------------
# Device side: one chunk, block by block
# --------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _walk_range(
        ptr, n, acc, a, b, BLOCK_FN: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
    ):
        # Full blocks load without a mask and, when every chunk starts 16-byte aligned, with a
        # divisibility hint, so the compiler emits 16-byte vector loads (and stores, where the
        # block function stores unmasked); only a chunk's tail pays for a mask. The hint sits on
        # the pointers because one on the table entry is not carried through the int->pointer
        # cast. The trip count is a constant (CHUNK / BLOCK; steps past the end cost one scalar
        # compare) because some interpreter versions (triton 3.6 with NumPy 2.4) cannot loop to a
        # bound known only at run time.
        offs = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            if start + BLOCK <= n:
                p = ptr + start + offs
                if ALIGNED:
                    p = tl.multiple_of(p, 16)
                x = tl.load(p).to(tl.float32)
                acc = BLOCK_FN(p, x, offs < BLOCK, acc, a, b, False)
            elif start < n:
                idx = start + offs
                inside = idx < n
                x = tl.load(ptr + idx, mask=inside, other=0.0).to(tl.float32)
                acc = BLOCK_FN(ptr + idx, x, inside, acc, a, b, True)
        return acc

    @triton.jit
    def walk_chunk(
        table_ptr,
        num_chunks,
        chunk,
        acc,
        a,
        b,
        BLOCK_FN: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        """Apply ``BLOCK_FN(p, x, inside, acc, a, b, MASKED)`` to every block of chunk ``chunk``.

        ``p`` are the block's pointers (typed by the chunk's dtype), ``x`` its values in fp32
        (0 outside the chunk), ``inside`` the lanes within the chunk (all of them unless
        ``MASKED``, the chunk's tail block), ``acc`` a per-lane accumulator the block function
        returns updated (start value and dtype are the caller's), ``a`` and ``b`` two scalars for
        the block function. Returns the final accumulator.
        """
        addr = tl.load(table_ptr + chunk)
        n = tl.load(table_ptr + num_chunks + chunk).to(tl.int32)
        code = tl.load(table_ptr + 2 * num_chunks + chunk)
        # `code` is uniform across the program, so the branch costs no divergence.
        if code == 0:
            acc = _walk_range(addr.to(tl.pointer_type(tl.float32)), n, acc, a, b, BLOCK_FN, CHUNK, BLOCK, ALIGNED)
        elif code == 1:
            acc = _walk_range(addr.to(tl.pointer_type(tl.float16)), n, acc, a, b, BLOCK_FN, CHUNK, BLOCK, ALIGNED)
        else:
            acc = _walk_range(addr.to(tl.pointer_type(tl.bfloat16)), n, acc, a, b, BLOCK_FN, CHUNK, BLOCK, ALIGNED)
        return acc

    # Triton picks compiled or interpreted kernels when `@triton.jit` runs, reading
    # TRITON_INTERPRET then. Its own library functions (tl.sum, tl.zeros) were decorated when
    # triton was imported; if the variable changed in between, kernels cannot run at all.
    _INTERPRETED = not isinstance(walk_chunk, JITFunction)
    _MODE_CONSISTENT = _INTERPRETED == (not isinstance(tl.sum, JITFunction))
else:
    _INTERPRETED = False
    _MODE_CONSISTENT = True


# --------------------------------------------------------------------------------------------
# Where the kernels can run
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
def triton_targets(device: torch.device) -> bool:
    """True when the custom ops run the compiled kernels on ``device`` (decided once per device:
    Triton's NVIDIA backend needs compute capability 7.0 or newer)."""
    if triton is None or _INTERPRETED or not _MODE_CONSISTENT or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (7, 0)


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Gradient lists
# --------------------------------------------------------------------------------------------
def is_dense(t: Tensor) -> bool:
    """True when ``t`` covers one gap-free block of memory (contiguous, channels_last, ...).

    The kernels are elementwise and order-free, so such a tensor can be walked as a flat array.
    """
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
    if not grads or not triton_targets(grads[0].device):
        return False
    for g in grads:
        if g.numel() and (g.dtype not in DTYPE_CODES or not is_dense(g)):
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
    return as_tensor_list(grads, fn_name, "grads", "gradients", "clip", floating=True)


def as_tensor_list(
    tensors: Union[Tensor, Sequence[Tensor]],
    fn_name: str,
    name: str = "tensors",
    noun: str = "tensors",
    verb: str = "save",
    floating: bool = False,
) -> List[Tensor]:
    """Validate a tensor list (one device; floating dtypes if ``floating``) and return it as a
    list; errors call the argument ``name`` and its items ``noun``, and advise to ``verb`` each
    device's separately."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn_name}: {name}[{i}] is {type(t).__name__}, expected a Tensor")
        if floating and not t.is_floating_point():
            raise TypeError(f"{fn_name}: {name}[{i}] has dtype {t.dtype}; {noun} must be floating")
        if t.device != tensors[0].device:
            raise ValueError(
                f"{fn_name}: all {noun} must be on one device, got {tensors[0].device} "
                f"({name}[0]) and {t.device} ({name}[{i}]); {verb} each device's {noun} separately"
            )
    return tensors


def check_kernel_grads(grads: Sequence[Tensor], fn_name: str) -> None:
    """What the ``*_triton`` launchers accept beyond :func:`as_grad_list`: fp32/fp16/bf16, dense."""
    for i, g in enumerate(grads):
        if g.numel() and g.dtype not in DTYPE_CODES:
            raise TypeError(f"{fn_name}: grads[{i}] is {g.dtype}; kernels take fp32/fp16/bf16")
        if g.numel() and not is_dense(g):
            raise ValueError(f"{fn_name}: grads[{i}] is not dense in memory; pass .contiguous()")


def check_found_inf(found_inf: Optional[Tensor], device: Optional[torch.device], fn_name: str) -> None:
    if found_inf is None:
        return
    if not isinstance(found_inf, Tensor) or found_inf.dtype != torch.float32 or found_inf.numel() != 1:
        raise TypeError(f"{fn_name}: found_inf must be a float32 tensor of shape (1,)")
    if device is not None and found_inf.device != device:
        raise ValueError(
            f"{fn_name}: found_inf is on {found_inf.device} but the gradients are on {device}"
        )


def check_sizes(chunk_size: int, block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if chunk_size < block_size or chunk_size % block_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of block_size ({block_size})")


def result_device(grads: Sequence[Tensor], *others) -> torch.device:
    """The gradients' device, else that of the first tensor among ``others``, else the CPU."""
    if grads:
        return grads[0].device
    for t in others:
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# The chunk table
# --------------------------------------------------------------------------------------------
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


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph now (no table can be copied
    to the device then). Looked up at each call, so that host stand-ins for capture can say yes."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def prepare_chunk_tables(grads: Sequence[Tensor], chunk: int = DEFAULT_CHUNK) -> Optional[ChunkTable]:
    """Build (or refresh in the cache) the table the fused kernels will use for ``grads``, where
    they run on these tensors; returns it, or None where the reference path runs instead.

    A CUDA graph capture cannot copy a new table to the device, so whoever captures a step that
    clips calls this first: the capture then finds the table cached even after the cache evicted
    it (another model's tables, or a graph dropped with the tables it held)."""
    grads = [g for g in grads if g is not None]
    if not triton_can_clip(grads):
        return None
    return chunk_table(grads, chunk)


def chunk_table(grads: Sequence[Tensor], chunk: int) -> ChunkTable:
    """Build (or fetch from a small LRU cache) the chunk table for ``grads``.

    The key holds exactly what the table encodes (address, size, dtype per tensor), so a hit is
    always valid, even when the tensors were freed and others took their memory.
    """
    device = grads[0].device
    key = ("grads", device, chunk, tuple((g.data_ptr(), g.numel(), g.dtype) for g in grads))

    def rows():
        addrs: List[int] = []
        sizes: List[int] = []
        codes: List[int] = []
        aligned = True
        for g in grads:
            n = g.numel()
            if n == 0:
                continue
            base, itemsize, code = g.data_ptr(), g.element_size(), DTYPE_CODES[g.dtype]
            aligned = aligned and base % 16 == 0
            for start in range(0, n, chunk):
                addrs.append(base + start * itemsize)
                sizes.append(min(chunk, n - start))
                codes.append(code)
        return [addrs, sizes, codes], aligned

    return cached_table(key, device, rows, "fused clipping: the gradient table")


def cached_table(key: tuple, device: torch.device, rows, what: str) -> ChunkTable:
    """The table cached under ``key``, else one built from ``rows()`` (a list of equally long
    int lists, one table row each, and whether every chunk is 16-byte aligned) and cached.

    ``key`` must determine the rows, so that a hit is always valid. Every kernel's tables share
    the cache and the holders of :func:`hold_chunk_tables`; ``what`` names the table in the error
    raised when it is missing during a CUDA graph capture.
    """
    entry = _TABLE_CACHE.get(key)
    if entry is not None:
        _TABLE_CACHE.move_to_end(key)
        return _held(entry)
    if capturing(device):
        raise RuntimeError(
            f"{what} for these tensors is not built yet and cannot be copied to the device during "
            "CUDA graph capture; run one step before capturing"
        )
    values, aligned = rows()
    table = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the stream without a host sync.
        table = table.pin_memory().to(device, non_blocking=True)
    entry = ChunkTable(table, len(values[0]), aligned)
    _TABLE_CACHE[key] = entry
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        # only the cache's reference goes: a table a graph uses is also in its holder's list
        _TABLE_CACHE.popitem(last=False)
    return _held(entry)
