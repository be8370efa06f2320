"""The bandwidth baseline of the kernel benchmarks: a copy launched and timed as the kernels are.

The fused kernels are Triton programs that each walk ``DEFAULT_CHUNK`` elements of one tensor,
``DEFAULT_BLOCK`` at a time with ``NUM_WARPS`` warps, moving full blocks with 16-byte vector
instructions. This kernel copies a flat tensor with the same plan (the same constants, the same
unmasked full blocks and masked tail), so "% of copy bandwidth" compares like with like: both
sides are kernels on the SMs, captured in a CUDA graph and counted as bytes read + written.

torch's ``copy_`` of a contiguous tensor is not such a kernel but a ``cudaMemcpyAsync``: on the
first H200 run it measured 2.77 TB/s where the clipping kernels read at 4.2 TB/s, so the kernels
showed up to 152% of "copy bandwidth". The benchmarks still show it, beside this baseline.
"""
import torch
import triton
import triton.language as tl

from fasttrain.kernels._multi_tensor import DEFAULT_BLOCK, DEFAULT_CHUNK, NUM_WARPS


@triton.jit
def _copy_kernel(src, dst, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    # a constant trip count, as in the kernels' walk (see _multi_tensor._walk_range)
    for start in range(0, CHUNK, BLOCK):
        first = base + start
        if first + BLOCK <= n:
            tl.store(dst + first + offs, tl.load(src + first + offs))
        elif first < n:
            idx = first + offs
            inside = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=inside), mask=inside)


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous tensors of one dtype and size, as one Triton launch."""
    if dst.dtype != src.dtype or dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_baseline.copy: dst and src must be contiguous, of one dtype and size")
    n = src.numel()
    if n == 0:
        return
    _copy_kernel[(triton.cdiv(n, DEFAULT_CHUNK),)](
        src, dst, n, CHUNK=DEFAULT_CHUNK, BLOCK=DEFAULT_BLOCK, num_warps=NUM_WARPS
    )
