"""Checkpoints of an FSDP2-sharded Trainer on two processes; launched by tests/test_fsdp_checkpoint.py.

``ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 fsdp_ckpt_worker.py OUT``

``OUT/single.pt`` is a checkpoint a single process wrote before the launch. Every process
writes ``OUT/rank{rank}.pt``: the whole weights and optimizer states (gathered from the shards
with ``DTensor.full_tensor``) after each scenario, and the errors the refusal scenarios raised.
One launch runs every scenario: starting the processes is the slow part.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import SaveTrainingStateCallback
from fasttrain.schedulers import CosineLrScheduler

NUM_SAMPLES, PER_DEVICE_BATCH, ACCUMULATION = 64, 4, 3


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(NUM_SAMPLES, 8, generator=generator), torch.randn(NUM_SAMPLES, 4, generator=generator))


def build_model() -> torch.nn.Module:
    # dropout: the per-process random streams must come back too for a resume to be exact
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))


def make_trainer(seed: int, callbacks=(), sharded: bool = True) -> Trainer:
    torch.manual_seed(seed)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)} if sharded else None
    return Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=list(callbacks), engine="eager", accelerator_kwargs=kwargs)


def train(trainer: Trainer, num_epochs: int, resume_from=None) -> None:
    trainer.train(
        dataset(),
        num_epochs=num_epochs,
        per_device_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1),
        train_dataloader_kwargs={"shuffle": True},
        resume_from=resume_from,
    )


@contextlib.contextmanager
def _fsdp2_no_sync(accelerator, model):
    # what accelerate's no_sync does when its state says FSDP2
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def _sync_every_micro_step(accelerator, model):
    yield


GRADIENT_SYNC = {"no_sync": _fsdp2_no_sync, "every_micro_step": _sync_every_micro_step}


@contextlib.contextmanager
def patched(owner, name, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def snapshot(trainer: Trainer) -> dict:
    """Whole weights by name and optimizer states in the order of the optimizer's parameters
    (every process takes part in the gathers)."""
    model = trainer.get_model(keep_torch_compile=False)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    states = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            states.append({k: _whole(v) for k, v in sorted(optimizer.state.get(p, {}).items())})
    return {
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "weights": {name: _whole(p) for name, p in model.named_parameters()},
        "optimizer": states,
        "lr": [float(g["lr"]) for g in optimizer.param_groups],
        "num_updates": trainer.num_updates,
    }


def error_of(fn) -> dict:
    try:
        fn()
    except Exception as e:  # recorded for the test to check: type and message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    barrier = torch.distributed.barrier

    # a single process's checkpoint loaded into a sharded model (after it was prepared)
    trainer = make_trainer(seed=11)
    train(trainer, num_epochs=1)
    trainer.load_checkpoint(str(out / "single.pt"))
    results["loaded_single"] = snapshot(trainer)

    # a sharded run's consolidated checkpoint, read by a single process in the test
    trainer = make_trainer(seed=12)
    train(trainer, num_epochs=1)
    # after an evaluation the root module (the only FSDP2 group here) holds its parameters
    # unsharded, as plain tensors, yet its state dict is sharded: still a sharded save
    trainer.evaluate(dataset(), per_device_batch_size=PER_DEVICE_BATCH)
    trainer.save_checkpoint(str(out / "from_fsdp.pt"))
    trainer.save_checkpoint(str(out / "from_fsdp.safetensors"), save_optimizer=False, save_scheduler=False)
    results["saved_full"] = snapshot(trainer)

    # step-exact resume from sharded training states (DCP). 8 batches per epoch and process in
    # windows of 3: states after batch 4 and 12 are inside a window, the one after batch 8 at the
    # end of epoch 1. Inside a window FSDP2 holds the gradients unsharded (no_sync: one
    # reduce-scatter per update) or, reduce-scattered at every micro-step, as shards
    for mode, no_sync in GRADIENT_SYNC.items():
        states = out / f"states_{mode}"
        with patched(Accelerator, "no_sync", no_sync):
            trainer = make_trainer(
                seed=13, callbacks=[SaveTrainingStateCallback(str(states), save_every_n_steps=4, save_at_end=False)]
            )
            train(trainer, num_epochs=2)
            results[f"{mode}/uninterrupted"] = snapshot(trainer)
            for name in ("step_4", "step_8", "step_12"):
                resumed = make_trainer(seed=14)
                train(resumed, num_epochs=2, resume_from=str(states / name))
                results[f"{mode}/resumed_{name}"] = snapshot(resumed)

    # damaged sharded states are refused on every process
    damaged = {
        "missing_shard": lambda d: (d / "dcp" / "__1_0.distcp").unlink(),
        "truncated_shard": lambda d: os.truncate(d / "dcp" / "__0_0.distcp", 100),
        "flipped_byte_rank1_shard": lambda d: _flip_last_byte(d / "dcp" / "__1_0.distcp"),
        "missing_dcp_metadata": lambda d: (d / "dcp" / ".metadata").unlink(),
        "no_manifest": lambda d: (d / "manifest.json").unlink(),
    }
    for name, damage in damaged.items():
        if rank == 0:
            shutil.rmtree(out / name, ignore_errors=True)  # left by an earlier launch
            shutil.copytree(out / "states_no_sync" / "step_4", out / name)
            damage(out / name)
        barrier()
        results[f"refused/{name}"] = error_of(lambda: trainer.load_training_state(str(out / name)))
    results["after_refusals"] = snapshot(trainer)

    torch.save(results, out / f"rank{rank}.pt")
    barrier()
    # an explicit end of the process group: gloo's threads are then joined before the
    # interpreter exits
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:
        traceback.print_exc()
        raise

