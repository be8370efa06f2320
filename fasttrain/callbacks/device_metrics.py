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
On a GPU the updates run under :class:`~fasttrain.callbacks.sync_free_metrics.SyncFreeUpdates`:
``torch.bincount`` (which reads its input's range back on CUDA) is replaced by a scatter-add, and
a metric whose update still syncs is named in a warning.

Model outputs are kept only where a metric asks for them: the default inputs pass
``batch_output["model_outputs"]``, which under the graphed engine lives in graph memory that the
next replay overwrites. A metric that adds into counters reads it before that replay (stream
order), so it gets the tensor as it is; a metric that keeps its inputs in lists (``CatMetric``,
``AUROC`` or ``AveragePrecision`` without thresholds) gets a copy, made only where the graphed
engine runs the phase.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, Iterable, Mapping, Optional

import torch

from fasttrain.callbacks.events import TrainerCallback
from fasttrain.callbacks.sync_free_metrics import SyncFreeUpdates, host_reads_matter

__all__ = ["DeviceMetricsCallback", "default_metric_inputs"]

PHASES = ("train", "eval")


def keeps_inputs(metric) -> bool:
    """Whether ``metric`` keeps its update's tensors (list states, concatenated at compute)
    rather than adding them into counters."""
    return any(isinstance(default, list) for default in getattr(metric, "_defaults", {}).values())


def inputs_outlive_the_step(engine_name: Optional[str]) -> bool:
    """Whether a tensor of a step's ``batch_output`` may be overwritten by a later step: under the
    graphed engine the outputs live in graph memory each replay writes again."""
    return engine_name == "cudagraph"


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
        #: the phases whose model outputs the updates read: asked for, the graphed engine keeps
        #: them (``inputs`` may read them, whatever it is)
        self.model_outputs_phases = phases
        # one set of metric objects per phase (the first phase gets the ones given), so that an
        # evaluation in the middle of a training epoch does not mix into the training values
        self.phase_metrics: Dict[str, Dict[str, "Metric"]] = {
            phase: items if i == 0 else {n: copy.deepcopy(m) for n, m in items.items()}
            for i, phase in enumerate(phases)
        }
        self.metrics = self.phase_metrics[phases[0]]
        self._updated = {phase: False for phase in phases}
        self._evaluating = False
        self._sync_free = False
        self._warned_syncs = set()

    # -- helpers
    def _to_device(self, trainer) -> None:
        for metrics in self.phase_metrics.values():
            for name, metric in metrics.items():
                metrics[name] = metric.to(trainer.device)
                metric.reset()
        self._updated = {phase: False for phase in self.phases}
        self._sync_free = host_reads_matter(trainer.device)

    def _update(self, trainer, phase: str, batch, batch_output) -> None:
        args = self.inputs(batch, batch_output)
        engine = getattr(trainer, "active_engine" if phase == "train" else "active_eval_engine", None)
        copied = None
        for name, metric in self.phase_metrics[phase].items():
            metric_args = args
            if keeps_inputs(metric) and inputs_outlive_the_step(engine):
                if copied is None:  # one copy per step, shared by the metrics that keep it
                    copied = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
                metric_args = copied
            if not self._sync_free:
                metric.update(*metric_args)  # device work only: adds to the metric's state tensors
                continue
            with SyncFreeUpdates() as mode:
                metric.update(*metric_args)
            if mode.synced and name not in self._warned_syncs:
                self._warned_syncs.add(name)
                warnings.warn(
                    f"fasttrain: the update of metric {name!r} reads device values on the host "
                    f"({', '.join(sorted(set(mode.synced)))}), a synchronisation every step. Pass "
                    "validate_args=False (classification) or nan_strategy='disable' (aggregation), "
                    "or compute this metric from values kept another way.",
                    RuntimeWarning,
                    stacklevel=2,
                )
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
            self._update(trainer, "train", batch, batch_output)

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        if "eval" in self._updated:
            self._update(trainer, "eval", batch, batch_output)

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
