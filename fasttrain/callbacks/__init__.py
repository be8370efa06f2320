"""Callbacks: the event system and the built-in callbacks.

Events fire in the order documented in ``docs/migrating.md``; each callback event fires after the
trainer hook of the same moment, and callbacks run in list order.

Per-step events (``on_train_step_start``, ``on_train_step_end``, ``on_eval_step_start``,
``on_eval_step_end``) are dispatched only to callbacks that override them, from a table rebuilt
whenever the callbacks change (``add_callback``, or any change to ``CallbackHandler.callbacks``),
so a callback that does nothing per step costs nothing per step.

None of the built-in callbacks reads a device value per step. Step losses, gradient norms and the
non-finite flag reach them as host values through the batched ``on_metrics_flush`` event
(:class:`fasttrain.metrics.FlushedMetrics`), every ``log_every_n_steps`` updates and at epoch ends.
"""

from fasttrain.callbacks.checkpoints import (
    ModelEmaCallback,
    SaveBestModelCallback,
    SaveTrainingStateCallback,
    WSDCheckpointCallback,
)
from fasttrain.callbacks.control import (
    ConvertSyncBatchNormCallback,
    EarlyStoppingCallback,
    LimitBatchesCallback,
    LimitEvalStepsCallback,
    StepBasedEvaluationCallback,
)
from fasttrain.callbacks.defaults import (
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    TerminateOnNaNCallback,
    get_default_callbacks,
)
from fasttrain.callbacks.events import (
    EVENTS,
    PER_STEP_EVENTS,
    CallbackHandler,
    CallbackMethodNotImplementedError,
    StopTrainingError,
    TrainerCallback,
)
# pytorch-accelerated's callbacks module also offers these helpers under its own path
from fasttrain.tracking import LossTracker
from fasttrain.utils import DataLoaderSlice, ModelEma
from tqdm import tqdm
from fasttrain.callbacks.device_metrics import DeviceMetricsCallback
from fasttrain.callbacks.trackers import AccelerateTrackerCallback

__all__ = [
    "TrainerCallback",
    "CallbackHandler",
    "StopTrainingError",
    "CallbackMethodNotImplementedError",
    "get_default_callbacks",
    "MoveModulesToDeviceCallback",
    "TerminateOnNaNCallback",
    "PrintProgressCallback",
    "ProgressBarCallback",
    "LogMetricsCallback",
    "SaveBestModelCallback",
    "EarlyStoppingCallback",
    "ModelEmaCallback",
    "ConvertSyncBatchNormCallback",
    "StepBasedEvaluationCallback",
    "LimitEvalStepsCallback",
    "LimitBatchesCallback",
    "SaveTrainingStateCallback",
    "WSDCheckpointCallback",
    "AccelerateTrackerCallback",
    "DeviceMetricsCallback",
    "EVENTS",
    "PER_STEP_EVENTS",
    "LossTracker",
    "DataLoaderSlice",
    "ModelEma",
    "tqdm",
]
