"""Compile the multi-tensor kernels for an H100 (sm_90) without a GPU and count their memory ops.

Run as a script (``python tests/kernel_codegen.py``) in a process where ``TRITON_INTERPRET`` is
unset: it prints one JSON object mapping ``<kernel>/aligned`` and ``<kernel>/unaligned`` to the
number of each global load/store instruction in the PTX (``ld.global.v4.b32``: a 16-byte vector
load), and ``copy/<dtype>`` to the same counts for the kernel benchmarks' bandwidth baseline
(benchmarks/kernels/copy_baseline.py). Triton's compiler and its bundled ``ptxas`` run on any
machine; nothing is launched.
"""
import json
import os
import re
import sys

def _variants():
    from fasttrain.kernels import clip_norm, clip_norm_sharded, clip_value

    table = {"table_ptr": "*i64", "num_chunks": "i32"}
    return {
        "sumsq": (clip_norm._sumsq_kernel, {**table, "partial_ptr": "*fp32"}, {}),
        "scale": (clip_norm._scale_kernel, {**table, "scale_ptr": "*fp32"}, {}),
        "scale_by_sumsq": (
            clip_norm_sharded._scale_by_sumsq_kernel,
            {**table, "sumsq_ptr": "*fp32", "max_norm_ptr": "*fp32", "max_norm_value": "fp32", "eps": "fp32",
             "norm_ptr": "*fp32", "found_inf_ptr": "*fp32"},
            {"MAX_NORM_IS_TENSOR": True, "HAS_FOUND_INF": True},
        ),
        "clamp": (
            clip_value._clamp_kernel,
            {**table, "lo": "fp32", "hi": "fp32", "found_inf_ptr": "*fp32"},
            {"HAS_FOUND_INF": True},
        ),
    }


def memory_ops(target_arch: int = 90) -> dict:
    """Compiled with fasttrain's launch sizes: DEFAULT_CHUNK, DEFAULT_BLOCK and NUM_WARPS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fasttrain.kernels._multi_tensor import DEFAULT_BLOCK, DEFAULT_CHUNK, NUM_WARPS

    target = GPUTarget("cuda", target_arch, 32)
    result = {}
    for name, (fn, args, flags) in _variants().items():
        for aligned in (True, False):
            constexprs = {**flags, "CHUNK": DEFAULT_CHUNK, "BLOCK": DEFAULT_BLOCK, "ALIGNED": aligned}
            # the signature lists every parameter in order, constexprs included
            names = list(fn.arg_names)
            signature = {n: ("constexpr" if n in constexprs else args[n]) for n in names}
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                target=target,
                options={"num_warps": NUM_WARPS},
            )
            counts = {}
            for op in re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*", compiled.asm["ptx"]):
                counts[op] = counts.get(op, 0) + 1
            result[f"{name}/{'aligned' if aligned else 'unaligned'}"] = counts
    result.update(copy_baseline_ops(target))
    return result


def copy_baseline_ops(target) -> dict:
    """The benchmarks' copy kernel, typed by its pointers: one compile per dtype. Its pointer
    arguments carry the 16-byte divisibility Triton's launcher gives every 16-byte aligned tensor
    (all of the caching allocator's)."""
    import triton
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "kernels"))
    import copy_baseline
    from fasttrain.kernels._multi_tensor import DEFAULT_BLOCK, DEFAULT_CHUNK, NUM_WARPS

    result = {}
    for dtype in ("fp32", "bf16"):
        compiled = triton.compile(
            ASTSource(
                fn=copy_baseline._copy_kernel,
                signature={"src": f"*{dtype}", "dst": f"*{dtype}", "n": "i64", "CHUNK": "constexpr", "BLOCK": "constexpr"},
                constexprs={"CHUNK": DEFAULT_CHUNK, "BLOCK": DEFAULT_BLOCK},
                attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
            ),
            target=target,
            options={"num_warps": NUM_WARPS},
        )
        result[f"copy/{dtype}"] = _count(compiled.asm["ptx"])
    return result


def _count(ptx: str) -> dict:
    counts = {}
    for op in re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx):
        counts[op] = counts.get(op, 0) + 1
    return counts


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_codegen.py compiles the kernels: run it with TRITON_INTERPRET unset")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's own default; silences its notice
    print(json.dumps(memory_ops()))
