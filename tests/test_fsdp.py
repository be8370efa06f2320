"""FSDP2 on two gloo processes against one process at twice the batch; a bad launch.

Launches run side by side, once for the module: ``torchrun --nproc_per_node 2`` of
``tests/dist/fsdp_worker.py`` with ``ACCELERATE_USE_CPU=1`` (FSDP2 through accelerate's own
preparation, as on GPUs), one plain process of it (the references), and meanwhile two short ones:
``torchrun --nproc_per_node 2`` without ``ACCELERATE_USE_CPU`` and without GPUs, which accelerate
takes for one process in each (that launch must fail in both processes, quickly), then
``accelerate launch --config_file`` with an FSDP2 configuration.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from launching import RESULT_NAMES, launch_env, torchrun_two  # noqa: E402
from launching import LaunchGroup  # noqa: E402
from launching import finish as _succeed, free_port as _free_port, wait as _wait  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "fsdp_worker.py"

pytestmark = pytest.mark.multiprocess

LAUNCH_TIMEOUT_S = 240
BAD_LAUNCH_TIMEOUT_S = 90
# two processes against one: sums reduced in another order (all-reduce of shards, mean over
# processes), through 8 AdamW updates, fp32
RTOL, ATOL = 1e-5, 1e-6
CASES = ("k1", "k2", "k2_compiled")
# what docs/distributed.md shows, for two processes
FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_reshard_after_forward: true
"""


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = launch_env()
    # a compile cache of this module's own, empty at the start: the second compiled launch
    # below starts warm from what the first wrote, as a user's second run does
    cpu_env = dict(env, ACCELERATE_USE_CPU="1", TORCHINDUCTOR_CACHE_DIR=str(out / "inductor-cache"))
    # no ACCELERATE_USE_CPU, no GPU: what accelerate does not recognise as a launch
    bad_env = {k: v for k, v in env.items() if k != "ACCELERATE_USE_CPU"}
    bad_env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    with LaunchGroup() as group:
        multi = group.start(torchrun_two(WORKER, str(out)), out / "two_processes.log", cpu_env)
        single = group.start([sys.executable, str(WORKER), str(out)], out / "one_process.log", cpu_env)
        bad = group.start(torchrun_two(WORKER, "--bad-launch"), out / "bad_launch.log", bad_env)
        bad_code = _wait(bad, start + BAD_LAUNCH_TIMEOUT_S, "the unrecognised launch")
        bad_log = bad.log_path.read_text(errors="replace")
        (out / "fsdp2.yaml").write_text(FSDP2_CONFIG)
        config_launch = group.start(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "fsdp2.yaml"),
             "--main_process_port", str(_free_port()), str(WORKER), "--config-file-launch", str(out)],
            out / "config_file_launch.log",
            cpu_env,
        )
        deadline = start + LAUNCH_TIMEOUT_S
        _succeed(config_launch, deadline, "accelerate launch --config_file fsdp2.yaml", retry_s=LAUNCH_TIMEOUT_S)
        _succeed(single, deadline, "the single-process reference", retry_s=LAUNCH_TIMEOUT_S)
        _succeed(multi, deadline, "torchrun --nproc_per_node 2 (FSDP2)", retry_s=LAUNCH_TIMEOUT_S)
        again = group.start(torchrun_two(WORKER, "--compiled-again", str(out)), out / "compiled_again.log", cpu_env)
        _succeed(again, time.monotonic() + LAUNCH_TIMEOUT_S, "the second compiled launch", retry_s=LAUNCH_TIMEOUT_S)
    loaded = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in RESULT_NAMES}
    print(f"\nFSDP launches: {time.monotonic() - start:.1f}s; scenario times (rank 0): "
          + ", ".join(f"{k} {v:.1f}s" for k, v in loaded["rank0_world2"]["timings"].items()))
    loaded["bad_launch"] = (bad_code, bad_log)
    loaded["compiled_again"] = [torch.load(out / f"compiled_again_rank{r}.pt", weights_only=False) for r in (0, 1)]
    loaded["config_file_launch"] = [
        torch.load(out / f"config_launch_rank{rank}.pt", weights_only=False) for rank in (0, 1)
    ]
    return loaded


def _ranks(launches, key):
    return launches["rank0_world2"][key], launches["rank1_world2"][key]


