"""Flushes and run-history updates as records, the shared front half of every metric logger.

A record is ``(phase, epoch, kind, step, name, value)``:

- every micro-step loss from ``on_metrics_flush``, at its global micro-step (1-based, counted over
  every training call the logger has seen, per phase, so curves of successive runs follow
  each other instead of overlapping);
- every gradient norm from the flush (present when clipping by norm), at its optimizer update
  (1-based, the trainer's own count);
- each new value in the run history (epoch losses, and whatever other callbacks record) at the
  end of train and eval epochs and of runs, at the run history's epoch.

Only the world's process zero writes.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from fasttrain.callbacks.events import TrainerCallback

__all__ = ["Record", "FlushLogger", "is_main_process"]

#: (phase, epoch, kind, step, name, value); kind is "micro_step", "update" or "epoch".
Record = Tuple[str, int, str, int, str, float]


def is_main_process(trainer) -> bool:
    config = getattr(trainer, "run_config", None)
    if config is not None:
        return bool(config.is_world_process_zero)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


class FlushLogger(TrainerCallback):
    """Turns flushes and run-history updates into :data:`Record` tuples for :meth:`_write`."""

    def __init__(self):
        self._micro_steps: Dict[str, int] = {}
        self._history_written: Dict[str, int] = {}

    def _write(self, records: List[Record]) -> None:
        raise NotImplementedError

    def _epoch_done(self) -> None:
        """Called after epoch-end writes; a place to flush files."""

    # -- events
    def on_training_run_start(self, trainer, **kwargs):
        # The run history was reset (or kept, with reset_run_history=False) before this event:
        # either way, what is in it now has been written or belongs to an earlier run.
        self._history_written = {
            name: len(trainer.run_history.get_metric_values(name)) for name in trainer.run_history.get_metric_names()
        }

    on_evaluation_run_start = on_training_run_start

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if not is_main_process(trainer):
            return
        records = self.flush_records(metrics)
        if records:
            self._write(records)

    def on_train_epoch_end(self, trainer, **kwargs):
        self._write_history(trainer, "train")

    def on_eval_epoch_end(self, trainer, **kwargs):
        self._write_history(trainer, "eval")

    def on_training_run_end(self, trainer, **kwargs):
        self._write_history(trainer, "train")

    def on_evaluation_run_end(self, trainer, **kwargs):
        self._write_history(trainer, "eval")

    # -- record building
    def flush_records(self, metrics) -> List[Record]:
        """The records for one :class:`~fasttrain.metrics.FlushedMetrics`."""
        phase, epoch = metrics.phase, metrics.epoch
        records: List[Record] = []
        step = self._micro_steps.get(phase, 0)
        for loss in metrics.losses:
            step += 1
            records.append((phase, epoch, "micro_step", step, "loss", loss))
        self._micro_steps[phase] = step
        first_update = metrics.num_updates - len(metrics.grad_norms) + 1
        for i, norm in enumerate(metrics.grad_norms):
            records.append((phase, epoch, "update", first_update + i, "grad_norm", norm))
        return records

    def _write_history(self, trainer, phase: str) -> None:
        if not is_main_process(trainer):
            return
        history = trainer.run_history
        epoch = history.current_epoch
        records: List[Record] = []
        for name in sorted(history.get_metric_names()):
            values = list(history.get_metric_values(name))
            done = self._history_written.get(name, 0)
            if done > len(values):  # the history was reset without a run-start event
                done = 0
            for value in values[done:]:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    records.append((phase, epoch, "epoch", epoch, name, value))
            self._history_written[name] = len(values)
        if records:
            self._write(records)
        self._epoch_done()
