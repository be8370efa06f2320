"""Checkpoints and training states of an FSDP2-sharded Trainer (two gloo processes on the CPU).

One ``torchrun --nproc_per_node 2`` launch runs ``tests/dist/fsdp_ckpt_worker.py``; this process
writes the single-process checkpoint the launch loads before it starts, and reads the sharded
run's consolidated checkpoint after it ends. Every comparison is exact: a checkpoint moves values,
it computes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from fasttrain import checkpoint_sharded, checkpointing
from fasttrain.progress import TrainProgress

REPO = Path(__file__).resolve().parents[1]
DIST = REPO / "tests" / "dist"
sys.path.insert(0, str(DIST))

import fsdp_ckpt_worker as worker  # noqa: E402
from launching import finish, launch_env, start, torchrun_two  # noqa: E402

pytestmark = pytest.mark.multiprocess

LAUNCH_TIMEOUT_S = 180
DAMAGES = ("missing_shard", "truncated_shard", "flipped_byte_rank1_shard", "missing_dcp_metadata", "no_manifest")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_checkpoint")
    single = worker.make_trainer(seed=10, sharded=False)
    worker.train(single, num_epochs=1)
    single.save_checkpoint(str(out / "single.pt"))

    started = time.monotonic()
    launch = start(torchrun_two(DIST / "fsdp_ckpt_worker.py", out), out / "launch.log", launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, started + LAUNCH_TIMEOUT_S, "the FSDP2 checkpoint launch", retry_s=LAUNCH_TIMEOUT_S)
    print(f"\nFSDP2 checkpoint launch: {time.monotonic() - started:.1f}s")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return types.SimpleNamespace(out=out, ranks=ranks)


def _assert_same_state(got: dict, expected: dict) -> None:
    """Weights and optimizer states equal bit for bit."""
    assert got["weights"].keys() == expected["weights"].keys()
    for name, value in expected["weights"].items():
        assert torch.equal(got["weights"][name], value), name
    assert len(got["optimizer"]) == len(expected["optimizer"])
    for i, (a, b) in enumerate(zip(got["optimizer"], expected["optimizer"])):
        assert a.keys() == b.keys(), i
        for key in b:
            assert torch.equal(a[key], b[key]), (i, key)


# ------------------------------------------------------------------------------ consolidated
def test_a_single_process_checkpoint_loads_into_a_sharded_run_exactly(run):
    single = torch.load(run.out / "single.pt", weights_only=True)
    expected = {
        "weights": single["model_state_dict"],
        "optimizer": [dict(sorted(single["optimizer_state_dict"]["state"][i].items())) for i in range(4)],
    }
    for rank in run.ranks:
        loaded = rank["loaded_single"]
        assert loaded["sharded"]  # the shards of an FSDP2 model were filled, not a whole copy
        _assert_same_state(loaded, expected)


def test_a_sharded_run_writes_one_whole_checkpoint_that_one_process_loads_exactly(run):
    saved = run.ranks[0]["saved_full"]
    assert saved["sharded"]
    checkpoint = torch.load(run.out / "from_fsdp.pt", weights_only=True)
    # the format a single process writes: whole tensors, the optimizer's parameters by number
    assert {k: tuple(v.shape) for k, v in checkpoint["model_state_dict"].items()} == {
        "0.weight": (16, 8), "0.bias": (16,), "3.weight": (4, 16), "3.bias": (4,),
    }
    assert checkpoint["optimizer_state_dict"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sorted(checkpoint["optimizer_state_dict"]["state"]) == [0, 1, 2, 3]
    assert "scheduler_state_dict" in checkpoint

    trainer = worker.make_trainer(seed=99, sharded=False)
    trainer.load_checkpoint(str(run.out / "from_fsdp.pt"), load_scheduler=False)  # no train() yet: no scheduler
    optimizer = trainer.optimizer
    loaded = {
        "weights": {name: p.detach() for name, p in trainer.model.named_parameters()},
        "optimizer": [dict(sorted(optimizer.state[p].items())) for p in optimizer.param_groups[0]["params"]],
    }
    _assert_same_state(loaded, saved)
    # and a plain torch optimizer takes the optimizer state as it is
    torch.optim.AdamW(worker.build_model().parameters()).load_state_dict(checkpoint["optimizer_state_dict"])


def test_a_sharded_run_writes_whole_weights_to_safetensors(run):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weights = safetensors_torch.load_file(run.out / "from_fsdp.safetensors")
    expected = run.ranks[0]["saved_full"]["weights"]
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


# ------------------------------------------------------------------------------ DCP states
@pytest.mark.parametrize("mode", ["no_sync", "every_micro_step"])
@pytest.mark.parametrize("state", ["step_4", "step_8", "step_12"])
def test_resuming_a_sharded_training_state_equals_the_uninterrupted_run(run, state, mode):
    """Saved by SaveTrainingStateCallback every 4 batches (accumulation 3, shuffled data,
    dropout, a warm-up and cosine schedule): inside a window of epoch 1 and of epoch 2, and
    after the last batch of epoch 1; with FSDP2's gradient reduction once per update
    (``no_sync``) and at every micro-step."""
    for rank in run.ranks:
        uninterrupted, resumed = rank[f"{mode}/uninterrupted"], rank[f"{mode}/resumed_{state}"]
        assert resumed["sharded"] and resumed["num_updates"] == uninterrupted["num_updates"] == 6
        assert resumed["lr"] == uninterrupted["lr"]
        _assert_same_state(resumed, uninterrupted)


def test_a_sharded_training_state_lists_every_shard_in_its_manifest(run):
    state = run.out / "states_no_sync" / "step_4"
    files = json.loads((state / "manifest.json").read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng_state_0.pt", "rng_state_1.pt"} <= set(files)
    assert "model.pt" not in files and "optimizer.pt" not in files  # the shards hold them
    assert checkpointing.verify_training_state(state)["files"] == files
    metadata = torch.load(state / "trainer_state.pt", weights_only=True)
    assert metadata["sharded"] == {"format": "torch.distributed.checkpoint", "dir": "dcp", "optimizer_state": True}
    assert (metadata["current_epoch"], metadata["phase"], metadata["step_in_epoch"]) == (1, "mid_epoch", 4)
    # no staging folder is left beside the states
    assert sorted(p.name for p in (run.out / "states_no_sync").iterdir()) == ["step_12", "step_16", "step_4", "step_8"]


def test_a_state_inside_an_accumulation_window_holds_each_process_s_gradients(run):
    """With no_sync FSDP2 keeps the gradients of a window unsharded and not yet reduce-scattered:
    each process's file holds whole-parameter sums of its own micro-steps, which differ. Reduced
    at every micro-step, they are the processes' gradient shards."""
    whole = {"0.weight": (16, 8), "0.bias": (16,), "3.weight": (4, 16), "3.bias": (4,)}
    halves = {"0.weight": (8, 8), "0.bias": (8,), "3.weight": (2, 16), "3.bias": (2,)}
    for mode, unsharded, sharded in (("no_sync", whole, {}), ("every_micro_step", {}, halves)):
        inside = run.out / f"states_{mode}" / "step_4"
        grads = [torch.load(inside / f"grads_{r}.pt", weights_only=True) for r in (0, 1)]
        for g in grads:
            assert {k: tuple(v.shape) for k, v in g["unsharded"].items()} == unsharded, mode
            assert {k: tuple(v.shape) for k, v in g["sharded"].items()} == sharded, mode
            assert g["plain"] == {}
        part = "unsharded" if unsharded else "sharded"
        assert not torch.equal(grads[0][part]["0.weight"], grads[1][part]["0.weight"])
        files = json.loads((inside / "manifest.json").read_text())["files"]
        assert {"grads_0.pt", "grads_1.pt"} <= set(files)
        # at the end of an epoch the last update has applied every gradient
        assert not any(name.startswith("grads_") for name in os.listdir(run.out / f"states_{mode}" / "step_8"))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_sharded_state_is_refused_on_every_process(run, damage):
    errors = [rank[f"refused/{damage}"] for rank in run.ranks]
    assert [e["type"] for e in errors] == ["CheckpointError", "CheckpointError"]
    if damage == "flipped_byte_rank1_shard":
        # process 1 hashes its own shard and says what is wrong; process 0 is told it failed
        assert "dcp/__1_0.distcp does not match its SHA-256" in errors[1]["message"]
        assert "failed on another process" in errors[0]["message"]
    # a refused load changes nothing
    for rank in run.ranks:
        _assert_same_state(rank["after_refusals"], rank["every_micro_step/uninterrupted"])


