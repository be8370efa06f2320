"""The clipping kernels' machine code, compiled for an H100 (sm_90) on any machine.

Their speed rests on the memory traffic their docstrings state: one read of the table entry per
program, full blocks moved with 16-byte vector instructions when every chunk is aligned, masked
scalar instructions only in a chunk's tail, and no store where the kernel has nothing to write.
These tests read that off the PTX that Triton's compiler produces (tests/kernel_codegen.py);
nothing is launched, so they run without a GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from fasttrain.kernels._multi_tensor import DEFAULT_BLOCK as BLOCK  # noqa: E402
from fasttrain.kernels._multi_tensor import DTYPE_CODES, NUM_WARPS  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "kernel_codegen.py"  # compiles with DEFAULT_BLOCK and NUM_WARPS


def _vector_ops_per_thread() -> int:
    # a full block is BLOCK / (32 * NUM_WARPS) elements per thread, moved 16 bytes at a time,
    # once in each dtype branch of the walk
    per_thread = BLOCK // (32 * NUM_WARPS)
    return sum(per_thread * torch.empty((), dtype=dt).element_size() // 16 for dt in DTYPE_CODES)


@pytest.fixture(scope="module")
def ops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"compiling the kernels for sm_90 failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


KERNELS = ["sumsq", "scale", "scale_by_sumsq", "clamp"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_aligned_full_blocks_load_16_bytes_at_a_time(ops, kernel):
    aligned, unaligned = ops[f"{kernel}/aligned"], ops[f"{kernel}/unaligned"]
    assert _vector_ops_per_thread() == 8  # 4 for fp32, 2 for fp16, 2 for bf16
    assert aligned.get("ld.global.v4.b32", 0) == _vector_ops_per_thread()
    # without the alignment promise the compiler may not vectorize: the table's flag is what does it
    assert unaligned.get("ld.global.v4.b32", 0) == 0
    # the masked tail block loads one element per instruction, in each dtype branch
    per_thread = BLOCK // (32 * NUM_WARPS)
    assert aligned.get("ld.global.b16", 0) == 2 * per_thread
    assert unaligned.get("ld.global.b16", 0) == 2 * 2 * per_thread


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_table_entry_read_per_program(ops, kernel):
    # address, length and dtype code: three 8-byte loads, whatever the chunk's dtype
    for variant in ("aligned", "unaligned"):
        assert ops[f"{kernel}/{variant}"].get("ld.global.b64", 0) == 3


@pytest.mark.parametrize("kernel", ["scale", "scale_by_sumsq"])
def test_scaling_stores_full_blocks_16_bytes_at_a_time(ops, kernel):
    assert ops[f"{kernel}/aligned"].get("st.global.v4.b32", 0) == _vector_ops_per_thread()
    assert ops[f"{kernel}/unaligned"].get("st.global.v4.b32", 0) == 0


def test_sum_of_squares_writes_one_partial_per_program(ops):
    for variant in ("aligned", "unaligned"):
        stores = {op: n for op, n in ops[f"sumsq/{variant}"].items() if op.startswith("st.")}
        assert stores == {"st.global.b32": 1}


def test_clamp_stores_only_lanes_that_change(ops):
    # the store is masked by "this lane changed", so it cannot be a whole-vector store: a step in
    # which nothing exceeds the limit writes nothing
    clamp = ops["clamp/aligned"]
    assert clamp.get("st.global.v4.b32", 0) == 0
    assert clamp.get("st.global.b16", 0) > 0 and clamp.get("st.global.b32", 0) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bandwidth_baseline_moves_full_blocks_16_bytes_at_a_time_like_the_kernels(ops, dtype):
    # benchmarks/kernels/copy_baseline.py: "% of copy bandwidth" divides by this kernel's
    # figure, so it must move its bytes as the kernels do, bf16 as well as fp32
    copy = ops[f"copy/{'fp32' if dtype == torch.float32 else 'bf16'}"]
    per_thread = BLOCK // (32 * NUM_WARPS)
    vectors = per_thread * torch.empty((), dtype=dtype).element_size() // 16
    assert copy.get("ld.global.v4.b32", 0) == copy.get("st.global.v4.b32", 0) == vectors
    scalar = "b32" if dtype == torch.float32 else "b16"
    # only the masked tail moves one element per instruction
    assert copy.get(f"ld.global.{scalar}", 0) == copy.get(f"st.global.{scalar}", 0) == per_thread
