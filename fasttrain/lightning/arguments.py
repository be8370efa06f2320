"""``fasttrain.lightning.Trainer(...)``'s arguments: Lightning's names and defaults, checked once.

Only the arguments fasttrain honours are accepted. Any other name (one Lightning knows but
fasttrain does not implement, or a typo) is an error that names it, so nothing a user sets is
silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.setup import _determine_batch_limits, _parse_time_interval_seconds
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from fasttrain.lightning.ckpt_files import is_remote
from fasttrain.lightning.combined import CombinedData
from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.plugins import Plugins, read_plugins
from fasttrain.lightning.strategy import check_devices_argument, parse_strategy


PRECISIONS = {
    None: "no", 32: "no", "32": "no", "32-true": "no",
    "bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16", 16: "fp16", "16": "fp16",
}
# Lightning's legacy spellings of the mixed modes: accepted with its warning naming the current one
_DISCOURAGED_PRECISIONS = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed"}
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
GRADIENT_CLIP_ALGORITHMS = (None, "norm", "value")

# Lightning arguments that fasttrain does not implement: an error names them (with why, where
# a user would expect it to work)
_NOT_SUPPORTED = {
    "sync_batchnorm": "convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm first",
    "benchmark": "set torch.backends.cudnn.benchmark yourself",
    "model_registry": "not available",
    "enable_autolog_hparams": "hyperparameters always go to the loggers, as with Lightning's default",
}
#: the value of each of those that asks for nothing (Lightning's default): taken, as a config
#: written by Lightning's CLI or a dict of Lightning's defaults gives it
_NOT_SUPPORTED_OFF = {"sync_batchnorm": False, "benchmark": None, "model_registry": None, "enable_autolog_hparams": True}

# Lightning's barebones opt-outs: (argument, the value barebones sets, what Lightning's error says)
_BAREBONES_OFF = (
    ("enable_checkpointing", False, "Checkpointing can impact raw speed so it is disabled in barebones mode."),
    ("logger", False, "Logging can impact raw speed so it is disabled in barebones mode."),
    ("enable_progress_bar", False, "The progress bar can impact raw speed so it is disabled in barebones mode."),
    ("log_every_n_steps", 0, "Logging can impact raw speed so it is disabled in barebones mode."),
    ("enable_model_summary", False, "Model summary can impact raw speed so it is disabled in barebones mode."),
    ("num_sanity_val_steps", 0, "Sanity checking can impact raw speed so it is disabled in barebones mode."),
    ("fast_dev_run", False,
     "Development run is not meant for raw speed evaluation so it is disabled in barebones mode."),
)

_BAREBONES_DEACTIVATED = (
    " - Checkpointing: `Trainer(enable_checkpointing=True)`",
    " - Progress bar: `Trainer(enable_progress_bar=True)`",
    " - Model summary: `Trainer(enable_model_summary=True)`",
    " - Logging: `Trainer(logger=True)`, `Trainer(log_every_n_steps>0)`,"
    " `LightningModule.log(...)`, `LightningModule.log_dict(...)`",
    " - Sanity checking: `Trainer(num_sanity_val_steps>0)`",
    " - Development run: `Trainer(fast_dev_run=True)`",
    " - Anomaly detection: `Trainer(detect_anomaly=True)`",
    " - Profiling: `Trainer(profiler=...)`",
)


def _batch_limit(name: str, value):
    """Lightning's reading of a ``limit_*_batches``-style value (1.0 for None; its info message
    for an explicit 1 or 1.0), after fasttrain's type check."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be an int (batches) or a float in [0, 1] (a fraction), got {value!r}")
    if value is not None and value < 0:
        raise LightningConfigError(f"You have passed invalid value {value} for {name}, it has to be in [0.0, 1.0] or an int.")
    try:
        return _determine_batch_limits(value, name)
    except MisconfigurationException as error:
        raise LightningConfigError(str(error)) from None


def loader_length(loader):
    """``len(loader)``, or ``inf`` for an iterable without a length (Lightning's count: also
    when ``len()`` raises ``NotImplementedError``)."""
    length = sized_len(loader)
    return float("inf") if length is None else length


def num_batches(stage, loader, limit, processes: int = 1):
    """Lightning's count of the batches a loop takes from ``loader`` under ``limit`` (its
    errors for a fractional limit on a loader without a length, or a fraction giving no batch);
    with several processes each takes every world-th batch. Combined loaders: each one counted
    so, the counts combined by the mode."""
    if isinstance(loader, CombinedData):
        return loader.count(lambda part: num_batches(stage, part, limit, processes))
    length = loader_length(loader)
    if processes > 1 and length != float("inf"):
        length = math.ceil(length / processes)
    try:
        return _parse_num_batches(stage, length, limit)
    except MisconfigurationException as error:
        raise LightningConfigError(str(error)) from None