def test_a_damaged_state_is_skipped_by_find_latest(run):
    for damage in DAMAGES:
        with pytest.raises(checkpointing.CheckpointError):
            checkpointing.verify_training_state(run.out / damage)


def test_a_sharded_state_is_not_loaded_by_another_number_of_processes(run):
    trainer = worker.make_trainer(seed=5, sharded=False)
    with pytest.raises(checkpointing.CheckpointError, match="saved by 2 processes"):
        trainer.load_training_state(str(run.out / "states_no_sync" / "step_4"))


# ------------------------------------------------------------------------------ refusals
def test_fsdp1_is_refused_with_a_pointer_to_fsdp2(tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 cannot be built on a CPU-only machine; the refusal looks at the module's type only
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    model = torch.nn.Sequential()
    model.add_module("wrapped", fsdp1)
    accelerator = types.SimpleNamespace(
        num_processes=1, process_index=0, is_main_process=True, is_local_main_process=True, wait_for_everyone=lambda: None
    )
    trainer = types.SimpleNamespace(
        get_model=lambda keep_torch_compile=True: model, _accelerator=accelerator, progress=TrainProgress()
    )
    torch.save({"model_state_dict": {}}, tmp_path / "any.pt")
    calls = {
        "save_checkpoint": lambda: checkpointing.save_checkpoint(trainer, tmp_path / "ckpt.pt", None, True, True, True),
        "load_checkpoint": lambda: checkpointing.load_checkpoint(trainer, tmp_path / "any.pt", True, True),
        "save_training_state": lambda: checkpointing.save_training_state(trainer, tmp_path / "state"),
    }
    for what, call in calls.items():
        with pytest.raises(checkpointing.CheckpointError, match="fsdp_version=2"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["any.pt"]


@pytest.mark.parametrize("stage, processes, refused", [(3, 1, True), (2, 2, True), (1, 2, True), (2, 1, False), (0, 2, False)])
def test_partitioned_deepspeed_states_are_refused(stage, processes, refused):
    from accelerate.utils import DistributedType

    accelerator = types.SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED,
        num_processes=processes,
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=stage)),
    )
    model = torch.nn.Linear(2, 2)
    trainer = types.SimpleNamespace(get_model=lambda keep_torch_compile=True: model, _accelerator=accelerator)
    if refused:
        with pytest.raises(checkpointing.CheckpointError, match="accelerator.save_state"):
            checkpoint_sharded.is_sharded(trainer)
    else:
        assert checkpoint_sharded.is_sharded(trainer) is False


