"""Checkpoints and training states: atomic writes, safe loads, step-exact resume.

Two formats, as in pytorch-accelerated:

* a **checkpoint** (:func:`save_checkpoint`) is one ``.pt`` file holding ``model_state_dict``,
  optionally ``optimizer_state_dict`` and ``scheduler_state_dict``, and the caller's extra keys;
* a **training state** (:func:`save_training_state`) is a directory holding everything needed to
  continue a run from the exact step it was saved at: model, optimizer, scheduler, loss scaler,
  accumulated gradients, the random number generator states of every library and process, the
  position in the epoch, the run history and the epoch's loss counters.

Every file is written to a temporary name and renamed into place, and a training state directory
is assembled under a temporary name and swapped in whole, so a crash during a save never replaces
a good checkpoint with a broken one. Files are loaded with ``weights_only=True``: a file carrying
arbitrary pickled objects is refused.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

STATE_VERSION = 1
_METADATA_FILE = "trainer_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint or training state cannot be read."""


# ------------------------------------------------------------------------------- file helpers
def atomic_save(obj, path) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def safe_load(path, map_location="cpu"):
    """``torch.load`` with ``weights_only=True`` and errors that say what went wrong."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"Refusing to load {path}: it contains objects other than tensors and plain Python "
            "values, and loading it could run arbitrary code. If you trust the file, load it "
            "yourself with torch.load(..., weights_only=False) and pass the state dicts on. "
            f"Details: {e}"
        ) from e
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {e}") from e


# ------------------------------------------------------------------------------- checkpoints
def save_checkpoint(trainer, save_path, checkpoint_kwargs, save_optimizer, save_scheduler, save_per_node):
    checkpoint = {"model_state_dict": trainer.get_model(keep_torch_compile=False).state_dict()}
    if save_optimizer:
        checkpoint["optimizer_state_dict"] = trainer.optimizer.state_dict()
    if save_scheduler and trainer.scheduler is not None:
        if hasattr(trainer.scheduler, "state_dict"):
            checkpoint["scheduler_state_dict"] = trainer.scheduler.state_dict()
        else:
            trainer.print("Warning: the scheduler has no state_dict(); it is not saved in the checkpoint.")
    if checkpoint_kwargs is not None:
        checkpoint.update(checkpoint_kwargs)
    accelerator = trainer._accelerator
    accelerator.wait_for_everyone()
    writer = accelerator.is_local_main_process if save_per_node else accelerator.is_main_process
    if writer:
        atomic_save(checkpoint, save_path)
    accelerator.wait_for_everyone()


def load_checkpoint(trainer, checkpoint_path, load_optimizer, load_scheduler):
    trainer._accelerator.wait_for_everyone()
    checkpoint = safe_load(checkpoint_path)
    if "model_state_dict" not in checkpoint:
        raise CheckpointError(
            f"{checkpoint_path} has no 'model_state_dict'; it was not written by save_checkpoint"
        )
    trainer.get_model(keep_torch_compile=False).load_state_dict(checkpoint["model_state_dict"])
    if load_optimizer and "optimizer_state_dict" in checkpoint:
        if trainer.optimizer is None:
            raise ValueError(
                "The checkpoint holds an optimizer state but the trainer has no optimizer; pass "
                "one to the Trainer or call load_checkpoint(..., load_optimizer=False)."
            )
        trainer.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    if load_scheduler and "scheduler_state_dict" in checkpoint:
        if trainer.scheduler is None:
            raise ValueError(
                "The checkpoint holds a scheduler state but the trainer has no scheduler; create "
                "one with create_scheduler_fn or call load_checkpoint(..., load_scheduler=False)."
            )
        trainer.scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
    return checkpoint


# ------------------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict:
    state = {"python": _python_state_to_plain(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(_python_state_from_plain(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype("uint32"),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state_to_plain(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_plain(plain):
    version, internal, gauss = plain
    return (version, tuple(internal), gauss)


# ------------------------------------------------------------------------------- training state
@dataclass
class ResumePosition:
    epoch: int
    step: int  # batches of the epoch already consumed
    epoch_start_rng: dict
    rng: dict
    loss_sum: float
    sample_count: int


def save_training_state(trainer, output_dir, checkpoint_kwargs=None) -> None:
    output_dir = Path(output_dir)
    accelerator = trainer._accelerator
    buffer = getattr(trainer, "_train_buffer", None)
    if buffer is not None and len(buffer):
        # SYNC: a checkpoint save is a flush point, so the saved loss counters are complete
        trainer._flush(buffer, is_epoch_end=False)
    rank = accelerator.process_index
    staging = output_dir.with_name(f".{output_dir.name}.staging")
    if accelerator.is_main_process:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        atomic_save(trainer.get_model(keep_torch_compile=False).state_dict(), staging / "model.pt")
        atomic_save(trainer.optimizer.state_dict(), staging / "optimizer.pt")
        if trainer.scheduler is not None and hasattr(trainer.scheduler, "state_dict"):
            atomic_save(trainer.scheduler.state_dict(), staging / "scheduler.pt")
        if accelerator.scaler is not None:
            atomic_save(accelerator.scaler.state_dict(), staging / "scaler.pt")
        grads = {
            name: p.grad
            for name, p in trainer.get_model(keep_torch_compile=False).named_parameters()
            if p.grad is not None
        }
        atomic_save(grads, staging / "grads.pt")
        metadata = {
            "fasttrain_state_version": STATE_VERSION,
            "current_epoch": trainer.run_history.current_epoch,
            "step_in_epoch": getattr(trainer, "_step_in_epoch", 0) if buffer is not None else 0,
            "num_updates": trainer.num_updates,
            "skipped_updates": trainer.skipped_updates,
            "epoch_loss_sum": buffer.loss_sum if buffer is not None else 0.0,
            "epoch_sample_count": buffer.sample_count if buffer is not None else 0,
            "run_history": trainer.run_history.state_dict() if hasattr(trainer.run_history, "state_dict") else None,
            "engine": trainer._engine.state_dict() if trainer._engine is not None else {},
            "num_processes": accelerator.num_processes,
        }
        if checkpoint_kwargs is not None:
            metadata.update(checkpoint_kwargs)
        atomic_save(metadata, staging / _METADATA_FILE)
    # every process has its own random streams
    atomic_save(
        {"rng": capture_rng_state(), "epoch_start_rng": getattr(trainer, "_epoch_start_rng", None) or capture_rng_state()},
        staging / f"rng_state_{rank}.pt",
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        old = output_dir.with_name(f".{output_dir.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if output_dir.exists():
            os.replace(output_dir, old)
        os.replace(staging, output_dir)
        if old.exists():
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_training_state(trainer, input_dir) -> dict:
    input_dir = Path(input_dir)
    metadata_path = input_dir / _METADATA_FILE
    if not metadata_path.exists():
        old = input_dir.with_name(f".{input_dir.name}.old")
        hint = f" A previous complete state was kept at {old}." if (old / _METADATA_FILE).exists() else ""
        raise CheckpointError(
            f"{input_dir} is not a complete fasttrain training state (no {_METADATA_FILE}).{hint}"
        )
    metadata = safe_load(metadata_path)
    accelerator = trainer._accelerator
    if metadata.get("num_processes", accelerator.num_processes) != accelerator.num_processes:
        raise CheckpointError(
            f"{input_dir} was saved by {metadata['num_processes']} processes and is being loaded by "
            f"{accelerator.num_processes}; resume with the same number of processes."
        )
    model = trainer.get_model(keep_torch_compile=False)
    model.load_state_dict(safe_load(input_dir / "model.pt"))
    trainer.optimizer.load_state_dict(safe_load(input_dir / "optimizer.pt"))
    if (input_dir / "scheduler.pt").exists():
        if trainer.scheduler is None:
            raise ValueError(
                f"{input_dir} holds a scheduler state but this run has no scheduler; pass the same "
                "create_scheduler_fn as the saved run."
            )
        trainer.scheduler.load_state_dict(safe_load(input_dir / "scheduler.pt"))
    if (input_dir / "scaler.pt").exists() and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(safe_load(input_dir / "scaler.pt"))
    if (input_dir / "grads.pt").exists():
        grads = safe_load(input_dir / "grads.pt")
        for name, p in model.named_parameters():
            if name in grads:
                p.grad = grads[name].to(p.device)
    if metadata.get("run_history") is not None and hasattr(trainer.run_history, "load_state_dict"):
        trainer.run_history.load_state_dict(metadata["run_history"])
    else:
        trainer.run_history._set_epoch(metadata.get("current_epoch", 1))
    trainer._num_updates = metadata.get("num_updates", 0)
    trainer._skipped_updates = metadata.get("skipped_updates", 0)
    if trainer._engine is not None:
        trainer._engine.load_state_dict(metadata.get("engine", {}))
    rng_path = input_dir / f"rng_state_{accelerator.process_index}.pt"
    rng = safe_load(rng_path) if rng_path.exists() else None
    metadata["_rng"] = rng
    return metadata


def resume_position(metadata: dict) -> Optional[ResumePosition]:
    rng = metadata.get("_rng")
    if rng is None or "step_in_epoch" not in metadata:
        return None
    return ResumePosition(
        epoch=metadata["current_epoch"],
        step=metadata["step_in_epoch"],
        epoch_start_rng=rng["epoch_start_rng"],
        rng=rng["rng"],
        loss_sum=metadata.get("epoch_loss_sum", 0.0),
        sample_count=metadata.get("epoch_sample_count", 0),
    )


def epoch_batches(trainer, dataloader, buffer):
    """The batches of this epoch and the index of the first one.

    Records the random state at the start of the epoch (the sampler draws its shuffle from it),
    so that a state saved mid-epoch can rebuild the same batch order. When resuming inside this
    epoch, replays that order, skips the batches already trained on and restores the saved random
    state, so that the rest of the run matches an uninterrupted one.
    """
    position = trainer._resume_position
    if position is None or position.epoch != trainer.run_history.current_epoch:
        trainer._epoch_start_rng = capture_rng_state()
        return dataloader, 0
    trainer._resume_position = None
    trainer._epoch_start_rng = position.epoch_start_rng
    restore_rng_state(position.epoch_start_rng)
    iterator = iter(dataloader)
    for _ in range(position.step):
        next(iterator, None)
    restore_rng_state(position.rng)
    buffer.loss_sum = position.loss_sum
    buffer.sample_count = position.sample_count
    return iterator, position.step
