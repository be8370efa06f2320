"""Two gloo processes with DDP or FSDP2 (through accelerate) against one lightning.Trainer
process: the two processes' batches of 4 together are the reference's batch of 8, so the weights,
the step count and the process-averaged validation loss must agree. The set-up hooks of the first
run already see the launch's ranks, and ``prepare_data`` runs on local rank 0 only."""

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from launching import LaunchGroup, finish, free_port, launch_env, start, torchrun_two  # noqa: E402
from lightning_modules import QUIET, assert_same_weights, classification_data, loader  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_lightning_process(tmp_path, strategy):
    launch = start(torchrun_two(HERE / "lightning" / "ddp_worker.py", tmp_path, strategy), tmp_path / "launch.log",
                   launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, time.monotonic() + 300, "the two processes", retry_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    from ddp_worker import SyncedClassifier

    torch.manual_seed(0)
    reference = SyncedClassifier()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, **QUIET)
    trainer.fit(reference, loader(classification_data(), batch_size=8), loader(classification_data(n=16, seed=1), 8))
    for rank, result in enumerate(ranks):
        assert result["world_size"] == 2
        # as in Lightning: the process group exists before the first hooks of the first run
        expected = (2, rank, rank, rank == 0)
        assert result["seen"]["setup"] == expected
        assert result["seen"]["configure_model"] == expected
        # prepare_data_per_node=True (the default): local rank 0 of the node only
        assert result["seen"].get("prepare_data") == (expected if rank == 0 else None)
        assert result["sharded"] == (strategy == "fsdp")  # strategy="fsdp" really shards (FSDP2)
        assert result["global_step"] == trainer.global_step == 6
        ours = reference.__class__()
        ours.load_state_dict(result["state_dict"])
        assert_same_weights(reference, ours, atol=1e-6)
        assert result["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]), abs=1e-6)
        assert result["validated"][0]["val_loss"] == pytest.approx(result["val_loss"], abs=1e-6)


def test_two_ddp_processes_in_bf16_mixed_hand_on_outputs_and_train_as_one_lightning_process(tmp_path):
    """Under DDP the step runs through the process wrapper's forward, under the run's autocast,
    and its outputs are handed on in the dtypes it computed them in, as Lightning does."""
    launch = start(torchrun_two(HERE / "lightning" / "ddp_worker.py", tmp_path, "ddp", 1, "bf16-mixed"),
                   tmp_path / "launch.log", launch_env(ACCELERATE_USE_CPU="1"))
    finish(launch, time.monotonic() + 300, "the two processes", retry_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    from ddp_worker import HandsOnLogits

    torch.manual_seed(0)
    reference = HandsOnLogits()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed",
                        **QUIET)
    trainer.fit(reference, loader(classification_data(), batch_size=8), loader(classification_data(n=16, seed=1), 8))
    assert reference.handed and set(reference.handed) == {(torch.float32, torch.bfloat16)}
    for result in ranks:
        assert result["handed"] == reference.handed
        assert result["global_step"] == trainer.global_step == 6
        ours = HandsOnLogits()
        ours.load_state_dict(result["state_dict"])
        # bf16 rounds each process's half-batch apart from the whole batch: a few bf16 steps apart
        assert_same_weights(reference, ours, atol=2e-2)


def _reference():
    from ddp_worker import SyncedClassifier

    torch.manual_seed(0)
    reference = SyncedClassifier()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, **QUIET)
    trainer.fit(reference, loader(classification_data(), batch_size=8), loader(classification_data(n=16, seed=1), 8))
    return trainer, reference


def test_two_nodes_through_torchrun_match_one_lightning_process(tmp_path):
    # two torchrun launches of one process each, as two nodes of one process: num_nodes=2
    port = free_port()
    with LaunchGroup() as group:
        launches = [
            group.start(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                 "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                 str(HERE / "lightning" / "ddp_worker.py"), str(tmp_path), "ddp", "2"],
                tmp_path / f"node{node}.log", launch_env(ACCELERATE_USE_CPU="1"),
            )
            for node in (0, 1)
        ]
        for node, launch in enumerate(launches):
            finish(launch, time.monotonic() + 300, f"node {node}")
    trainer, reference = _reference()
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert (result["world_size"], result["num_nodes"], result["node_rank"]) == (2, 2, rank)
        assert result["device_ids"] == [0]  # one device on each node
        # prepare_data_per_node=True: local rank 0 of every node prepares
        assert result["seen"]["prepare_data"] == (2, rank, 0, rank == 0)
        assert result["global_step"] == trainer.global_step == 6
        ours = reference.__class__()
        ours.load_state_dict(result["state_dict"])
        assert_same_weights(reference, ours, atol=1e-6)


def test_devices_that_do_not_match_the_launch_are_an_error():
    from fasttrain.lightning import Trainer

    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        Trainer(devices=2, max_epochs=1, **QUIET).fit(
            __import__("lightning_modules").Classifier(), loader(classification_data(), batch_size=8)
        )
