"""Clipping and the non-finite check on FSDP2-sharded gradients: two gloo processes on the CPU.

One ``torchrun --nproc_per_node 2`` launch of ``tests/dist/fsdp_clip_worker.py`` runs every
scenario while one plain process computes the single-process references (twice the batch); both
save their results, which the tests below compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "fsdp_clip_worker.py"
sys.path.insert(0, str(WORKER.parent))

import fsdp_clip_worker as W  # noqa: E402
from launching import launch_env, run_two_and_one  # noqa: E402

pytestmark = pytest.mark.multiprocess

LAUNCH_TIMEOUT_S = 240
# two processes vs one: the same fp32 sums in other orders (reduce-scatter, shard-wise sums of
# squares), through 12 Adam updates: observed <= 3e-7 relative
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_clip")
    return run_two_and_one(WORKER, out, launch_env(ACCELERATE_USE_CPU="1"), LAUNCH_TIMEOUT_S)


def _ranks(results, key):
    return results["rank0_world2"][key], results["rank1_world2"][key]


# ------------------------------------------------------------------- the clipper on its own
NORM_CASES = ["fsdp", "fsdp_no_bite", "fsdp_value", "ignored", "hsdp", "bf16", "compiled"]


@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_equals_torch_on_the_unsharded_gradients(results, case):
    """fasttrain's clipper on FSDP2's sharded gradients reports the norm that torch's
    clip_grad_norm_ computes over the whole gradients in one process, and leaves the same clipped
    gradients; on both processes. Covers uneven and empty shards, a parameter FSDP ignores
    (a plain tensor, counted once), HSDP's (replicate, shard) mesh (not counted per replica) and
    the clipper compiled with torch.compile(fullgraph=True); bf16 gradients (here through the
    kernels' PyTorch reference, on the GPU through the Triton kernels)."""
    for run in _ranks(results, f"norm/{case}"):
        # fp32: the same squares summed in another grouping. bf16: the clipped values are
        # rounded to bf16 once (one ulp, 2**-7 relative)
        rtol = 8e-3 if case == "bf16" else 1e-6
        torch.testing.assert_close(run["norm"], run["reference_norm"], rtol=1e-6, atol=0)
        for name, grad in run["grads"].items():
            assert grad.dtype == run["before"][name].dtype
            torch.testing.assert_close(grad, run["reference_grads"][name], rtol=rtol, atol=1e-9, msg=lambda m: f"{name}: {m}")
    rank0, rank1 = _ranks(results, f"norm/{case}")
    assert torch.equal(rank0["norm"], rank1["norm"])


def test_norm_cases_cover_what_they_claim(results):
    fsdp, ignored, hsdp = (results["rank0_world2"][f"norm/{c}"] for c in ("fsdp", "ignored", "hsdp"))
    assert all(g.dtype == torch.bfloat16 for g in results["rank0_world2"]["norm/bf16"]["grads"].values())
    assert set(fsdp["placements"]) == {"(Shard(dim=0),)"} and fsdp["group_size"] == 2
    assert ignored["placements"][-1] == "plain"
    assert set(hsdp["placements"]) == {"(Replicate(), Shard(dim=0))"} and hsdp["group_size"] == 1
    # the thresholds bite (and the no-bite case leaves the gradients exactly as they were)
    assert fsdp["reference_norm"] > 0.05
    changed = [not torch.equal(fsdp["grads"][n], fsdp["before"][n]) for n in fsdp["grads"]]
    assert all(changed)
    no_bite = results["rank0_world2"]["norm/fsdp_no_bite"]
    assert all(torch.equal(no_bite["grads"][n], no_bite["before"][n]) for n in no_bite["grads"])


def test_value_only_clips_the_shards_without_communication(results):
    for run in _ranks(results, "norm/value_only"):
        assert run["norm"] is None and run["comm_counts"] == {}
        for name, grad in run["grads"].items():
            assert torch.equal(grad, run["reference_grads"][name]), name


@pytest.mark.parametrize("case", ["fsdp", "fsdp_value", "ignored", "hsdp", "bf16"])
def test_one_collective_per_clip(results, case):
    for run in _ranks(results, f"norm/{case}"):
        assert run["comm_counts"] == {"c10d.allreduce_": 1}


def test_compiled_clip_is_one_graph_with_the_collective(results):
    for run in _ranks(results, "norm/compiled"):
        # fullgraph=True: one graph, traced once and reused by the second update
        assert run["comm_counts"]["graphs"] == 1
        assert run["comm_counts"]["collectives_in_graph"] == ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"]


@pytest.mark.parametrize("case", ["check", "value"])
def test_flag_raised_on_every_process_when_one_shard_is_not_finite(results, case):
    """Only process 1's shard holds the infinite value; the flag is raised on both."""
    assert [run["found_inf"] for run in _ranks(results, f"flag/{case}")] == [1.0, 1.0]


def test_layouts_one_all_reduce_cannot_serve_raise_a_clear_error(results):
    layouts = results["rank0_world2"]["layouts"]
    assert layouts["two_shard_dims"][0] == "raised" and "sharded over 2 mesh dimensions" in layouts["two_shard_dims"][1]
    assert "one dimension (FSDP2's fully_shard, HSDP)" in layouts["two_shard_dims"][1]
    assert layouts["partial"][0] == "raised" and "Partial" in layouts["partial"][1]
    assert layouts["two_groups"][0] == "raised" and "different process groups" in layouts["two_groups"][1]
    # replicated DTensors: every process holds the whole gradient (norm of ones(4) = 2)
    assert layouts["replicated_only"] == ("accepted", pytest.approx(2.0))
    assert layouts["deferred"][0] == "raised" and "mesh dimensions" in layouts["deferred"][1]


# ------------------------------------------------------------------- training through the Trainer
@pytest.mark.parametrize("name", list(W.TRAIN_CASES))
def test_fsdp2_training_with_clipping_equals_one_process(results, name):
    """Trainer(accelerator_kwargs={"fsdp_plugin": FSDP2}) with clipping by norm and/or value,
    with and without accumulation: the same weights and gradient norms as one process taking
    twice the batch."""
    rank0, rank1 = _ranks(results, f"train/{name}")
    reference = results["rank0_world1"][f"train/{name}"]
    assert rank0["sharded"] and rank1["sharded"] and not reference["sharded"]
    assert rank0["num_updates"] == rank1["num_updates"] == reference["num_updates"] == 12 // W.TRAIN_CASES[name]["k"]
    for param, value in rank0["weights"].items():
        assert torch.equal(value, rank1["weights"][param]), param
        torch.testing.assert_close(value, reference["weights"][param], rtol=RTOL, atol=ATOL, msg=lambda m: f"{param}: {m}")
    assert rank0["grad_norms"] == rank1["grad_norms"]
    assert rank0["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)
    if "gradient_clip_norm" in W.TRAIN_CASES[name]:
        assert len(reference["grad_norms"]) == reference["num_updates"]
        assert min(reference["grad_norms"]) > W.TRAIN_CASES[name]["gradient_clip_norm"]  # it bites


@pytest.mark.parametrize("name", ["norm_k2", "value_k2"])
def test_clipping_changes_the_result(results, name):
    clipped = results["rank0_world1"][f"train/{name}"]["weights"]
    plain = results["rank0_world1"]["train/plain_k1"]["weights"]
    assert any(not torch.allclose(clipped[p], plain[p], rtol=1e-3) for p in plain)


@pytest.mark.parametrize("case", ["skip", "skip_value", "skip_fused"])
def test_nonfinite_skip_agrees_across_processes(results, case):
    """An infinite gradient on process 1 only: both processes skip that update (the flag goes
    with the clip's all-reduce) and end with the weights of one process that skipped it.
    Clipping by norm (the flag follows from the global sum of squares), by value (the flag the
    value kernel raised on one process is what is reduced) and no clipping with a fused AdamW
    (which reads the flag in its kernel)."""
    rank0, rank1 = _ranks(results, case)
    reference = results["rank0_world1"][case]
    assert rank0["skipped_updates"] == rank1["skipped_updates"] == reference["skipped_updates"] == 1
    for param, value in rank0["weights"].items():
        torch.testing.assert_close(value, reference["weights"][param], rtol=RTOL, atol=ATOL, msg=lambda m: f"{param}: {m}")
    if rank0["grad_norms"]:  # clipping by norm: the norm is the global one on both, inf at the skip
        assert rank0["grad_norms"][W.SKIP_AT_UPDATE - 1] == rank1["grad_norms"][W.SKIP_AT_UPDATE - 1] == float("inf")


def test_clipping_adds_exactly_one_all_reduce_per_update(results):
    """Counted over a whole run: clipping adds one all-reduce per update and nothing else to
    FSDP2's own collectives (all-gather and reduce-scatter)."""
    for rank in (0, 1):
        clip = results[f"rank{rank}_world2"]["count/clip"]
        plain = results[f"rank{rank}_world2"]["count/plain"]
        assert clip["num_updates"] == plain["num_updates"] == 12
        extra = {op: clip["comm_counts"].get(op, 0) - plain["comm_counts"].get(op, 0)
                 for op in set(clip["comm_counts"]) | set(plain["comm_counts"])}
        assert {op: n for op, n in extra.items() if n} == {"c10d.allreduce_": 12}
        assert plain["comm_counts"]["c10d._reduce_scatter_base_"] == 12  # FSDP2 ran