def test_an_optimizer_state_for_other_parameters_is_refused():
    ids = {"0.weight": 0, "0.bias": 1}
    state = {"state": {0: {}, 5: {}}, "param_groups": [{"lr": 0.1, "params": [0, 5]}]}
    with pytest.raises(checkpointing.CheckpointError, match="load_optimizer=False"):
        checkpoint_sharded._to_names(state, ids)
    assert checkpoint_sharded._to_names({"state": {1: {"a": 1}}, "param_groups": [{"params": [0, 1]}]}, ids) == {
        "state": {"0.bias": {"a": 1}},
        "param_groups": [{"params": ["0.weight", "0.bias"]}],
    }


def test_optimizer_parameters_are_numbered_by_the_names_torch_gives_them():
    """torch's state-dict helpers leave wrappers such as a block compiled with
    torch.compile(block) out of the names; the numbering follows the optimizer's groups."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0] = torch.compile(model[0])
    optimizer = torch.optim.SGD([{"params": model[1].parameters()}, {"params": model[0].parameters()}], lr=0.1)
    assert checkpoint_sharded._parameter_ids(model, optimizer) == {"1.weight": 0, "1.bias": 1, "0.weight": 2, "0.bias": 3}
    with pytest.raises(checkpointing.CheckpointError, match="not one of the model's"):
        checkpoint_sharded._parameter_ids(torch.nn.Linear(2, 2), optimizer)
