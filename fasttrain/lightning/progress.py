"""The progress bar of ``enable_progress_bar=True``: one tqdm bar per training epoch, moved at
fasttrain's flushes (every ``log_every_n_steps`` stepping batches and at the epoch end) rather
than every batch, so it never reads a device value between flushes. It shows the values logged
with ``prog_bar=True``."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from fasttrain.lightning.loggers import to_host


class EpochProgress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.shown = 0

    def start_epoch(self, epoch: int, total: int) -> None:
        if not self.enabled:
            return
        self.close()
        self.bar = tqdm(total=total, desc=f"Epoch {epoch}", dynamic_ncols=True, leave=True, file=sys.stderr)
        self.shown = 0

    def update(self, batches_done: int, pbar_metrics: dict) -> None:
        if self.bar is None:
            return
        if pbar_metrics:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in to_host(pbar_metrics).items()}, refresh=False)
        # tqdm redraws at most every ``mininterval`` (0.1 s): a forced redraw at every flush
        # costs more than the flush; close() draws the final state
        self.bar.update(batches_done - self.shown)
        self.shown = batches_done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
