"""Host-side step metrics, delivered to callbacks in batches.

The trainer never reads a device value on the host inside a step. Per-step values (losses,
gradient norms) stay on the device and are copied to the host together, in one packed transfer,
every ``log_every_n_steps`` optimizer updates and at the end of each epoch. Callbacks receive them
through the ``on_metrics_flush(trainer, metrics)`` event as a :class:`FlushedMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(frozen=True)
class FlushedMetrics:
    """The step metrics gathered since the previous flush, as host values.

    All counts are for this process unless stated otherwise.
    """

    #: ``"train"`` or ``"eval"``.
    phase: str
    #: the run history's epoch (1-based) these steps belong to.
    epoch: int
    #: index of each micro-step within its epoch (0-based), in order.
    step_indices: List[int]
    #: the loss of each micro-step, as returned by ``calculate_*_batch_loss`` (not divided by
    #: the gradient accumulation steps).
    losses: List[float]
    #: the batch size of each micro-step.
    batch_sizes: List[int]
    #: optimizer updates performed so far in this training run.
    num_updates: int
    #: the global gradient norm of each update since the previous flush (before clipping); empty
    #: unless clipping by norm.
    grad_norms: List[float] = field(default_factory=list)
    #: updates skipped so far in this run because their gradients were not finite.
    skipped_updates: int = 0
    #: whether any loss in ``losses`` is NaN or infinite.
    nonfinite: bool = False
    #: batch-size-weighted sum of the losses of this epoch so far, and the samples it covers.
    epoch_loss_sum: float = 0.0
    epoch_sample_count: int = 0
    #: whether this flush closes an epoch.
    is_epoch_end: bool = False
    #: seconds since the previous flush (or since the epoch started).
    elapsed_s: float = 0.0
    #: sum of ``num_items_in_batch`` (e.g. tokens) over these steps, when the loss reported it.
    num_items: Optional[int] = None
    #: ``epoch_loss_sum`` and ``epoch_sample_count`` summed over all processes. With one process
    #: they equal the local values; with several they are all-reduced, together with the stop
    #: decisions, at every training flush (all processes flush at the same update) and at the
    #: end of each evaluation epoch, and are None at intermediate evaluation flushes, whose
    #: timing differs between processes when the evaluation set does not split evenly.
    global_epoch_loss_sum: Optional[float] = None
    global_epoch_sample_count: Optional[int] = None

    @property
    def num_samples(self) -> int:
        """Samples processed in the steps of this flush."""
        return sum(self.batch_sizes)

    @property
    def mean_loss(self) -> float:
        """Batch-size-weighted mean loss of the steps in this flush (NaN when there are none)."""
        total = sum(self.batch_sizes)
        if total == 0:
            return float("nan")
        return sum(l * b for l, b in zip(self.losses, self.batch_sizes)) / total

    @property
    def epoch_mean_loss(self) -> float:
        """Batch-size-weighted mean loss of the epoch so far (NaN before any step)."""
        if self.epoch_sample_count == 0:
            return float("nan")
        return self.epoch_loss_sum / self.epoch_sample_count

    @property
    def global_epoch_mean_loss(self) -> float:
        """The epoch's mean loss over all processes so far; this process's when the global
        totals are not known at this flush."""
        if self.global_epoch_sample_count is None:
            return self.epoch_mean_loss
        if self.global_epoch_sample_count == 0:
            return float("nan")
        return self.global_epoch_loss_sum / self.global_epoch_sample_count
