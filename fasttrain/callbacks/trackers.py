"""Experiment trackers through accelerate's tracking: TensorBoard, W&B, MLflow, Comet, Aim,
ClearML, DVCLive, SwanLab, Trackio, or a custom ``accelerate.tracking.GeneralTracker``.

The callback sends what the batched flushes and the run history deliver (the same records as
:class:`fasttrain.loggers.CSVLoggerCallback`), so a tracker never costs a per-step sync:

- ``<phase>/loss`` at each micro-step, ``<phase>/grad_norm`` at each optimizer update (from
  ``on_metrics_flush``);
- ``epoch/<name>`` for each new run-history value at epoch and run ends.

Trackers are chosen and validated by accelerate's ``filter_trackers`` (the check behind
``Accelerator(log_with=...)``) and started the way ``Accelerator.init_trackers`` starts them; only
the world's process zero creates them or writes.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, Iterable, List, Optional

from fasttrain.callbacks.flush_records import FlushLogger, Record, is_main_process

__all__ = ["AccelerateTrackerCallback"]


def _tag(record: Record) -> str:
    phase, _epoch, kind, _step, name, _value = record
    return f"epoch/{name}" if kind == "epoch" else f"{phase}/{name}"


class AccelerateTrackerCallback(FlushLogger):
    """Logs metrics to every tracker in ``log_with``.

    :param log_with: what ``Accelerator(log_with=...)`` takes: a tracker name (``"tensorboard"``,
        ``"wandb"``, ``"mlflow"``, ``"comet_ml"``, ``"aim"``, ``"clearml"``, ``"dvclive"``, ...),
        ``"all"``, a ``GeneralTracker`` instance, or a list of these.
    :param project_name: the run/project name given to each tracker (``init_trackers``'s
        ``project_name``).
    :param logging_dir: where file-based trackers (TensorBoard, Aim, MLflow's file store) write.
    :param config: hyper-parameters stored once when the trackers start.
    :param init_kwargs: per-tracker constructor arguments, e.g. ``{"wandb": {"mode": "offline"}}``.

    The trackers start at the first training or evaluation run and stay open across later
    ``train()`` calls (one run in the tracker); call :meth:`finish` when done, or pass
    ``finish_at_run_end=True`` to close them at the end of each ``train()`` and ``evaluate()``.
    """

    def __init__(
        self,
        log_with,
        project_name: str = "fasttrain",
        logging_dir=None,
        config: Optional[dict] = None,
        init_kwargs: Optional[Dict[str, dict]] = None,
        finish_at_run_end: bool = False,
    ):
        super().__init__()
        from accelerate.tracking import filter_trackers

        if not isinstance(project_name, str):
            raise TypeError(f"project_name must be a string, got {type(project_name).__name__}")
        if init_kwargs is not None and not isinstance(init_kwargs, dict):
            raise TypeError(
                "init_kwargs must map a tracker name to its keyword arguments, e.g. "
                f"{{'wandb': {{'mode': 'offline'}}}}; got {type(init_kwargs).__name__}"
            )
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        # accelerate's own check: unknown names and trackers whose package is missing are
        # reported here, at construction, not in the middle of a run
        self.log_with = filter_trackers(log_with, self.logging_dir)
        if not self.log_with:
            raise ValueError(
                f"No tracker in log_with={log_with!r} can run here: install the tracker's package "
                "(e.g. `pip install tensorboard`, `pip install mlflow-skinny`, `pip install wandb`)"
            )
        self.project_name = project_name
        self.config = dict(config) if config is not None else None
        self.init_kwargs = dict(init_kwargs or {})
        self.finish_at_run_end = finish_at_run_end
        self.trackers: List = []

    # -- tracker life cycle
    def start(self) -> None:
        """Create and start the trackers (what ``Accelerator.init_trackers`` does)."""
        if self.trackers:
            return
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

        trackers = []
        for tracker in self.log_with:
            if isinstance(tracker, GeneralTracker):
                trackers.append(tracker)
                continue
            cls = LOGGER_TYPE_TO_CLASS[str(tracker)]
            kwargs = self.init_kwargs.get(str(tracker), {})
            if cls.requires_logging_directory:
                trackers.append(cls(self.project_name, self.logging_dir, **kwargs))
            else:
                trackers.append(cls(self.project_name, **kwargs))
        for tracker in trackers:
            tracker.start()
        if self.config is not None:
            for tracker in trackers:
                tracker.store_init_configuration(self.config)
        self.trackers = trackers

    def finish(self) -> None:
        """Close every tracker (flush files, end the tracker's run)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()

    def get_tracker(self, name: str):
        """The started tracker called ``name`` (its ``.tracker`` is the library's own object)."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker
        raise ValueError(f"No started tracker named {name!r}; started: {[t.name for t in self.trackers]}")

    # -- events
    def on_training_run_start(self, trainer, **kwargs):
        super().on_training_run_start(trainer, **kwargs)
        if is_main_process(trainer):
            self.start()

    def on_evaluation_run_start(self, trainer, **kwargs):
        self.on_training_run_start(trainer, **kwargs)

    def on_training_run_end(self, trainer, **kwargs):
        super().on_training_run_end(trainer, **kwargs)
        if self.finish_at_run_end:
            self.finish()

    def on_evaluation_run_end(self, trainer, **kwargs):
        super().on_evaluation_run_end(trainer, **kwargs)
        if self.finish_at_run_end:
            self.finish()

    def _write(self, records: Iterable[Record]) -> None:
        if not self.trackers:
            self.start()
        # one log call per step: trackers such as W&B expect one row per step
        by_step: Dict[tuple, dict] = defaultdict(dict)
        for record in records:
            _phase, _epoch, kind, step, _name, value = record
            by_step[(kind, step)][_tag(record)] = value
        for (kind, step), values in by_step.items():
            for tracker in self.trackers:
                if tracker.name == "wandb":
                    # W&B drops rows whose step is below one already logged; losses (by
                    # micro-step), norms (by update) and epoch values have separate x axes, so
                    # each row carries its own axis value instead
                    phase = next(iter(values)).split("/", 1)[0]
                    axis = "epoch" if kind == "epoch" else f"{phase}/{kind}"
                    tracker.log({**values, axis: step})
                else:
                    tracker.log(values, step=step)
