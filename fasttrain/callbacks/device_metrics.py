"""torchmetrics metrics updated on the device every step, computed only at epoch ends.

pytorch-accelerated's docs compute metrics with a per-step ``.item()`` or ``gather``, which makes
the host wait for the device on every batch. A torchmetrics ``Metric`` keeps its state (counts,
sums) in device tensors and its ``update`` only adds to them, so updating it per step queues
device work and nothing else. ``compute()`` is where the host reads the state, and, with several
processes, where torchmetrics all-gathers it (``sync_on_compute``), so the value is the metric
over every process's samples. :class:`DeviceMetricsCallback` calls ``update`` per step and
``compute`` once per epoch, and records the values in the run history.

Checks inside ``update`` can read device values, a sync per step: classification metrics take
``validate_args=False`` to skip theirs (they look at the values of the targets), aggregation
metrics (``MeanMetric``, ``SumMetric``...) ``nan_strategy="disable"`` (the default looks for NaN).
"""

from __future__ import annotations

import copy

from typing import Callable, Dict, Iterable, Mapping, Optional

import torch

from fasttrain.callbacks.events import TrainerCallback

__all__ = ["DeviceMetricsCallback", "default_metric_inputs"]

PHASES = ("train", "eval")


def default_metric_inputs(batch, batch_output):
    """``(preds, target)`` for ``metric.update``: the model outputs of ``calculate_*_batch_loss``
    and the second element of the batch, as in the default ``calculate_*_batch_loss``."""
    return batch_output["model_outputs"], batch[1]


class DeviceMetricsCallback(TrainerCallback):
    """Updates torchmetrics metrics every step, computes them at epoch ends.

    :param metrics: ``{name: torchmetrics.Metric}`` (or a ``MetricCollection``, whose own names
        are used). The callback moves them to the trainer's device.
    :param phases: where to update: ``"train"``, ``"eval"`` or both (default ``("eval",)``).
    :param inputs: ``inputs(batch, batch_output) -> tuple`` of the arguments of ``update``
        (default :func:`default_metric_inputs`); it runs every step, so it must not read device
        values.

    At each epoch end of a phase, each metric is computed (one host read and, with several
    processes, one all-gather per metric) and recorded in the run history as
    ``<phase>_<name>_epoch`` (``intermediate_eval_<name>_epoch`` for evaluations in the middle
    of an epoch, ``evaluation_<name>`` for ``trainer.evaluate()``), then reset. A metric that
    computes several numbers records one value per element: ``<phase>_<name>_<i>_epoch``.
    :meth:`compute` gives the running values in between (for example at a training flush, which
    every process reaches together); like ``Metric.compute`` it must run on every process.
    With both phases, evaluation updates copies of the metrics (:attr:`phase_metrics`).
    """

    def __init__(
        self,
        metrics: Mapping,
        *,
        phases: Iterable[str] = ("eval",),
        inputs: Optional[Callable] = None,
    ):
        try:
            from torchmetrics import Metric
        except ImportError as exc:  # pragma: no cover - torchmetrics is a declared extra
            raise ImportError("DeviceMetricsCallback needs torchmetrics: `pip install fasttrain[metrics]`") from exc
        items = dict(metrics.items()) if hasattr(metrics, "items") else None
        if not items:
            raise ValueError("DeviceMetricsCallback needs metrics as a non-empty {name: torchmetrics.Metric} dict")
        bad = sorted(name for name, m in items.items() if not isinstance(m, Metric))
        if bad:
            raise TypeError(f"DeviceMetricsCallback: {bad} are not torchmetrics.Metric instances")
        phases = (phases,) if isinstance(phases, str) else tuple(phases)
        unknown = sorted(set(phases) - set(PHASES))
        if unknown or not phases:
            raise ValueError(f"DeviceMetricsCallback: phases must be among {PHASES}, got {phases!r}")
        self.phases = phases
        self.inputs = inputs or default_metric_inputs
        # one set of metric objects per phase (the first phase gets the ones given), so that an
        # evaluation in the middle of a training epoch does not mix into the training values
        self.phase_metrics: Dict[str, Dict[str, "Metric"]] = {
            phase: items if i == 0 else {n: copy.deepcopy(m) for n, m in items.items()}
            for i, phase in enumerate(phases)
        }
        self.metrics = self.phase_metrics[phases[0]]
        self._updated = {phase: False for phase in phases}
        self._evaluating = False

    # -- helpers
    def _to_device(self, trainer) -> None:
        for metrics in self.phase_metrics.values():
            for name, metric in metrics.items():
                metrics[name] = metric.to(trainer.device)
                metric.reset()
        self._updated = {phase: False for phase in self.phases}

    def _update(self, phase: str, batch, batch_output) -> None:
        args = self.inputs(batch, batch_output)
        for metric in self.phase_metrics[phase].values():
            metric.update(*args)  # device work only: adds to the metric's state tensors
        self._updated[phase] = True

    def compute(self, phase: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """The metrics of ``phase`` (default: the first of ``phases``) over everything updated
        since the last reset, as device tensors."""
        metrics = self.phase_metrics[phase or self.phases[0]]
        return {name: metric.compute() for name, metric in metrics.items()}

    def _record(self, trainer, phase: str, prefix: str, suffix: str) -> None:
        if not self._updated.get(phase):
            return
        self._updated[phase] = False
        for name, value in self.compute(phase).items():
            # SYNC(epoch-end): one read of each computed metric for the run history
            values = torch.as_tensor(value).detach().flatten().tolist()
            if len(values) == 1:
                trainer.run_history.update_metric(f"{prefix}{name}{suffix}", values[0])
            else:
                for i, v in enumerate(values):
                    trainer.run_history.update_metric(f"{prefix}{name}_{i}{suffix}", v)
        for metric in self.phase_metrics[phase].values():
            metric.reset()

    # -- events
    def on_training_run_start(self, trainer, **kwargs):
        self._to_device(trainer)

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        if "train" in self._updated:
            self._update("train", batch, batch_output)

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        if "eval" in self._updated:
            self._update("eval", batch, batch_output)

    def on_train_epoch_end(self, trainer, **kwargs):
        self._record(trainer, "train", "train_", "_epoch")

    def on_eval_epoch_end(self, trainer, is_intermediate=False, **kwargs):
        if is_intermediate:
            self._record(trainer, "eval", "intermediate_eval_", "_epoch")
        elif self._evaluating:
            self._record(trainer, "eval", "evaluation_", "")
        else:
            self._record(trainer, "eval", "eval_", "_epoch")

    def on_evaluation_run_start(self, trainer, **kwargs):
        self._to_device(trainer)
        self._evaluating = True

    def on_evaluation_run_end(self, trainer, **kwargs):
        self._evaluating = False
