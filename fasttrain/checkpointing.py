"""Checkpoints and training states: atomic writes, verified safe loads, step-exact resume.

Two formats, as in pytorch-accelerated:

* a **checkpoint** (:func:`save_checkpoint`) is one ``.pt`` file holding ``model_state_dict``,
  optionally ``optimizer_state_dict`` and ``scheduler_state_dict``, and the caller's extra keys;
* a **training state** (:func:`save_training_state`) is a directory holding everything needed to
  continue a run from the exact step it was saved at: model, optimizer, scheduler, loss scaler,
  gradients accumulated inside an open accumulation window, the random number generator states of
  every library and process (including the data loader's generators), the position in the epoch,
  the run history, the epoch's loss counters, the engine's and the callbacks' state. A
  ``manifest.json`` lists every file with its size and SHA-256, so a truncated or damaged state is
  reported before anything is loaded from it.

Every file is written to a temporary name and renamed into place, and a training state directory
is assembled under a temporary name and swapped in whole, so an exception or a kill during a save
never replaces a good checkpoint with a broken one. Files are loaded with ``weights_only=True``: a
file carrying arbitrary pickled objects is refused (:mod:`fasttrain.checkpoint_files`). A
checkpoint path ending in ``.safetensors`` holds the model's weights only. Sharded (FSDP2) models
go through ``torch.distributed.checkpoint`` (:mod:`fasttrain.checkpoint_sharded`). The resume
machinery (positions, replaying an epoch's shuffle) lives in :mod:`fasttrain.resume`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch

from fasttrain import checkpoint_sharded, step_metrics
from fasttrain.engine.hyperparams import plain_optimizer_state
from fasttrain.checkpoint_files import (  # noqa: F401  (re-exported: part of this module's API)
    CheckpointError,
    CheckpointNotFoundError,
    atomic_save,
    is_safetensors,
    load_safetensors,
    safe_load,
    save_safetensors,
)
from fasttrain.checkpoint_files import file_entry as _file_entry
from fasttrain.resume import (  # noqa: F401  (re-exported: the trainer reaches them from here)
    ResumePosition,
    begin_training,
    capture_rng_state,
    capture_position,
    epoch_batches,
    restore_rng_state,
    resume_position,
    resume_start,
)

STATE_VERSION = 2
MANIFEST_FILE = "manifest.json"
_METADATA_FILE = "trainer_state.pt"
_CALLBACKS_FILE = "callbacks.pt"

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "atomic_save",
    "safe_load",
    "save_checkpoint",
    "load_checkpoint",
    "save_training_state",
    "load_training_state",
    "verify_training_state",
    "find_latest_training_state",
    "capture_rng_state",
    "restore_rng_state",
]


# ------------------------------------------------------------------------------- checkpoints
def save_checkpoint(trainer, save_path, checkpoint_kwargs, save_optimizer, save_scheduler, save_per_node):
    accelerator = trainer._accelerator
    writer = accelerator.is_local_main_process if save_per_node else accelerator.is_main_process
    weights_only = is_safetensors(save_path)
    if weights_only:
        _check_weights_only(trainer, save_path, checkpoint_kwargs, save_optimizer, save_scheduler)
        save_optimizer = save_scheduler = False
    if checkpoint_sharded.is_sharded(trainer):
        # every process takes part in gathering the shards; the writers get the whole state
        several_nodes = accelerator.num_processes > int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        # the gathers are done by every process before anything can fail on one of them only
        # (the conversion on the writers): that failure reaches the others here
        with _shared_failures(accelerator, f"Saving the checkpoint {save_path}"):
            model_state, optimizer_state = checkpoint_sharded.full_state_dicts(
                trainer, with_optimizer=save_optimizer, writers_on_every_node=save_per_node and several_nodes
            )
        checkpoint = {"model_state_dict": model_state}
        if save_optimizer:
            checkpoint["optimizer_state_dict"] = plain_optimizer_state(trainer.optimizer, optimizer_state)
    else:
        checkpoint = {"model_state_dict": trainer.get_model(keep_torch_compile=False).state_dict()}
        if save_optimizer:
            checkpoint["optimizer_state_dict"] = plain_optimizer_state(trainer.optimizer)
    if save_scheduler and trainer.scheduler is not None:
        if hasattr(trainer.scheduler, "state_dict"):
            checkpoint["scheduler_state_dict"] = trainer.scheduler.state_dict()
        else:
            trainer.print("Warning: the scheduler has no state_dict(); it is not saved in the checkpoint.")
    if checkpoint_kwargs is not None:
        checkpoint.update(checkpoint_kwargs)
    accelerator.wait_for_everyone()
    with _shared_failures(accelerator, f"Saving the checkpoint {save_path}"):
        if writer:
            if weights_only:
                save_safetensors(checkpoint["model_state_dict"], save_path)
            else:
                atomic_save(checkpoint, save_path)


def _check_weights_only(trainer, save_path, checkpoint_kwargs, save_optimizer, save_scheduler) -> None:
    extra = []
    if save_optimizer and trainer.optimizer is not None:
        extra.append("the optimizer state (save_optimizer=False leaves it out)")
    if save_scheduler and trainer.scheduler is not None and hasattr(trainer.scheduler, "state_dict"):
        extra.append("the scheduler state (save_scheduler=False leaves it out)")
    if checkpoint_kwargs:
        extra.append(f"checkpoint_kwargs {sorted(checkpoint_kwargs)}")
    if extra:
        raise ValueError(
            f"{save_path} is a .safetensors file, which holds the model's weights only, and this "
            f"save would also hold {'; '.join(extra)}. Leave those out, or save to a .pt path, "
            "which holds them all."
        )


def load_checkpoint(trainer, checkpoint_path, load_optimizer, load_scheduler):
    accelerator = trainer._accelerator
    accelerator.wait_for_everyone()
    sharded = checkpoint_sharded.is_sharded(trainer)
    # a sharded load is collective: a process that cannot read the file must not leave the
    # others waiting in the broadcast
    with _shared_failures(accelerator, f"Loading the checkpoint {checkpoint_path}") if sharded else contextlib.nullcontext():
        checkpoint = load_safetensors(checkpoint_path) if is_safetensors(checkpoint_path) else safe_load(checkpoint_path)
        if not isinstance(checkpoint, dict) or "model_state_dict" not in checkpoint:
            raise CheckpointError(
                f"{checkpoint_path} has no 'model_state_dict'; it was not written by save_checkpoint"
            )
    load_optimizer = load_optimizer and "optimizer_state_dict" in checkpoint
    if load_optimizer and trainer.optimizer is None:
        raise ValueError(
            "The checkpoint holds an optimizer state but the trainer has no optimizer; pass "
            "one to the Trainer or call load_checkpoint(..., load_optimizer=False)."
        )
    if load_optimizer:
        _check_parameter_groups(checkpoint_path, checkpoint["optimizer_state_dict"], trainer.optimizer)
    if sharded:
        # a whole state, whichever number of processes wrote it: process 0's values are
        # broadcast and every process keeps its shards
        checkpoint_sharded.load_full_state_dicts(
            trainer, checkpoint["model_state_dict"], checkpoint["optimizer_state_dict"] if load_optimizer else None
        )
    else:
        trainer.get_model(keep_torch_compile=False).load_state_dict(checkpoint["model_state_dict"])
        if load_optimizer:
            trainer.optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    if load_scheduler and "scheduler_state_dict" in checkpoint:
        if trainer.scheduler is None:
            raise ValueError(
                "The checkpoint holds a scheduler state but the trainer has no scheduler; create "
                "one with create_scheduler_fn or call load_checkpoint(..., load_scheduler=False)."
            )
        trainer.scheduler.load_state_dict(checkpoint["scheduler_state_dict"])
    return checkpoint


def _check_parameter_groups(checkpoint_path, optimizer_state: dict, optimizer) -> None:
    # torch refuses another group layout too, but only after the model's weights were loaded,
    # and without saying why a layout changes: a checkpoint saved while layers were frozen holds
    # fewer groups than the optimizer has once unfreezing added theirs
    saved = [len(group["params"]) for group in optimizer_state.get("param_groups", [])]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved == current:
        return
    raise ValueError(
        f"The optimizer state in {checkpoint_path} has {len(saved)} parameter group(s) of "
        f"{saved} parameters; the trainer's optimizer has {len(current)} of {current}. Groups "
        "added after the checkpoint was saved (unfreezing layers adds them) cannot take its state: "
        "call load_checkpoint(..., load_optimizer=False) to load the model's weights alone, and "
        "use SaveBestModelCallback(save_optimizer=False) when the optimizer's groups change "
        "during training."
    )


# ------------------------------------------------------------------------------- training state
def _stateful_callbacks(trainer):
    """Callbacks whose class defines both ``state_dict`` and ``load_state_dict``, by class name
    (a trainer holds one instance per class)."""
    return {
        type(cb).__name__: cb
        for cb in trainer.callback_handler.callbacks
        if callable(getattr(type(cb), "state_dict", None)) and callable(getattr(type(cb), "load_state_dict", None))
    }


def _open_accumulation_window(trainer) -> bool:
    """Whether gradients of micro-steps not yet applied by an update are held in ``.grad``."""
    config = trainer.run_config
    if getattr(trainer, "_train_buffer", None) is None or config is None:
        return False
    consumed = trainer.progress.step_in_epoch
    try:
        num_batches = len(trainer._train_dataloader)
    except TypeError:
        num_batches = None
    return consumed % config.gradient_accumulation_steps != 0 and consumed != num_batches


def save_training_state(trainer, output_dir, checkpoint_kwargs=None) -> bool:
    """Write the training state to ``output_dir``; returns False (writing nothing) when the
    model has taken an update with non-finite values since the last good state."""
    output_dir = Path(output_dir)
    accelerator = trainer._accelerator
    buffer = getattr(trainer, "_train_buffer", None)
    if buffer is not None and len(buffer):
        # SYNC(save): a save is a flush point, so the saved loss counters are complete and a non-finite
        # value in the steps since the last flush is seen before anything is written
        step_metrics.flush(trainer, buffer, is_epoch_end=False)
    if trainer.progress.nonfinite_applied:
        trainer.print(
            f"Not saving the training state to {output_dir}: an update with non-finite values was "
            "applied since the last good state, which is kept as it is."
        )
        return False
    _check_replaceable(output_dir)
    rank = accelerator.process_index
    staging = output_dir.with_name(f".{output_dir.name}.staging")
    what = f"Saving the training state to {output_dir}"
    sharded = checkpoint_sharded.is_sharded(trainer)
    open_window = _open_accumulation_window(trainer)
    with _shared_failures(accelerator, what):
        if accelerator.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)  # left by a save that was killed
            staging.mkdir(parents=True)

    entries = {}
    model = trainer.get_model(keep_torch_compile=False)
    sharded_metadata = None
    if sharded:
        # every process writes its own shards of the model and optimizer (DCP coordinates the
        # writes and raises on every process when one fails) and hashes them for the manifest
        with _shared_failures(accelerator, what):
            sharded_metadata = checkpoint_sharded.save_sharded(trainer, staging)
            shard_dir = staging / sharded_metadata["dir"]
            own_entries = {
                f"{sharded_metadata['dir']}/{name}": _file_entry(shard_dir / name)
                for name in checkpoint_sharded.shard_files_of(rank, shard_dir)
            }
    with _shared_failures(accelerator, what):
        if accelerator.is_main_process:
            if not sharded:
                entries["model.pt"] = atomic_save(model.state_dict(), staging / "model.pt")
            if not sharded or not sharded_metadata["optimizer_state"]:
                # sharded: the parameter groups of an optimizer without state yet (nothing sharded)
                entries["optimizer.pt"] = atomic_save(plain_optimizer_state(trainer.optimizer), staging / "optimizer.pt")
            if trainer.scheduler is not None and hasattr(trainer.scheduler, "state_dict"):
                entries["scheduler.pt"] = atomic_save(trainer.scheduler.state_dict(), staging / "scheduler.pt")
            if accelerator.scaler is not None:
                entries["scaler.pt"] = atomic_save(accelerator.scaler.state_dict(), staging / "scaler.pt")
            callbacks = {name: cb.state_dict() for name, cb in _stateful_callbacks(trainer).items()}
            if callbacks:
                entries[_CALLBACKS_FILE] = atomic_save(callbacks, staging / _CALLBACKS_FILE)
            metadata = {
                "fasttrain_state_version": STATE_VERSION,
                **capture_position(trainer),
                **trainer.progress.state_dict(),  # num_updates, skipped_updates
                "run_history": trainer.run_history.state_dict() if hasattr(trainer.run_history, "state_dict") else None,
                "engine": trainer._engine.state_dict() if trainer._engine is not None else {},
                "num_processes": accelerator.num_processes,
            }
            if sharded_metadata is not None:
                metadata["sharded"] = sharded_metadata
            if checkpoint_kwargs is not None:
                metadata.update(checkpoint_kwargs)
            entries[_METADATA_FILE] = atomic_save(metadata, staging / _METADATA_FILE)
        own = {}
        if open_window:
            # inside a window each process holds its own, not yet all-reduced, gradients
            if sharded:
                grads = checkpoint_sharded.window_gradients(model)
            else:
                grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
            own[f"grads_{rank}.pt"] = atomic_save(grads, staging / f"grads_{rank}.pt")
        # every process has its own random streams
        own[f"rng_state_{rank}.pt"] = atomic_save(
            {"rng": capture_rng_state(trainer._train_dataloader), "epoch_start_rng": trainer.progress.epoch_start_rng},
            staging / f"rng_state_{rank}.pt",
        )
    if sharded:
        # each process hashed the files it wrote, large ones included: process 0 reads none of them
        entries.update(_gather_entries(accelerator, {**own_entries, **own}))
    with _shared_failures(accelerator, what):
        if accelerator.is_main_process:
            for path in sorted(staging.iterdir()):
                if path.name not in entries and not path.name.startswith(".") and path.is_file():
                    entries[path.name] = _file_entry(path)  # small per-process files
            manifest = {"format": "fasttrain-training-state", "version": STATE_VERSION, "files": entries}
            with open(staging / MANIFEST_FILE, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _swap_into_place(staging, output_dir)
    # named by the non-finite stop message: a state written after a flush found nothing wrong
    trainer._last_good_save = f"train(..., resume_from={os.fspath(output_dir)!r})"
    return True


def _gather_entries(accelerator, own: dict) -> dict:
    """The manifest entries every process computed for the files it wrote, merged."""
    if accelerator.num_processes == 1:
        return dict(own)
    gathered = [None] * accelerator.num_processes
    # one exchange of a few names and digests per save
    torch.distributed.all_gather_object(gathered, own)
    return {name: entry for part in gathered for name, entry in part.items()}


_STATE_FILE_NAMES = {"model.pt", "optimizer.pt", "scheduler.pt", "scaler.pt", _CALLBACKS_FILE, _METADATA_FILE, MANIFEST_FILE}


def _check_replaceable(output_dir: Path) -> None:
    # the swap deletes the previous directory whole, so it must hold a training state and nothing else
    if not output_dir.is_dir():
        return
    foreign = sorted(
        p.name
        for p in output_dir.iterdir()
        if p.name not in _STATE_FILE_NAMES
        and not re.fullmatch(r"(grads|rng_state)_\d+\.pt", p.name)
        and not (p.name == checkpoint_sharded.DCP_DIR and p.is_dir())
    )
    if foreign:
        raise ValueError(
            f"Not saving the training state to {output_dir}: the directory exists and holds "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which are not part of a "
            "training state, and a save replaces the directory whole. Save to a new or empty "
            f"directory, e.g. {output_dir / 'training_state'}."
        )


@contextlib.contextmanager
def _shared_failures(accelerator, what: str):
    """A barrier that also tells every process whether any of them failed in the block, so that
    a process that raised never leaves the others waiting in the next collective."""
    error = None
    try:
        yield
    except BaseException as e:  # KeyboardInterrupt included: the others must not hang either
        error = e
    if accelerator.num_processes > 1:
        flag = torch.tensor([0.0 if error is None else 1.0], device=accelerator.device)
        # SYNC(save): one gather of one number per phase of a save or load, in place of a barrier
        failed = bool(accelerator.gather(flag).amax().item())
    else:
        failed = error is not None
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on another process; its output says why.")


def _swap_into_place(staging: Path, output_dir: Path) -> None:
    # The previous state is renamed aside before the new one takes its name and deleted only
    # afterwards: at every moment a complete state exists under output_dir or, for the instant
    # between the two renames, under .<name>.old (load_training_state falls back to it).
    old = output_dir.with_name(f".{output_dir.name}.old")
    if output_dir.exists():
        if old.exists():
            shutil.rmtree(old)  # left by a save killed while deleting it; output_dir is complete
        os.replace(output_dir, old)
    # without output_dir, an .old left by a save killed between the renames is the only
    # complete state until the new one has the name
    os.replace(staging, output_dir)
    if old.exists():
        shutil.rmtree(old)


def verify_training_state(input_dir, check_hashes: bool = True) -> dict:
    """Check that ``input_dir`` is a complete training state: every file of its manifest is
    present with the recorded size (and SHA-256). Returns the manifest; raises
    :class:`CheckpointError` naming what is wrong."""
    return _verify(Path(input_dir), lambda name: check_hashes)


def _hashes_checked_here(accelerator):
    """Which files' hashes this process checks when every process verifies a state: each the
    files it wrote (shards of a sharded state, gradients, random states), the first process
    everything else, so that no process reads all of a large sharded state."""
    rank = accelerator.process_index

    def check(name: str) -> bool:
        owner = checkpoint_sharded.file_owner(name)
        return owner == rank if owner is not None else accelerator.is_main_process

    return check


def _verify(input_dir: Path, check_hash) -> dict:
    manifest_path = input_dir / MANIFEST_FILE
    if not input_dir.is_dir():
        raise CheckpointError(f"No training state at {input_dir} (not a directory)")
    if not manifest_path.exists():
        if (input_dir / _METADATA_FILE).exists():
            _verify_unversioned_state(input_dir)
            return {"files": {}}
        raise CheckpointError(
            f"{input_dir} is not a complete fasttrain training state (no {MANIFEST_FILE}); the save "
            "that wrote it did not finish."
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is damaged ({e}); the training state cannot be verified.") from e
    problems = []
    for name, entry in sorted(files.items()):
        path = input_dir / name
        if not path.exists():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{name} has {size} bytes, the manifest records {entry['size']} (truncated?)")
        elif check_hash(name) and _file_entry(path)["sha256"] != entry["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the manifest (corrupted)")
    if problems:
        raise CheckpointError(
            f"The training state at {input_dir} is damaged: {'; '.join(problems)}. Resume from "
            "an earlier state (find_latest_training_state lists the complete ones)."
        )
    return manifest


def _verify_unversioned_state(input_dir: Path) -> None:
    """Accept a directory without a manifest only when it is positively a complete state of the
    format before manifests (version 1: metadata saying so, the model, the optimizer and one RNG
    file per process). Anything else without a manifest is a save that did not finish: today's
    saves write ``trainer_state.pt`` before the RNG files and the manifest, so a save killed in
    between leaves exactly such a directory (its staging folder)."""
    unfinished = (
        f"{input_dir} is not a complete fasttrain training state: it has {_METADATA_FILE} but no "
        f"{MANIFEST_FILE}, so the save that wrote it did not finish"
    )
    if input_dir.name.startswith(".") and input_dir.name.endswith(".staging"):
        raise CheckpointError(f"{unfinished} (this is a save's staging folder). Resume from the state it was to replace.")
    metadata = safe_load(input_dir / _METADATA_FILE)
    version = metadata.get("fasttrain_state_version") if isinstance(metadata, dict) else None
    if version != 1:
        raise CheckpointError(
            f"{unfinished} (its metadata says format version {version!r}; only version 1 states "
            "were written without one). Resume from an earlier state."
        )
    processes = metadata.get("num_processes", 1)
    needed = ["model.pt", "optimizer.pt"] + [f"rng_state_{r}.pt" for r in range(processes)]
    missing = [name for name in needed if not (input_dir / name).exists()]
    if missing:
        raise CheckpointError(
            f"The version 1 training state at {input_dir} is incomplete: {', '.join(missing)} "
            "missing. Resume from an earlier state."
        )


def _resolve_state_dir(input_dir: Path) -> Path:
    """``input_dir``, or the complete previous state that a save killed between its two renames
    left beside it."""
    if input_dir.exists():
        return input_dir
    old = input_dir.with_name(f".{input_dir.name}.old")
    if (old / MANIFEST_FILE).exists():
        warnings.warn(
            f"{input_dir} is missing but a complete earlier state was left at {old} by an "
            "interrupted save; loading that one.",
            stacklevel=3,
        )
        return old
    raise CheckpointError(f"No training state at {input_dir}")


def load_training_state(trainer, input_dir) -> dict:
    input_dir = _resolve_state_dir(Path(input_dir))
    accelerator = trainer._accelerator
    # every process checks that the files are complete; hashing them (reading every byte once
    # more) is left to one process per file, as the files are shared
    with _shared_failures(accelerator, f"Loading the training state from {input_dir}"):
        _verify(input_dir, _hashes_checked_here(accelerator))
        metadata = safe_load(input_dir / _METADATA_FILE)
    if metadata.get("num_processes", accelerator.num_processes) != accelerator.num_processes:
        raise CheckpointError(
            f"{input_dir} was saved by {metadata['num_processes']} processes and is being loaded by "
            f"{accelerator.num_processes}; resume with the same number of processes."
        )
    model = trainer.get_model(keep_torch_compile=False)
    saved_sharded = metadata.get("sharded")
    if checkpoint_sharded.is_sharded(trainer) != (saved_sharded is not None):
        raise CheckpointError(
            f"{input_dir} was saved by a run whose model was {'' if saved_sharded else 'not '}sharded "
            f"and this run's model is {'not ' if saved_sharded else ''}sharded (FSDP2); resume with "
            "the same distributed configuration. To carry the weights over to another one, "
            "save_checkpoint() writes a whole model that load_checkpoint() reads in any set-up."
        )
    if saved_sharded is not None:
        with _shared_failures(accelerator, f"Loading the training state from {input_dir}"):
            checkpoint_sharded.load_sharded(trainer, input_dir, saved_sharded)
        if not saved_sharded.get("optimizer_state"):
            trainer.optimizer.load_state_dict(safe_load(input_dir / "optimizer.pt"))
    else:
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
    grads_path = input_dir / f"grads_{accelerator.process_index}.pt"
    if saved_sharded is not None:
        checkpoint_sharded.restore_window_gradients(model, safe_load(grads_path) if grads_path.exists() else None)
    else:
        _load_gradients(model, grads_path)
    if (input_dir / _CALLBACKS_FILE).exists():
        saved = safe_load(input_dir / _CALLBACKS_FILE)
        for name, callback in _stateful_callbacks(trainer).items():
            if name in saved:
                callback.load_state_dict(saved[name])
    if metadata.get("run_history") is not None and hasattr(trainer.run_history, "load_state_dict"):
        trainer.run_history.load_state_dict(metadata["run_history"])
    else:
        trainer.run_history._set_epoch(metadata.get("current_epoch", 1))
    trainer.progress.load_state_dict(metadata)
    if trainer._engine is not None:
        trainer._engine.load_state_dict(metadata.get("engine", {}))
    rng_path = input_dir / f"rng_state_{accelerator.process_index}.pt"
    metadata["_rng"] = safe_load(rng_path) if rng_path.exists() else None
    return metadata


def _load_gradients(model, path: Path) -> None:
    grads = safe_load(path) if path.exists() else {}
    for name, p in model.named_parameters():
        saved = grads.get(name)
        if saved is None:
            # outside an accumulation window the gradients were cleared by the last update;
            # engines that keep static gradient buffers get zeros in place
            if p.grad is not None:
                p.grad.zero_()
        elif p.grad is not None and p.grad.shape == saved.shape:
            p.grad.copy_(saved)
        else:
            p.grad = saved.to(device=p.device, dtype=p.dtype)


def find_latest_training_state(*directories) -> Optional[Path]:
    """The most advanced complete training state among ``directories`` and their subdirectories
    (by optimizer updates, then epoch and step), or None. Damaged or unfinished states (a save's
    staging folder, a state without its manifest or with a file missing or cut short) are skipped;
    sizes are checked, not hashes, to keep this cheap. A complete state that a save killed between
    its two renames left as ``.<name>.old``, with no ``<name>`` beside it, counts."""
    best, best_key = None, None
    for candidate in _state_candidates(directories):
        try:
            verify_training_state(candidate, check_hashes=False)
            metadata = safe_load(candidate / _METADATA_FILE)
        except (CheckpointError, FileNotFoundError):
            continue
        key = (
            metadata.get("num_updates", 0),
            metadata.get("current_epoch", 0),
            metadata.get("phase") == "train_done",
            metadata.get("step_in_epoch", 0),
        )
        if best_key is None or key > best_key:
            best, best_key = candidate, key
    return best


def _state_candidates(directories):
    for directory in map(Path, directories):
        if not directory.is_dir():
            # a state directory itself (an interrupt_save_dir) that a killed swap left aside
            aside = directory.with_name(f".{directory.name}.old")
            if aside.is_dir():
                yield aside
            continue
        for candidate in [directory, *sorted(p for p in directory.iterdir() if p.is_dir())]:
            name = candidate.name
            if not name.startswith("."):
                yield candidate
            elif name.endswith(".old") and not candidate.with_name(name[1 : -len(".old")]).exists():
                yield candidate
