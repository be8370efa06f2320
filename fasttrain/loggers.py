"""Metric loggers that write from the batched flushes, never per step.

Both loggers record what :class:`fasttrain.callbacks.flush_records.FlushLogger` turns flushes
and run-history updates into: losses by micro-step, gradient norms by optimizer update, run-history
values by epoch. Only the world's process zero writes.

:class:`CSVLoggerCallback` writes one CSV file. :class:`TensorBoardLoggerCallback` is the
TensorBoard case of :class:`fasttrain.callbacks.trackers.AccelerateTrackerCallback`, which sends
the same records to any tracker accelerate supports.
"""

from __future__ import annotations

import csv
import os
from typing import Iterable

from fasttrain.callbacks.flush_records import FlushLogger, Record
from fasttrain.callbacks.trackers import AccelerateTrackerCallback

__all__ = ["CSVLoggerCallback", "TensorBoardLoggerCallback", "Record"]


class CSVLoggerCallback(FlushLogger):
    """Appends metrics to one CSV file with columns ``phase, epoch, kind, step, name, value``.

    ``kind`` says what ``step`` counts: ``micro_step`` (losses), ``update`` (gradient norms) or
    ``epoch`` (run-history values). The file is replaced the first time this callback writes and
    appended to afterwards, so one callback instance gives one file across several ``train()``
    calls. Floats are written with ``repr``, so they read back exactly.
    """

    FIELDS = ("phase", "epoch", "kind", "step", "name", "value")

    def __init__(self, path):
        super().__init__()
        self.path = os.fspath(path)
        self._started = False

    def _write(self, records: Iterable[Record]) -> None:
        mode = "a" if self._started else "w"
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # Opened per write: writes happen once per flush, and the file is complete on disk
        # whenever the trainer stops, however it stops.
        with open(self.path, mode, newline="") as f:
            writer = csv.writer(f)
            if not self._started:
                writer.writerow(self.FIELDS)
                self._started = True
            writer.writerows(records)



class TensorBoardLoggerCallback(AccelerateTrackerCallback):
    """Writes metrics as TensorBoard scalars under ``log_dir``: ``<phase>/loss`` by micro-step,
    ``<phase>/grad_norm`` by update, ``epoch/<name>`` by epoch, through accelerate's
    ``TensorBoardTracker``. Needs the ``tensorboard`` package (``pip install fasttrain[tensorboard]``).
    The event file is closed at the end of each ``train()``; a later run writes a new one."""

    def __init__(self, log_dir):
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "TensorBoardLoggerCallback needs the tensorboard package; install it with "
                "`pip install fasttrain[tensorboard]`"
            )
        self.log_dir = os.fspath(log_dir)
        # an empty run name keeps the event files directly in log_dir
        super().__init__("tensorboard", project_name="", logging_dir=self.log_dir, finish_at_run_end=True)

    def _epoch_done(self) -> None:
        # accelerate's tracker flushes after every log call
        pass

    def close(self) -> None:
        self.finish()
