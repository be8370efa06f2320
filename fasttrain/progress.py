"""The counters of one training run: its updates, where its epoch stands, where a resume continues.

The Trainer owns one :class:`TrainProgress` (``trainer.progress``), which every ``train()``
resets in place. The training loops (loops.py, and lightning/loops.py for the Lightning runner)
advance the update count and the step in the epoch; the flush (step_metrics.py) adds the skipped
updates; resume.py records the epoch in progress, its random state and the point a resumed run
continues from; nonfinite.py sets its flag; checkpointing.py, signals.py and the progress bar
read them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class TrainProgress:
    """Where one ``train()`` call stands.

    :param num_updates: optimizer updates so far, skipped ones included (``Trainer.num_updates``).
    :param skipped_updates: updates that ``nonfinite="skip"`` dropped, counted at flushes
        (``Trainer.skipped_updates``).
    :param step_in_epoch: the index of the micro-step running; between micro-steps, the batches
        of the epoch consumed.
    :param run_first_epoch: the epoch this run started at (not 1 after ``train(...,
        reset_run_history=False)``); a resumed run keeps the saved run's.
    :param epoch_in_progress: the epoch whose training part has started, None before the first.
    :param epoch_start_rng: the random state at the start of that epoch, from which its sampler
        drew the batch order (``resume.capture_rng_state``).
    :param epoch_start_loader_iteration: the pass count of accelerate's loader at that moment.
    :param resume_position: where a resumed run continues (a ``resume.ResumePosition``), None
        once the loop has reached it.
    :param resumed_from: the training state this run resumed from (a path as a string), None
        for a run that started from the beginning.
    :param nonfinite_applied: an update with non-finite values was applied since the last good
        state, so no training state may be saved in this run.
    """

    num_updates: int = 0
    skipped_updates: int = 0
    step_in_epoch: int = 0
    run_first_epoch: int = 1
    epoch_in_progress: Optional[int] = None
    epoch_start_rng: Optional[dict] = None
    epoch_start_loader_iteration: Optional[int] = None
    resume_position: Any = None
    resumed_from: Optional[str] = None
    nonfinite_applied: bool = False

    def reset(self) -> None:
        """Back to the values of a new Trainer, in place: the step context reads this object."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)

    def state_dict(self) -> dict:
        """The update counts, under the keys of a training state's metadata. The position in the
        run is saved beside them by ``resume.capture_position``."""
        return {"num_updates": self.num_updates, "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the counts of :meth:`state_dict` (or of a training state's whole metadata); a
        missing key counts 0."""
        self.num_updates = state_dict.get("num_updates", 0)
        self.skipped_updates = state_dict.get("skipped_updates", 0)