def check_interval_fits_epoch(interval, lt) -> None:
    """A batch count ``val_check_interval`` longer than an epoch (with validation counted per
    epoch), or a fraction of an epoch of unknown length: Lightning's errors, once the training
    data is loaded."""
    if (
        lt._val_check_time_interval is None and isinstance(interval, float) and interval != 1.0
        and lt.num_training_batches == float("inf")
    ):
        raise MisconfigurationException(  # Lightning's own type and words
            "When using an IterableDataset for `train_dataloader`,"
            " `Trainer(val_check_interval)` must be time based, `1.0` or an int. An int k specifies"
            " checking validation every k training batches."
        )
    if (
        lt._val_check_time_interval is None and isinstance(interval, int) and interval > lt.num_training_batches
        and lt.check_val_every_n_epoch is not None and lt.limit_val_batches > 0
    ):
        raise ValueError(  # Lightning's own type and words
            f" `val_check_interval` ({interval}) must be less than or equal"
            f" to the number of the training batches ({lt.num_training_batches})."
            " If you want to disable validation set `limit_val_batches` to 0.0 instead."
            " If you want to validate based on the total training batches, set `check_val_every_n_epoch=None`."
        )


@dataclass
class TrainerArguments:
    """The validated arguments. fasttrain's own options are the last block."""

    accelerator: str = "auto"
    strategy: Any = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: Any = None
    logger: Any = None
    callbacks: Any = None
    fast_dev_run: Any = False
    max_epochs: Optional[int] = None
    min_epochs: Optional[int] = None
    max_steps: int = -1
    min_steps: Optional[int] = None
    max_time: Any = None
    limit_train_batches: Union[int, float, None] = None
    limit_val_batches: Union[int, float, None] = None
    limit_test_batches: Union[int, float, None] = None
    limit_predict_batches: Union[int, float, None] = None
    overfit_batches: Union[int, float] = 0.0
    val_check_interval: Any = None
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
    barebones: bool = False
    reload_dataloaders_every_n_epochs: int = 0
    default_root_dir: Any = None
    enable_autolog_hparams: bool = True
    plugins: Any = None
    detect_anomaly: bool = False
    inference_mode: bool = True
    use_distributed_sampler: bool = True
    profiler: Any = None
    # fasttrain's own
    engine: str = "auto"
    compile_options: Optional[dict] = None
    nonfinite: str = "ignore"
    mixed_precision: str = field(init=False, default="no")
    #: seconds between validations for a time-based val_check_interval, else None
    val_check_seconds: Optional[float] = field(init=False, default=None)
    #: what ``plugins`` chose
    plugin_set: Plugins = field(init=False, default=None)

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
        self.plugin_set = read_plugins(self.plugins, self.precision)
        if self.plugin_set.mixed_precision is not None:
            self.mixed_precision = self.plugin_set.mixed_precision
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"accelerator={self.accelerator!r} but CUDA is not available on this machine; use "
                "accelerator='cpu', or 'auto' to train on a GPU when there is one"
            )
        self.strategy = parse_strategy(self.strategy)
        check_devices_argument(self.devices, self.accelerator, self.strategy)
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise LightningConfigError(f"`num_nodes` must be a positive integer, but got {self.num_nodes}.")
        if self.barebones:
            self._barebones_opt_outs()
        else:
            self.num_sanity_val_steps = 2 if self.num_sanity_val_steps is None else self.num_sanity_val_steps
            self.log_every_n_steps = 50 if self.log_every_n_steps is None else self.log_every_n_steps
        # Lightning keeps max_epochs None here and decides 1000 or -1 when a fit starts
        # below -1: Lightning's error; another type fails deep in Lightning's loop (an assertion),
        # here a clear error
        if self.max_epochs is not None and (isinstance(self.max_epochs, bool) or not isinstance(self.max_epochs, int)):
            raise ValueError(f"max_epochs must be an int >= -1 (-1: no limit), got {self.max_epochs!r}")
        if self.max_epochs is not None and self.max_epochs < -1:
            raise LightningConfigError(
                f"`max_epochs` must be a non-negative integer or -1. You passed in {self.max_epochs}."
            )
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            raise ValueError(f"max_steps must be an int >= -1 (-1: no limit), got {self.max_steps!r}")
        if self.max_steps < -1:
            raise LightningConfigError(
                f"`max_steps` must be a non-negative integer or -1 (infinite steps). You passed in {self.max_steps}."
            )
        for name in ("min_epochs", "min_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        if self.max_time is not None and not isinstance(self.max_time, (str, timedelta, dict)):
            raise TypeError(
                f"max_time must be a 'DD:HH:MM:SS' string, a datetime.timedelta or a dict of timedelta arguments, "
                f"got {self.max_time!r}"
            )
        if not self.use_distributed_sampler and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # the launch (torchrun, accelerate launch) has several processes
            raise ValueError(
                "use_distributed_sampler=False with several processes is not supported: fasttrain shards every "
                "dataloader over the processes through accelerate (each process takes every world-th batch). "
                "Leave use_distributed_sampler=True and pass the unsharded loaders, or train this run with "
                "lightning.Trainer."
            )
        if self.detect_anomaly:
            rank_zero_info(
                "You have turned on `Trainer(detect_anomaly=True)`. This will significantly slow down compute speed and"
                " is recommended only for model debugging."
            )
        self._debugging_flags()
        if self.check_val_every_n_epoch is not None and (
            not isinstance(self.check_val_every_n_epoch, int) or self.check_val_every_n_epoch < 1
        ):
            raise LightningConfigError(
                f"`check_val_every_n_epoch` should be an integer, found {self.check_val_every_n_epoch!r}."
            )
        if self.check_val_every_n_epoch is None and isinstance(self.val_check_interval, float):
            raise LightningConfigError(
                "`val_check_interval` should be an integer or a time-based duration (str 'DD:HH:MM:SS', "
                "datetime.timedelta, or dict kwargs for timedelta) when `check_val_every_n_epoch=None`."
            )
        if not isinstance(self.reload_dataloaders_every_n_epochs, int) or self.reload_dataloaders_every_n_epochs < 0:
            raise LightningConfigError(
                "`reload_dataloaders_every_n_epochs` should be an int >= 0, got "
                f"{self.reload_dataloaders_every_n_epochs}."
            )
        if not isinstance(self.num_sanity_val_steps, int) or self.num_sanity_val_steps < -1:
            raise ValueError(f"num_sanity_val_steps must be an int >= -1 (-1: all), got {self.num_sanity_val_steps!r}")
        if not isinstance(self.log_every_n_steps, int) or self.log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be an int >= 0, got {self.log_every_n_steps!r}")
        for name in ("enable_checkpointing", "enable_progress_bar", "enable_model_summary"):
            value = getattr(self, name)
            setattr(self, name, True if value is None else value)
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if not isinstance(self.accumulate_grad_batches, int) or self.accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be a positive int, got {self.accumulate_grad_batches!r}")
        algorithm = self.gradient_clip_algorithm
        if algorithm is not None and (
            not isinstance(algorithm, str) or algorithm.lower() not in GRADIENT_CLIP_ALGORITHMS
        ):
            raise LightningConfigError(
                f"`gradient_clip_algorithm` {algorithm} is invalid. "
                f"Allowed algorithms: {GradClipAlgorithmType.supported_types()}."
            )
        self.gradient_clip_algorithm = algorithm.lower() if algorithm is not None else None
        if self.gradient_clip_val is not None and not isinstance(self.gradient_clip_val, numbers.Real):
            # Lightning's type and words
            raise TypeError(f"`gradient_clip_val` should be an int or a float. Got {self.gradient_clip_val}.")
        if self.gradient_clip_val is not None and (isinstance(self.gradient_clip_val, bool) or self.gradient_clip_val < 0):
            raise ValueError(f"gradient_clip_val must be a non-negative number or None, got {self.gradient_clip_val!r}")
        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic must be None, True, False or 'warn', got {self.deterministic!r}")
        root = self.default_root_dir
        # Lightning expands "~" in a local default_root_dir (its file system layer does) and
        # keeps a URL of another file system as it is
        if root is None:
            self.default_root_dir = os.getcwd()
        elif is_remote(root):
            self.default_root_dir = os.fspath(root)
        else:
            self.default_root_dir = os.path.normpath(os.path.expanduser(os.fspath(root)))

    def _barebones_opt_outs(self) -> None:
        """Lightning's ``barebones=True``: each feature that costs speed is off, and asking for
        one of them is Lightning's ``ValueError``."""
        for name, off, why in _BAREBONES_OFF:
            value = getattr(self, name)
            if name in ("log_every_n_steps", "num_sanity_val_steps"):
                wanted = value is not None and value != 0
            elif name == "logger":
                wanted = value is not None and value is not False
            elif name == "fast_dev_run":
                wanted = value is not False and value != 0
            else:
                wanted = bool(value)
            if wanted:
                raise ValueError(f"`Trainer(barebones=True, {name}={value!r})` was passed. {why}")
            setattr(self, name, off)
        if self.detect_anomaly:
            raise ValueError(
                f"`Trainer(barebones=True, detect_anomaly={self.detect_anomaly!r})` was passed."
                " Anomaly detection can impact raw speed so it is disabled in barebones mode."
            )
        if self.profiler is not None:
            raise ValueError(
                f"`Trainer(barebones=True, profiler={self.profiler!r})` was passed."
                " Profiling can impact raw speed so it is disabled in barebones mode."
            )
        rank_zero_info(
            "You are running in `Trainer(barebones=True)` mode. All features that may impact raw speed have been"
            " disabled to facilitate analyzing the Trainer overhead. Specifically, the following features are"
            f" deactivated:{os.linesep}{os.linesep.join(_BAREBONES_DEACTIVATED)}"
        )

    def _debugging_flags(self) -> None:
        """``fast_dev_run``, ``overfit_batches``, the batch limits and ``val_check_interval``, as
        Lightning reads them (its info messages included)."""
        run = self.fast_dev_run
        if isinstance(run, bool) or run is None:
            run = bool(run)
        elif not isinstance(run, int):
            raise TypeError(f"fast_dev_run must be a bool or an int, got {run!r}")
        elif run < 0:
            raise LightningConfigError(f"fast_dev_run={run!r} is not a valid configuration. It should be >= 0.")
        self.fast_dev_run = True if run == 1 else run
        self.overfit_batches = _batch_limit("overfit_batches", self.overfit_batches)
        overfit = self.overfit_batches > 0
        interval = self.val_check_interval
        if run:
            batches = int(run)
            if not overfit:
                self.limit_train_batches = self.limit_val_batches = batches
            self.limit_test_batches = self.limit_predict_batches = batches
            self.max_steps, self.max_epochs = batches, 1
            self.num_sanity_val_steps = 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            rank_zero_info(
                f"Running in `fast_dev_run` mode: will run the requested loop using {batches} batch(es). "
                "Logging and checkpointing is suppressed."
            )
        else:
            if not overfit:
                self.limit_train_batches = _batch_limit("limit_train_batches", self.limit_train_batches)
                self.limit_val_batches = _batch_limit("limit_val_batches", self.limit_val_batches)
            self.limit_test_batches = _batch_limit("limit_test_batches", self.limit_test_batches)
            self.limit_predict_batches = _batch_limit("limit_predict_batches", self.limit_predict_batches)
            if isinstance(interval, (str, dict, timedelta)):
                try:
                    self.val_check_seconds = _parse_time_interval_seconds(interval)
                except (MisconfigurationException, TypeError) as error:
                    raise LightningConfigError(str(error)) from None
            else:
                # a negative value is Lightning's error (below); 0 fails deep in Lightning's loop
                # (a division by zero), here a clear error
                if isinstance(interval, bool) or not isinstance(interval, (numbers.Real, type(None))) or (
                    interval is not None and interval == 0
                ):
                    raise ValueError(
                        "val_check_interval must be a positive int (batches), a float in (0, 1], or a time "
                        f"('DD:HH:MM:SS', a timedelta or a dict of timedelta arguments), got {interval!r}"
                    )
                self.val_check_interval = _batch_limit("val_check_interval", interval)
        if overfit:
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches


#: TrainerArguments' fields that the Trainer derives (no argument of that name is taken)
_INTERNAL = ("mixed_precision", "val_check_seconds", "plugin_set")


def own_arguments(lightning_names) -> dict:
    """The arguments ``fasttrain.lightning.Trainer`` takes beside Lightning's (``lightning_names``):
    name -> (type, default)."""
    types = typing.get_type_hints(TrainerArguments)
    return {
        field.name: (types[field.name], field.default)
        for field in dataclasses.fields(TrainerArguments)
        if field.name not in _INTERNAL and field.name not in lightning_names
    }


def parse_arguments(kwargs: dict) -> TrainerArguments:
    """``TrainerArguments`` from the keyword arguments given to ``Trainer``, over the defaults
    Lightning reads from ``PL_TRAINER_<ARGUMENT>`` environment variables (a given argument wins,
    as in Lightning); an unknown name is a ``TypeError`` naming it, and so is an unsupported one
    given anything but Lightning's default (which asks for nothing: taken)."""
    from lightning.pytorch.trainer.trainer import Trainer as LightningTrainer  # its signature, also where the name is rebound
    from lightning.pytorch.utilities.argparse import _parse_env_variables

    kwargs = {**vars(_parse_env_variables(LightningTrainer)), **kwargs}
    known = {name for name in TrainerArguments.__dataclass_fields__ if name not in _INTERNAL}
    for name in list(kwargs):
        if name in _NOT_SUPPORTED:
            if kwargs[name] is _NOT_SUPPORTED_OFF[name]:
                if name not in TrainerArguments.__dataclass_fields__:
                    del kwargs[name]
                continue
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