def _reference(launches, name):
    return launches["rank0_world1"][f"train/{name.replace('_compiled', '')}"]


# ------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("name", CASES)
def test_fsdp2_equals_one_process_at_twice_the_batch(launches, name):
    reference = _reference(launches, name)
    for run in _ranks(launches, f"train/{name}"):
        assert run["model_class"] == "FSDPNet"  # sharded by fully_shard, not DDP
        assert run["num_updates"] == reference["num_updates"] == 8
        assert run["weights"].keys() == reference["weights"].keys()
        for key, value in run["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=RTOL, atol=ATOL, msg=key)
        torch.testing.assert_close(run["train_loss_epoch"], reference["train_loss_epoch"], rtol=RTOL, atol=ATOL)


def test_a_second_train_after_an_evaluation_equals_one_process(launches):
    reference = launches["rank0_world1"]["train_twice"]
    for run in _ranks(launches, "train_twice"):
        for key, value in run["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=RTOL, atol=ATOL, msg=key)


def test_the_clip_threshold_bites(launches):
    """The clipped cases' reference differs from the unclipped one (same batches, same updates)."""
    clipped, plain = _reference(launches, "k2"), _reference(launches, "k1")
    assert any(not torch.allclose(clipped["weights"][k], plain["weights"][k], rtol=1e-3) for k in plain["weights"])


def test_a_warm_compile_cache_gives_the_same_weights(launches):
    """Shard shapes differ between the processes (the 1-row head: 1 and 0 rows); a process
    must not reuse a graph another process compiled for its shapes (fasttrain.engine.compile_cache)."""
    for again, first in zip(launches["compiled_again"], _ranks(launches, "train/k2_compiled")):
        for key, value in again["weights"].items():
            torch.testing.assert_close(value, first["weights"][key], rtol=RTOL, atol=ATOL, msg=key)


def test_compiled_fsdp2_equals_eager_fsdp2(launches):
    for compiled, eager in zip(_ranks(launches, "train/k2_compiled"), _ranks(launches, "train/k2")):
        for key, value in compiled["weights"].items():
            torch.testing.assert_close(value, eager["weights"][key], rtol=RTOL, atol=ATOL, msg=key)
        torch.testing.assert_close(compiled["eval_loss_epoch"], eager["eval_loss_epoch"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", CASES)
def test_every_engine_ran_its_own_steps(launches, name):
    engine = "compiled" if name.endswith("compiled") else "eager"
    for run in _ranks(launches, f"train/{name}"):
        assert run["engines_used"] == {"train": engine, "eval": engine}
        assert run["runtime_warnings"] == []  # no fallback, no recompile warning
        if engine == "compiled":
            # the forward breaks at FSDP2's hooks: several graphs, the blocks' compute among them
            assert run["graphs_compiled"] >= 3
            assert run["graphs_compiled_in_epoch_2"] == 0


@pytest.mark.parametrize("name", CASES)
def test_distributed_type_stays_fsdp_after_train(launches, name):
    """accelerate's later ``AcceleratorState()`` calls copy the distributed type from the
    process-wide PartialState; the FSDP2 switch on CPU processes is written there too."""
    for run in _ranks(launches, f"train/{name}"):
        assert run["distributed_type_at_start"] == run["distributed_type"] == "DistributedType.FSDP"
        assert run["state_distributed_type"] == "DistributedType.FSDP"


def test_a_later_trainer_without_the_plugin_is_not_sharded(launches):
    for run in _ranks(launches, "later_trainer"):
        assert run == {"distributed_type": "DistributedType.MULTI_CPU", "model_class": "DistributedDataParallel"}


# ------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("name", CASES)
def test_eval_loss_is_the_mean_over_the_padded_eval_batches(launches, name):
    """The forward all-gathers, so both processes run the same number of eval batches: 13
    samples become 16 (the first three again). The reported loss is the mean of the final
    model's per-sample losses over exactly the samples the processes evaluated."""
    rank0, rank1 = _ranks(launches, f"train/{name}")
    per_epoch = len(rank0["eval_indices"]) // 2
    assert per_epoch == len(rank1["eval_indices"]) // 2 == 8
    last = rank0["eval_indices"][per_epoch:] + rank1["eval_indices"][per_epoch:]
    assert sorted(set(last)) == list(range(13)) and len(last) == 16
    expected = rank0["eval_per_sample"][last].mean().item()
    for run in (rank0, rank1):
        assert run["eval_loss_epoch"][-1] == pytest.approx(expected, rel=1e-5)
    exact = _reference(launches, name)["eval_per_sample"].mean().item()
    assert _reference(launches, name)["eval_loss_epoch"][-1] == pytest.approx(exact, rel=1e-5)


# ------------------------------------------------------------------------------------ engines
def test_cudagraph_engine_falls_back_to_compiled_once_saying_why(launches):
    for run in _ranks(launches, "cudagraph"):
        assert run["engines_used"] == {"train": "compiled", "eval": "compiled"}
        assert len(run["warnings"]) == 1
        assert "FSDP2 steps are not captured" in run["warnings"][0]
        assert "falls back to the 'compiled' engine" in run["warnings"][0]


# ------------------------------------------------------------------------------------ DDP options
def test_ddp_kwargs_reach_ddp(launches):
    reference = _reference(launches, "k1")
    for run in _ranks(launches, "ddp_kwargs"):
        assert (run["model_class"], run["static_graph"], run["gradient_as_bucket_view"]) == (
            "DistributedDataParallel", True, True
        )
        for key, value in run["weights"].items():
            torch.testing.assert_close(value, reference["weights"][key], rtol=RTOL, atol=ATOL, msg=key)
        assert "static_graph=True) cannot train with gradient_accumulation_steps=2" in run["accumulation_error"]


# ------------------------------------------------------------------------------------ collectives
@pytest.mark.parametrize("k", [1, 2, 4])
def test_ddp_all_reduces_the_gradients_once_per_update(launches, k):
    for run in _ranks(launches, f"comm/ddp/k{k}"):
        assert run["updates"] == 4 // k and run["micro_steps"] == 4
        # one bucket (a small model): one all-reduce of every gradient per update
        assert run["calls"]["allreduce"] == run["updates"]
        assert run["bytes"]["allreduce"] == run["updates"] * run["parameter_bytes"]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fsdp2_gathers_per_micro_step_and_reduce_scatters_per_update(launches, k):
    for run in _ranks(launches, f"comm/fsdp2/k{k}"):
        groups = run["fsdp_groups"]  # the two blocks and the root
        assert groups == 3 and run["updates"] == 4 // k and run["micro_steps"] == 4
        assert "allreduce" not in run["calls"]  # no clipping here: nothing else is reduced
        # gradient sync is off on the micro-steps that do not update: one reduce-scatter per
        # group and update, of the group's whole (padded) gradient
        assert run["calls"]["_reduce_scatter_base"] == groups * run["updates"]
        assert run["bytes"]["_reduce_scatter_base"] == run["updates"] * 872  # 836 bytes + row padding
        # every micro-step: each group gathered for the forward, the blocks again for the
        # backward (the root is not resharded after its forward); each process sends its half
        assert run["calls"]["_allgather_base"] == run["micro_steps"] * (2 * groups - 1)
        assert run["bytes"]["_allgather_base"] == run["micro_steps"] * (872 + 576) // 2


# ------------------------------------------------------------------------------------ launch
def test_a_launch_accelerate_did_not_recognise_fails_in_every_process(launches):
    code, log = launches["bad_launch"]
    assert code != 0, log[-3000:]
    assert log.count("REFUSED: WORLD_SIZE=2") == 2, log[-3000:]
    assert "ACCELERATE_USE_CPU=1" in log and "accelerate launch --cpu" in log
    assert "ACCEPTED" not in log


def test_an_fsdp2_config_file_shards_each_block(launches):
    for run in launches["config_file_launch"]:
        assert run["world"] == 2 and run["distributed_type"] == "DistributedType.FSDP"
        assert run["sharded_modules"] == ["FSDPBlock", "FSDPBlock", "FSDPNet"]
        assert run["num_updates"] == 4


def test_example_trains_sharded(launches):
    for run in _ranks(launches, "example"):
        assert run["distributed_type"] == "DistributedType.FSDP"
        assert run["num_updates"] == 8  # 128 samples, batch 8 x 2 processes x 2 micro-steps, 2 epochs
        assert run["eval_loss_epoch"][-1] < run["eval_loss_epoch"][0]
    rank0, rank1 = _ranks(launches, "example")
    assert rank0["eval_loss_epoch"] == rank1["eval_loss_epoch"]
