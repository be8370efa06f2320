"""Step-exact resume: where in the run a training state was taken, and how to get back there.

A training state records a *position*, one of three phases of an epoch:

* ``"epoch_start"``: before the epoch's first batch (also: after the last epoch of a run);
* ``"mid_epoch"``: ``step`` batches of the epoch consumed (possibly inside an accumulation
  window);
* ``"train_done"``: the epoch's training part finished, its evaluation and epoch end pending.

and the random number generator states of the process at that moment. For a mid-epoch position it
also records the states at the start of the epoch: the sampler draws the epoch's shuffle from them,
so restoring them and iterating again rebuilds the same batch order. The consumed batches are then
skipped at the sampler level (their indices are drawn, their samples are never loaded) unless the
trainer was built with ``resume_data_skip="replay"``, which loads and drops them so that random
augmentations running in data-loader workers see the same sequence as in an uninterrupted run.
"""

from __future__ import annotations

import itertools
import os
import random
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import DataLoader

from fasttrain.data import DeviceLoader
from fasttrain.utils import DataLoaderSlice

PHASES = ("epoch_start", "mid_epoch", "train_done")


# ------------------------------------------------------------------------------- RNG states
def innermost_loader(dataloader):
    """The data loader inside the trainer's wrappers (batch limiting, device placement)."""
    while True:
        if isinstance(dataloader, DataLoaderSlice):
            dataloader = dataloader.dl
        elif isinstance(dataloader, DeviceLoader):
            dataloader = dataloader.dataloader
        else:
            return dataloader


def data_generators(dataloader) -> list:
    """The ``torch.Generator`` objects that decide a data loader's batch order and worker seeds
    (its own, its sampler's, accelerate's synchronised one), in a fixed order, each once."""
    found = []

    def add(generator):
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)

    loader = innermost_loader(dataloader)
    if loader is None:
        return found
    add(getattr(loader, "generator", None))
    add(getattr(loader, "synchronized_generator", None))
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner_batch_sampler = getattr(batch_sampler, "batch_sampler", None)  # accelerate's shard
    for holder in (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        inner_batch_sampler,
        getattr(inner_batch_sampler, "sampler", None),
    ):
        add(getattr(holder, "generator", None))
    return found


def capture_rng_state(dataloader=None) -> dict:
    """The states of Python's, NumPy's, torch's (CPU and CUDA) global generators and of the
    generators of ``dataloader``, as values ``torch.load(weights_only=True)`` reads back."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
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
    if dataloader is not None:
        state["generators"] = [g.get_state() for g in data_generators(dataloader)]
    return state


def restore_rng_state(state: dict, dataloader=None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype("uint32"),  # SYNC(none): a loaded host tensor
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("generators")
    if dataloader is not None and saved is not None:
        generators = data_generators(dataloader)
        if len(generators) != len(saved):
            warnings.warn(
                f"The training data loader has {len(generators)} random generators but the saved "
                f"state has {len(saved)}; the batch order after resuming may differ. Build the "
                "data loader with the same arguments as the saved run.",
                stacklevel=2,
            )
            return
        for generator, generator_state in zip(generators, saved):
            generator.set_state(generator_state)


# ------------------------------------------------------------------------------- positions
@dataclass
class ResumePosition:
    epoch: int
    phase: str
    step: int  # batches of the epoch already consumed (mid_epoch)
    rng: dict
    epoch_start_rng: Optional[dict]
    loss_sum: float
    sample_count: int
    loader_iteration: Optional[int]


def _loader_iteration(dataloader) -> Optional[int]:
    # accelerate's loaders count finished passes; seedable samplers reshuffle by that count
    value = getattr(innermost_loader(dataloader), "iteration", None)
    return value if isinstance(value, int) else None


def _set_loader_iteration(dataloader, value: Optional[int]) -> None:
    loader = innermost_loader(dataloader)
    if value is not None and isinstance(getattr(loader, "iteration", None), int):
        loader.iteration = value


def capture_position(trainer) -> dict:
    """The metadata entries saying where in the run the trainer is."""
    epoch = trainer.run_history.current_epoch
    buffer = getattr(trainer, "_train_buffer", None)
    progress = trainer.progress
    # the epoch this train() call started at: with reset_run_history=False (progressive
    # resizing) a run's epochs do not start at 1
    first = progress.run_first_epoch
    if buffer is not None:
        return {
            "run_first_epoch": first,
            "current_epoch": epoch,
            "phase": "mid_epoch",
            "step_in_epoch": progress.step_in_epoch,
            "epoch_loss_sum": buffer.loss_sum,
            "epoch_sample_count": buffer.sample_count,
            "loader_iteration": progress.epoch_start_loader_iteration,
        }
    phase = "train_done" if progress.epoch_in_progress == epoch else "epoch_start"
    return {
        "run_first_epoch": first,
        "current_epoch": epoch,
        "phase": phase,
        "step_in_epoch": 0,
        "epoch_loss_sum": 0.0,
        "epoch_sample_count": 0,
        "loader_iteration": _loader_iteration(trainer._train_dataloader),
    }


def resume_position(metadata: dict) -> Optional[ResumePosition]:
    rng = metadata.get("_rng")
    if rng is None or "current_epoch" not in metadata:
        return None
    phase = metadata.get("phase")
    if phase is None:  # states written before phases were recorded
        phase = "mid_epoch" if metadata.get("step_in_epoch", 0) else "epoch_start"
    return ResumePosition(
        epoch=metadata["current_epoch"],
        phase=phase,
        step=metadata.get("step_in_epoch", 0),
        rng=rng["rng"],
        epoch_start_rng=rng.get("epoch_start_rng"),
        loss_sum=metadata.get("epoch_loss_sum", 0.0),
        sample_count=metadata.get("epoch_sample_count", 0),
        loader_iteration=metadata.get("loader_iteration"),
    )


def reset_run_state(trainer) -> None:
    """The state one ``train()`` call builds up, as it is in a new Trainer: the counters
    (``trainer.progress``), the epoch's step metrics, why the run stopped."""
    trainer.progress.reset()
    trainer._train_buffer = None
    trainer.stop_reason = None


