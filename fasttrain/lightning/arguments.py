"""``fasttrain.lightning.Trainer(...)``'s arguments: Lightning's names and defaults, checked once.

Only the arguments fasttrain honours are accepted. Any other name (one Lightning knows but
fasttrain does not implement, or a typo) is an error that names it, so nothing a user sets is
silently ignored.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn

PRECISIONS = {
    None: "no", 32: "no", "32": "no", "32-true": "no",
    "bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16", 16: "fp16", "16": "fp16",
}
# Lightning's legacy spellings of the mixed modes: accepted with its warning naming the current one
_DISCOURAGED_PRECISIONS = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed"}
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
STRATEGIES = ("auto", "ddp", "fsdp")
GRADIENT_CLIP_ALGORITHMS = (None, "norm", "value")

# Lightning arguments that fasttrain does not implement: an error names them (with why, where
# a user would expect it to work)
_NOT_SUPPORTED = {
    "fast_dev_run": "set max_steps and limit_val_batches instead",
    "min_epochs": "fasttrain stops at max_epochs/max_steps or when a callback sets should_stop",
    "min_steps": "fasttrain stops at max_epochs/max_steps or when a callback sets should_stop",
    "max_time": "use max_steps",
    "overfit_batches": "pass a small dataset instead",
    "num_nodes": "launch the processes with accelerate launch or torchrun",
    "plugins": "precision and distribution go through accelerate (precision=, strategy=)",
    "profiler": "use torch.profiler around fit()",
    "detect_anomaly": "wrap fit() in torch.autograd.detect_anomaly()",
    "barebones": "fasttrain's logging costs no per-step sync; leave it out",
    "sync_batchnorm": "convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm first",
    "reload_dataloaders_every_n_epochs": "dataloaders are loaded once per fit()",
    "use_distributed_sampler": "accelerate shards the dataloaders",
    "benchmark": "set torch.backends.cudnn.benchmark yourself",
    "inference_mode": "evaluation runs under torch.no_grad",
    "model_registry": "not available",
}


def _fraction_or_count(name: str, value, allow_zero: bool = True):
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an int (batches) or a float in [0, 1] (a fraction), got {value!r}")
    if isinstance(value, numbers.Integral):
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{name} must be a non-negative number of batches, got {value}")
        return int(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} as a float is a fraction of the batches and must be in [0, 1], got {value}")
    return float(value)


def limited_batches(limit, available: int) -> int:
    """How many batches a ``limit_*_batches`` value lets through out of ``available``."""
    if isinstance(limit, int):
        return min(limit, available)
    if limit == 1.0 or math.isinf(available):
        return available
    return int(available * limit)


@dataclass
class TrainerArguments:
    """The validated arguments. fasttrain's own options are the last block."""

    accelerator: str = "auto"
    strategy: str = "auto"
    devices: Any = "auto"
    precision: Any = None
    logger: Any = None
    callbacks: Any = None
    max_epochs: Optional[int] = None
    max_steps: int = -1
    limit_train_batches: Union[int, float, None] = None
    limit_val_batches: Union[int, float, None] = None
    limit_test_batches: Union[int, float, None] = None
    limit_predict_batches: Union[int, float, None] = None
    val_check_interval: Union[int, float, None] = None
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: Optional[int] = None
    log_every_n_steps: Optional[int] = None
    enable_checkpointing: Optional[bool] = None
    enable_progress_bar: Optional[bool] = None
    enable_model_summary: Optional[bool] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Union[int, float, None] = None
    gradient_clip_algorithm: Optional[str] = None
    deterministic: Any = None
    default_root_dir: Any = None
    # fasttrain's own
    engine: str = "auto"
    compile_options: Optional[dict] = None
    nonfinite: str = "ignore"
    mixed_precision: str = field(init=False, default="no")

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not supported; use one of '32-true', 'bf16-mixed', '16-mixed'"
            )
        if self.precision in _DISCOURAGED_PRECISIONS:
            rank_zero_warn(
                f"`precision={self.precision}` is supported for historical reasons but its usage is discouraged. "
                f"Please set your precision to {_DISCOURAGED_PRECISIONS[self.precision]} instead!",
                stacklevel=8,  # through rank_zero_warn's wrappers to the Trainer(...) call
            )
        self.mixed_precision = PRECISIONS[self.precision]
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"accelerator={self.accelerator!r} but CUDA is not available on this machine; use "
                "accelerator='cpu', or 'auto' to train on a GPU when there is one"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {STRATEGIES} (distribution runs through accelerate), got {self.strategy!r}"
            )
        if self.max_epochs is None:
            self.max_epochs = 1000 if self.max_steps == -1 else -1
        if not isinstance(self.max_epochs, int) or self.max_epochs < -1:
            raise ValueError(f"max_epochs must be an int >= -1 (-1: no limit), got {self.max_epochs!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < -1:
            raise ValueError(f"max_steps must be an int >= -1 (-1: no limit), got {self.max_steps!r}")
        if self.max_epochs == -1 and self.max_steps == -1:
            raise ValueError("max_epochs=-1 needs a max_steps; otherwise training never ends")
        self.limit_train_batches = _fraction_or_count("limit_train_batches", self.limit_train_batches)
        self.limit_val_batches = _fraction_or_count("limit_val_batches", self.limit_val_batches)
        self.limit_test_batches = _fraction_or_count("limit_test_batches", self.limit_test_batches)
        self.limit_predict_batches = _fraction_or_count("limit_predict_batches", self.limit_predict_batches)
        interval = 1.0 if self.val_check_interval is None else self.val_check_interval
        if isinstance(interval, bool) or not isinstance(interval, numbers.Real) or interval <= 0:
            raise ValueError(f"val_check_interval must be a positive int (batches) or a float in (0, 1], got {interval!r}")
        if isinstance(interval, float) and interval > 1.0:
            raise ValueError(f"val_check_interval as a float is a fraction of an epoch and must be <= 1, got {interval}")
        self.val_check_interval = interval
        if self.check_val_every_n_epoch is not None and (
            not isinstance(self.check_val_every_n_epoch, int) or self.check_val_every_n_epoch < 1
        ):
            raise ValueError(f"check_val_every_n_epoch must be a positive int or None, got {self.check_val_every_n_epoch!r}")
        self.num_sanity_val_steps = 2 if self.num_sanity_val_steps is None else self.num_sanity_val_steps
        if not isinstance(self.num_sanity_val_steps, int) or self.num_sanity_val_steps < -1:
            raise ValueError(f"num_sanity_val_steps must be an int >= -1 (-1: all), got {self.num_sanity_val_steps!r}")
        self.log_every_n_steps = 50 if self.log_every_n_steps is None else self.log_every_n_steps
        if not isinstance(self.log_every_n_steps, int) or self.log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be an int >= 0, got {self.log_every_n_steps!r}")
        for name in ("enable_checkpointing", "enable_progress_bar", "enable_model_summary"):
            value = getattr(self, name)
            setattr(self, name, True if value is None else value)
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if not isinstance(self.accumulate_grad_batches, int) or self.accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be a positive int, got {self.accumulate_grad_batches!r}")
        if self.gradient_clip_algorithm not in GRADIENT_CLIP_ALGORITHMS:
            raise ValueError(
                f"gradient_clip_algorithm must be 'norm' or 'value', got {self.gradient_clip_algorithm!r}"
            )
        if self.gradient_clip_val is not None and (
            isinstance(self.gradient_clip_val, bool)
            or not isinstance(self.gradient_clip_val, numbers.Real)
            or self.gradient_clip_val < 0
        ):
            raise ValueError(f"gradient_clip_val must be a non-negative number or None, got {self.gradient_clip_val!r}")
        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic must be None, True, False or 'warn', got {self.deterministic!r}")
        self.default_root_dir = os.fspath(self.default_root_dir) if self.default_root_dir is not None else os.getcwd()


def parse_arguments(kwargs: dict) -> TrainerArguments:
    """``TrainerArguments`` from the keyword arguments given to ``Trainer``; an unknown or
    unsupported name is a ``TypeError`` naming it."""
    known = {name for name in TrainerArguments.__dataclass_fields__ if name != "mixed_precision"}
    for name in kwargs:
        if name in _NOT_SUPPORTED:
            raise TypeError(
                f"fasttrain.lightning.Trainer does not support the argument {name!r} ({_NOT_SUPPORTED[name]}). "
                "Remove it, or train this run with lightning.Trainer."
            )
        if name not in known:
            raise TypeError(
                f"fasttrain.lightning.Trainer got an unknown argument {name!r}; the supported ones are "
                f"{', '.join(sorted(known))}."
            )
    return TrainerArguments(**kwargs)
