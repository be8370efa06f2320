"""``callback_metrics``, ``logged_metrics`` and the loggers, fed from the device-side results.

The metric dicts are built when someone reads them (a callback, the epoch end), not after every
batch; the loggers get host values once every ``log_every_n_steps`` stepping batches and at epoch
ends, in one packed device-to-host copy of all logged values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Dict

import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger


def build_loggers(logger, root_dir: str) -> list:
    """Lightning's ``logger=`` argument as a list of loggers (``True``/``None``: TensorBoard when
    installed, else CSV, under ``default_root_dir``)."""
    if logger is None or logger is True:
        try:
            import tensorboard  # noqa: F401

            return [TensorBoardLogger(save_dir=root_dir)]
        except ImportError:
            return [CSVLogger(save_dir=root_dir)]
    # Lightning's reading: an iterable (by the collections.abc test, so an object with only
    # __getitem__ is not iterated, which could index it forever) is a list of loggers, anything
    # else one logger; neither is type-checked, so a duck-typed logger works, and an object that
    # is no logger fails where Lightning's fails, when the run first uses it
    if not logger:  # False, or an empty list
        return []
    if isinstance(logger, Iterable):
        return list(logger)
    return [logger]


def to_host(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """All values as Python floats in one device-to-host copy."""
    if not metrics:
        return {}
    names = list(metrics)
    values = [metrics[name].detach().reshape(()).to(torch.float64) for name in names]
    # SYNC(flush): loggers need host numbers; one packed copy for all logged values
    host = torch.stack(values).tolist()
    return dict(zip(names, host))


class LoggerConnector:
    """``trainer._logger_connector``: what ``LightningModule.log`` and Lightning's callbacks use."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._current_fx = None
        self.on_step = True  # training batches report step values until the epoch end
        self.eval_epoch_ended = False
        self._callback_metrics: dict = {}
        self._logged_metrics: dict = {}
        self._progress_bar_metrics: dict = {}

    def should_reset_tensors(self, fx: str) -> bool:
        return False  # the loops reset each result store at the start of its epoch

    @property
    def should_update_logs(self) -> bool:
        trainer = self.trainer
        if trainer.log_every_n_steps == 0:
            return False
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % trainer.log_every_n_steps == 0 or trainer.should_stop

    def _current(self):
        results = self.trainer._results
        if results is None:
            return None
        if results.training:
            return results.metrics(self.on_step)
        if not self.eval_epoch_ended:
            return None  # evaluation values reach callbacks at the evaluation's epoch end
        return results.metrics(False)

    def _refreshed(self, store: dict, kind: str) -> dict:
        """``store`` with the current values of ``kind`` ("callback", "log" or "pbar") taken in."""
        metrics = self._current()
        if metrics is not None:
            store.update(metrics[kind])
        return store

    @property
    def callback_metrics(self) -> dict:
        return self._refreshed(self._callback_metrics, "callback")

    @property
    def logged_metrics(self) -> dict:
        return self._refreshed(self._logged_metrics, "log")

    @property
    def progress_bar_metrics(self) -> dict:
        return to_host(self._refreshed(self._progress_bar_metrics, "pbar"))

    def absorb(self, results, on_step: bool) -> dict:
        """Take ``results``' current values into the metric dicts; returns the logged ones."""
        metrics = results.metrics(on_step)
        self._callback_metrics.update(metrics["callback"])
        self._logged_metrics.update(metrics["log"])
        self._progress_bar_metrics.update(metrics["pbar"])
        return metrics["log"]

    def reset_metrics(self) -> None:
        self._callback_metrics, self._logged_metrics, self._progress_bar_metrics = {}, {}, {}

    def flush_due(self) -> bool:
        """Whether this stepping batch is a flush: loggers and the progress bar get host values."""
        return self.should_update_logs

    def log_train_step(self) -> None:
        trainer = self.trainer
        if not trainer.loggers:
            return
        self.log_metrics(trainer._train_results.metrics(on_step=True)["log"])

    def log_metrics(self, metrics: dict, step=None) -> None:
        trainer = self.trainer
        if not trainer.loggers or not metrics:
            return
        scalars = to_host(metrics)
        if step is None and "step" in scalars:
            # a value logged as "step" is the loggers' step for these values, as in Lightning
            step = scalars.pop("step")
            metrics = {name: value for name, value in metrics.items() if name != "step"}
        self._logged_metrics.update(metrics)
        if step is None:
            scalars.setdefault("epoch", trainer.current_epoch)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(metrics=scalars, step=step)
            logger.save()