def begin_training(trainer, resume_from=None) -> None:
    """Reset the per-run state of ``trainer`` and, with ``resume_from``, load a training state
    and remember where to continue."""
    reset_run_state(trainer)
    progress = trainer.progress
    progress.run_first_epoch = trainer.run_history.current_epoch
    if resume_from is None:
        return
    metadata = trainer.load_training_state(resume_from)
    if "current_epoch" in metadata:
        # also when load_training_state is overridden and leaves the run history alone
        trainer.run_history._set_epoch(metadata["current_epoch"])
    progress.run_first_epoch = metadata.get("run_first_epoch", 1)
    progress.resume_position = resume_position(metadata)
    progress.resumed_from = os.fspath(resume_from)
    trainer.print(
        f"Resumed training state from {resume_from} (epoch {trainer.run_history.current_epoch}, "
        f"update {progress.num_updates})"
    )


def resume_start(trainer):
    """``(epochs already done, skip_train)`` for the epoch loop: with ``skip_train`` the first
    epoch's training part is already done and only its evaluation and end remain."""
    progress = trainer.progress
    position = progress.resume_position
    if position is None:
        return 0, False
    epochs_done = position.epoch - progress.run_first_epoch
    if position.phase != "train_done":
        return epochs_done, False
    progress.resume_position = None
    progress.epoch_in_progress = position.epoch
    restore_rng_state(position.rng, trainer._train_dataloader)
    _set_loader_iteration(trainer._train_dataloader, position.loader_iteration)
    return epochs_done, True


# ------------------------------------------------------------------------------- the epoch's batches
def epoch_batches(trainer, dataloader, buffer):
    """The batches of this epoch and the index of the first one.

    Records the random state at the start of the epoch (the sampler draws its shuffle from it),
    so that a state saved mid-epoch can rebuild the same batch order. When resuming inside this
    epoch, replays that order, skips the consumed batches and restores the saved random state,
    so that the rest of the run matches an uninterrupted one.
    """
    epoch = trainer.run_history.current_epoch
    progress = trainer.progress
    progress.epoch_in_progress = epoch
    position = progress.resume_position
    progress.resume_position = None
    if position is not None and position.epoch == epoch and position.phase == "epoch_start":
        restore_rng_state(position.rng, dataloader)
        _set_loader_iteration(dataloader, position.loader_iteration)
        position = None
    if position is None or position.epoch != epoch or position.phase != "mid_epoch":
        progress.epoch_start_rng = capture_rng_state(dataloader)
        progress.epoch_start_loader_iteration = _loader_iteration(dataloader)
        return dataloader, 0
    progress.epoch_start_rng = position.epoch_start_rng
    progress.epoch_start_loader_iteration = position.loader_iteration
    buffer.loss_sum = position.loss_sum
    buffer.sample_count = position.sample_count
    replay = getattr(trainer, "resume_data_skip", "sampler") == "replay"
    return _resumed_batches(dataloader, position, replay), position.step


_END = object()


def _resumed_batches(dataloader, position: ResumePosition, replay: bool):
    # Runs on the loop's first next(): the epoch-start state must be in place when the loader
    # draws its seeds and shuffle, and the saved state right after the first remaining batch is
    # fetched, exactly where the interrupted run stood.
    restore_rng_state(position.epoch_start_rng, dataloader)
    _set_loader_iteration(dataloader, position.loader_iteration)
    if replay:
        iterator = iter(dataloader)
        for _ in range(position.step):
            if next(iterator, _END) is _END:
                break
    else:
        iterator = iter(_skip_first_batches(dataloader, position.step))
    first = next(iterator, _END)
    restore_rng_state(position.rng, dataloader)
    if first is not _END:
        yield first
        yield from iterator
    if not replay and position.loader_iteration is not None:
        # the skipping loader counted this pass; the trainer's loader continues from it
        _set_loader_iteration(dataloader, position.loader_iteration + 1)


def _skip_first_batches(dataloader, num_batches: int):
    """An iterable over ``dataloader`` without its first ``num_batches`` batches, skipping them
    at the sampler level when the loader has a batch sampler (indices are drawn, so the random
    streams advance as in the full pass, but no sample is loaded)."""
    if isinstance(dataloader, DataLoaderSlice):
        remaining = max(dataloader.slice_size - num_batches, 0)
        return itertools.islice(_skip_first_batches(dataloader.dl, num_batches), remaining)
    if isinstance(dataloader, DeviceLoader):
        return DeviceLoader(_skip_first_batches(dataloader.dataloader, num_batches), dataloader.device)
    if isinstance(dataloader, DataLoader) and num_batches > 0:
        from accelerate import skip_first_batches

        return skip_first_batches(dataloader, num_batches)
    iterator = iter(dataloader)
    for _ in range(num_batches):
        if next(iterator, _END) is _END:
            break
    return iterator
