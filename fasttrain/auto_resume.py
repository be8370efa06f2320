"""Resuming on start: ``train(..., resume_from="latest")``.

A job that a launcher restarts after a failure (``torchrun --max-restarts``, a SLURM requeue)
runs the same script again. With ``resume_from="latest"`` that script continues from the newest
complete training state of the run, or starts from scratch when the run has none yet, so the
same command serves the first start and every restart.

The run's states are where it writes them: the ``save_dir`` of each
:class:`~fasttrain.callbacks.SaveTrainingStateCallback` (its periodic states and, under
``interrupted``, the state a stop signal saves) and ``Trainer(interrupt_save_dir=...)``. A state
counts only when it is complete (``checkpointing.find_latest_training_state``): a save killed
half-way never left anything under a state's name, and is never chosen.

With several processes the first one looks and tells the others what it found (one broadcast of
a path), so that every process resumes from the same state even while a save or a rotation of
old states changes the directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import torch

from fasttrain import checkpointing
from fasttrain.callbacks import SaveTrainingStateCallback

#: the value of ``resume_from`` that looks for the newest state of the run
LATEST = "latest"


def state_directories(trainer) -> List[Path]:
    """Where ``trainer`` writes its training states: every ``SaveTrainingStateCallback``'s
    ``save_dir``, then ``interrupt_save_dir`` when it is set."""
    found = [Path(cb.save_dir) for cb in trainer.callback_handler.callbacks if isinstance(cb, SaveTrainingStateCallback)]
    if trainer.interrupt_save_dir is not None:
        found.append(Path(trainer.interrupt_save_dir))
    return found


def resolve(trainer, resume_from):
    """The training state ``train(..., resume_from=...)`` resumes from: ``resume_from`` itself
    when it names one, the newest complete state of the run (or None: a fresh start) for
    ``"latest"``. Every process gets the same answer."""
    if resume_from is None:
        return None
    if not isinstance(resume_from, (str, os.PathLike)):
        raise TypeError(
            f"resume_from must be the directory of a training state, {LATEST!r} or None, got "
            f"{type(resume_from).__name__}"
        )
    if not (isinstance(resume_from, str) and resume_from == LATEST):
        return resume_from  # a path, as in pytorch-accelerated (Path("latest") is a path too)
    directories = state_directories(trainer)
    if not directories:
        raise ValueError(
            f"train(..., resume_from={LATEST!r}) resumes from the newest training state in the "
            "run's state directory, and this trainer writes none: add "
            "SaveTrainingStateCallback(save_dir=...) to its callbacks or set "
            "Trainer(interrupt_save_dir=...), or pass the directory of a state as resume_from."
        )

    def newest():
        found = checkpointing.find_latest_training_state(*directories)
        return None if found is None else os.fspath(found)

    chosen = decided_by_first_process(newest)
    where = ", ".join(map(os.fspath, directories))
    if chosen is None:
        trainer.print(f"No complete training state in {where}: training starts from the beginning.")
    return chosen


def decided_by_first_process(decide, everywhere: bool = False):
    """``decide()`` run on the first process and its value (a path, None, any small picklable
    value) given to every process, so that no process lists a directory while another writes to
    it and all take the same decision. An error there is raised on every process: none is left
    waiting for the answer. With ``everywhere`` every process runs ``decide()`` too (for its side
    effects, such as warnings or forgetting a setting) and still takes the first process's value;
    an error in its own ``decide()`` is raised after the answer was shared."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return decide()
    first = torch.distributed.get_rank() == 0
    own, error = None, None
    if first or everywhere:
        try:
            own = ("found", decide())
        except Exception as e:  # told to the others (from the first process), then raised here
            own, error = ("error", f"{type(e).__name__}: {e}"), e
    answer = [own if first else None]
    torch.distributed.broadcast_object_list(answer, src=0)
    if error is not None:
        raise error
    kind, value = answer[0]
    if kind == "error":
        raise checkpointing.CheckpointError(f"Choosing the state to resume from failed on process 0: {value}")
    return value
