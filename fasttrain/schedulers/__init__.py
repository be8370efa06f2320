"""Learning-rate schedulers stepped once per optimizer update."""

from fasttrain.schedulers.cosine_scheduler import CosineLrScheduler
from fasttrain.schedulers.scheduler_base import (
    SchedulerBase,
    SchedulerConfigError,
    StatefulSchedulerBase,
    set_param_group_value,
)
from fasttrain.schedulers.wsd_scheduler import WSDLrScheduler, estimate_checkpoint_steps

__all__ = [
    "CosineLrScheduler",
    "SchedulerBase",
    "SchedulerConfigError",
    "StatefulSchedulerBase",
    "WSDLrScheduler",
    "estimate_checkpoint_steps",
    "set_param_group_value",
]
