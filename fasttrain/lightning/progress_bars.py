"""Lightning's progress bars as Lightning's callbacks: ``TQDMProgressBar``, ``RichProgressBar``
or a ``ProgressBar`` of your own runs through the same hooks as under ``lightning.Trainer``.
``enable_progress_bar=True`` without one adds :class:`EpochProgressBar`, a ``ProgressBar`` (so
``trainer.progress_bar_callback`` and its counters are Lightning's) that draws one tqdm bar per
training epoch at tqdm's own pace: Lightning's default bars redraw after every batch, which on a
step of a few hundred microseconds of host work costs more than the step (``RichProgressBar``
about 0.18 ms per batch on a 2-core CPU). Pass ``TQDMProgressBar()`` or ``RichProgressBar()``
for Lightning's look.

The bars' batch counters (``batch_idx``, ``total_train_batches``, ``total_val_batches``, ...)
are host values and move every batch. The metrics they show (``get_metrics``, which reads
``trainer.progress_bar_metrics``) are host numbers read from the device on fasttrain's schedule
(see :class:`ProgressBarMetrics`), never per batch.
"""

from __future__ import annotations

import math
import sys

from lightning.pytorch.callbacks import ProgressBar
from tqdm.auto import tqdm

from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.loggers import to_host


def configure_progress_bar(callbacks: list, enabled: bool) -> None:
    """Lightning's rule: one bar at most; a bar given with ``enable_progress_bar=False`` is its
    error; with none given and the bar enabled, its default bar joins ``callbacks``."""
    bars = [cb for cb in callbacks if isinstance(cb, ProgressBar)]
    if len(bars) > 1:
        raise LightningConfigError(
            "You added multiple progress bar callbacks to the Trainer, but currently only one"
            " progress bar is supported."
        )
    if bars:
        if not enabled:
            raise LightningConfigError(
                "Trainer was configured with `enable_progress_bar=False`"
                f" but found `{bars[0].__class__.__name__}` in callbacks list."
            )
        return
    if enabled:
        callbacks.append(EpochProgressBar())


class EpochProgressBar(ProgressBar):
    """fasttrain.lightning's default bar: one tqdm bar per training epoch, advanced every batch
    (a counter; tqdm redraws at most every 0.1 s) and showing the ``prog_bar=True`` values as of
    the last flush (every ``log_every_n_steps`` stepping batches) and the epoch's end."""

    def __init__(self):
        super().__init__()
        self._enabled = True
        self._bar = None
        self._shown_metrics = None

    @property
    def train_progress_bar(self):
        """The tqdm bar of the epoch in progress (None between epochs)."""
        return self._bar

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._close()
        if not self.is_enabled:
            return
        total = self.total_train_batches
        self._bar = tqdm(total=None if math.isinf(total) else int(total), desc=f"Epoch {trainer.current_epoch}",
                         dynamic_ncols=True, leave=True, file=sys.stderr)
        self._shown_metrics = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.advance()

    def advance(self) -> None:
        """A training batch has ended: the bar counts it. The fit loop calls this directly when
        this bar is the hook's only listener (loops.py)."""
        bar = self._bar
        if bar is None:
            return
        bar.update(1)
        # the host copy changes at flushes only (ProgressBarMetrics): a new one is shown
        metrics = self.trainer._pbar_metrics.current()
        if metrics is not self._shown_metrics:
            self._shown_metrics = metrics
            self._set_postfix(metrics)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._bar is not None:
            self._set_postfix(self.get_metrics(trainer, pl_module))
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._close()

    def _set_postfix(self, metrics: dict) -> None:
        shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in metrics.items() if k != "v_num"}
        self._bar.set_postfix(shown, refresh=False)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressBarMetrics:
    """``trainer.progress_bar_metrics``: the values logged with ``prog_bar=True``, as host numbers.

    With a progress bar, which reads them after every batch (Lightning reads each with
    ``.item()`` there), they are copied from the device in one packed read at each flush (every
    ``log_every_n_steps`` stepping batches), at the training epoch's end and at an evaluation's
    end, and read from that copy in between. Without a bar, a read (by your code) copies the
    current values then.
    """

    def __init__(self, connector):
        self._connector = connector
        #: host values as of the last refresh; None: no bar, read on demand
        self._host = None

    def start_run(self, has_bar: bool) -> None:
        self._host = {} if has_bar else None

    def refresh(self) -> None:
        """The flush: the current values to the host (a bar runs), else nothing."""
        if self._host is not None:
            self._host = self._read()

    def clear(self) -> None:
        """The host copy emptied, as the connector's dicts are (after the sanity check)."""
        if self._host is not None:
            self._host = {}

    def get(self) -> dict:
        return self._read() if self._host is None else self._host

    def current(self) -> dict:
        """The host copy as of the last refresh, the same object until the next one (a bar
        compares it by identity); read from the device now only without a bar."""
        return self.get()

    def _read(self) -> dict:
        connector = self._connector
        # one packed copy (to_host); while a bar runs, only at the flushes and epoch ends
        return to_host(connector._refreshed(connector._progress_bar_metrics, "pbar"))
