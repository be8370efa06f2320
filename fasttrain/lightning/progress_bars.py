"""Lightning's progress bars as Lightning's callbacks: ``TQDMProgressBar``, ``RichProgressBar``
or a ``ProgressBar`` of your own runs through the same hooks as under ``lightning.Trainer``;
``enable_progress_bar=True`` without one adds Lightning's default (``RichProgressBar`` when
``rich`` is installed, else ``TQDMProgressBar``).

The bars' batch counters (``batch_idx``, ``total_train_batches``, ``total_val_batches``, ...)
are host values and move every batch. The metrics they show (``get_metrics``, which reads
``trainer.progress_bar_metrics``) are host numbers read from the device on fasttrain's schedule
(see :class:`ProgressBarMetrics`), never per batch.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

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
        callbacks.append(RichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar())


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

    def get(self) -> dict:
        return self._read() if self._host is None else self._host

    def _read(self) -> dict:
        connector = self._connector
        # one packed copy (to_host); while a bar runs, only at the flushes and epoch ends
        return to_host(connector._refreshed(connector._progress_bar_metrics, "pbar"))
