"""``fasttrain.lightning.Trainer``: fits an unchanged LightningModule on fasttrain's engines.

The object plays the part of ``lightning.Trainer`` for the module and its callbacks (they reach
it as ``self.trainer``): counters, ``callback_metrics``, ``optimizers``, ``strategy``,
``save_checkpoint`` and the rest of what Lightning's own code reads. The work is fasttrain's: a
:class:`~fasttrain.lightning.runner.ModuleRunner` prepares model and optimizer through
accelerate and runs each batch through the chosen step engine; :mod:`.loops` keeps Lightning's
order around it; :mod:`.results` keeps ``self.log`` values on the device.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import (
    Callback,
    Checkpoint,
    EarlyStopping,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    RichModelSummary,
    Timer,
)
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.trainer.connectors.callback_connector import _validate_callbacks_list
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn

from fasttrain.lightning import checkpoint as ckpt_io
from fasttrain.lightning import logged_numbers
from fasttrain.lightning.arguments import LightningConfigError, num_batches, parse_arguments
from fasttrain.lightning.combined import as_given, flat
from fasttrain.lightning.external_callbacks import external_callbacks
from fasttrain.lightning.hooks import HookCaller, check_supported_callbacks, order_callbacks
from fasttrain.lightning.loggers import LoggerConnector, build_loggers, to_host
from fasttrain.lightning.loop_objects import LoopProperties
from fasttrain.lightning.plugins import precision_of_run
from fasttrain.lightning.profiler import build_profiler
from fasttrain.lightning.loader_state import LoaderStates
from fasttrain.lightning.progress_bars import ProgressBarMetrics, configure_progress_bar
from fasttrain.lightning.results import ResultStore
from fasttrain.lightning.runner import ModuleRunner
from fasttrain.lightning.strategy import build_strategy, device_ids


def _stage_flag(stage: RunningStage) -> property:
    """A Trainer flag such as ``trainer.training``: true while ``trainer.state.stage`` is ``stage``;
    setting it True enters the stage, setting it False leaves it (only if it is the current one)."""

    def get(self) -> bool:
        return self.state.stage is stage

    def set(self, value: bool) -> None:
        if value:
            self.state.stage = stage
        elif self.state.stage is stage:
            self.state.stage = None

    return property(get, set)


class Trainer(LoopProperties):
    """Lightning's ``Trainer`` arguments (those fasttrain honours; any other is an error naming
    it) plus fasttrain's keyword options ``engine`` (``"auto"``, ``"eager"``, ``"compiled"``,
    ``"cudagraph"``), ``compile_options`` and ``nonfinite`` (default ``"ignore"``, as Lightning)."""

    def __init__(self, **kwargs):
        args = self._args = parse_arguments(kwargs)
        logged_numbers.install()  # a number self.log gets in a compiled step stays a number there
        self.state = TrainerState()
        self._module = None
        self.num_training_batches = float("inf")  # until a fit loads its training data, as in Lightning
        self._build_loops(args.inference_mode)
        # max_epochs stays None until a fit decides 1000 or -1, as in Lightning
        self.max_epochs, self.max_steps = args.max_epochs, args.max_steps
        self.min_epochs, self.min_steps = args.min_epochs, args.min_steps
        self.accumulate_grad_batches = args.accumulate_grad_batches
        self.gradient_clip_val = args.gradient_clip_val
        self.gradient_clip_algorithm = (
            GradClipAlgorithmType(args.gradient_clip_algorithm) if args.gradient_clip_algorithm else None
        )
        self.fast_dev_run = args.fast_dev_run
        self.overfit_batches = args.overfit_batches
        self.barebones = args.barebones
        self.reload_dataloaders_every_n_epochs = args.reload_dataloaders_every_n_epochs
        self.limit_train_batches, self.limit_val_batches = args.limit_train_batches, args.limit_val_batches
        self.limit_test_batches, self.limit_predict_batches = args.limit_test_batches, args.limit_predict_batches
        self.val_check_interval = args.val_check_interval
        #: seconds between validations (a time-based val_check_interval), else None; Lightning's
        #: name, which ModelCheckpoint reads
        self._val_check_time_interval = args.val_check_seconds
        self._last_val_time = 0.0
        self.check_val_every_n_epoch = args.check_val_every_n_epoch
        # Lightning reads -1 ("all batches") as inf
        self.num_sanity_val_steps = float("inf") if args.num_sanity_val_steps == -1 else args.num_sanity_val_steps
        self.log_every_n_steps = args.log_every_n_steps
        self.default_root_dir = args.default_root_dir
        self.enable_autolog_hparams = args.enable_autolog_hparams
        device = args.strategy.device  # SingleDeviceStrategy(device=...)
        self._force_cpu = args.accelerator == "cpu" or (device is not None and device.type == "cpu")
        if args.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=args.deterministic == "warn")
        self.callbacks = self._build_callbacks(args)
        self._loggers = []
        self.loggers = build_loggers(args.logger, self.default_root_dir)
        if self.fast_dev_run:
            # Lightning swaps the loggers for one that records nothing
            self.loggers = [DummyLogger()] if self.loggers else []
        #: messages Lightning gives once per trainer (its warning cache)
        self._said: set = set()
        #: the epoch each fit loader was last requested at, and how to request it again
        #: (reload_dataloaders_every_n_epochs)
        self._train_reloaded_epoch = self._val_reloaded_epoch = float("-inf")
        self._reload_train_data = self._reload_val_data = None
        self.profiler = build_profiler(args.profiler)
        self.precision_plugin, args.mixed_precision = precision_of_run(
            args.plugin_set, args.mixed_precision, planned_device(self).type
        )
        #: a CheckpointIO plugin's, else None (fasttrain's atomic torch.save and torch.load)
        self._checkpoint_io = args.plugin_set.checkpoint_io
        #: Lightning's accelerator object for the run's device (isinstance checks, device stats)
        self.accelerator = CPUAccelerator() if planned_device(self).type == "cpu" else CUDAAccelerator()
        self.strategy = build_strategy(self, args.strategy, self.accelerator)
        self.should_stop = False
        self.received_sigterm = False
        self._logger_connector = LoggerConnector(self)
        self._pbar_metrics = ProgressBarMetrics(self._logger_connector)
        self._accelerator_connector = _AcceleratorConnector()
        self._train_results = ResultStore(training=True)
        self._val_results = ResultStore(training=False)
        self._test_results = ResultStore(training=False)
        self._active_eval_results = None
        self._runner: Optional[ModuleRunner] = None
        self.datamodule = None
        self.optimizers: list = []
        self.lr_scheduler_configs: list = []
        #: the checkpoint the last run loaded (None: none), or the one set through trainer.ckpt_path
        self._ckpt_path = None
        self._ckpt_path_user_managed = False
        #: loads the fit's training data when something reads the estimate before the fit
        #: loads it (configure_optimizers); None once loaded
        self._load_train_data = None
        #: the loss scaler's state from the checkpoint a fit resumes from, loaded once the fit's
        #: accelerator (and its scaler) exists
        self._scaler_state = None
        self._device = torch.device("cpu")
        self._train_loader = None
        #: the training loaders' own states, saved in checkpoints and loaded on resume (loader_state.py)
        self._loader_states = LoaderStates()
        self._val_loaders: list = []
        self._test_loaders: list = []
        self._predict_loaders: list = []
        self._eval_step_name = "validation_step"
        self._eval_dataloader_idx = None
        self._hooks: Optional[HookCaller] = None
        #: what strategy.backward calls on_before_backward / on_after_backward through: the
        #: HookCaller, or GraphedBackwardHooks in a fit on the graphed engine
        self._backward_hooks = None
        #: whether no backward hook does anything (decided when a fit starts)
        self._plain_backward_hooks = True
        #: whether the attached module defines validation_step (decided when a run attaches it)
        self._has_val_step = False
        #: whether the module or a callback zeroes gradients in its own hooks (decided when a fit
        #: starts; an evaluation's engine reads it too)
        self._own_zero_grad = False
        #: requests the fit's validation loaders when no sanity check does (see run_data.load_data)
        self._load_val_later = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_callbacks(args) -> list:
        """The run's callbacks: ``callbacks=`` (a list, or one callback, as Lightning takes it), a
        ``ModelCheckpoint`` added when checkpointing is on and none is given, the progress bar, a
        ``ModelSummary`` when the summary is on and none is given, checkpoints last."""
        given = args.callbacks
        callbacks = [given] if isinstance(given, Callback) else list(given or [])
        if args.enable_checkpointing and not any(isinstance(cb, Checkpoint) for cb in callbacks):
            callbacks.append(ModelCheckpoint())
        elif not args.enable_checkpointing and any(isinstance(cb, Checkpoint) for cb in callbacks):
            raise LightningConfigError(
                "Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list."
            )
        if args.max_time is not None:
            if any(isinstance(cb, Timer) for cb in callbacks):
                rank_zero_info("Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer.")
            else:
                callbacks.append(Timer(duration=args.max_time, interval="step"))
        # callbacks that installed packages register for every Trainer (the entry point group
        # Lightning reads)
        configure_progress_bar(callbacks, args.enable_progress_bar)
        if args.enable_model_summary:
            summaries = [type(cb) for cb in callbacks if isinstance(cb, ModelSummary)]
            if summaries:
                rank_zero_info(
                    f"Trainer already configured with model summary callbacks: {summaries}."
                    " Skipping setting a default `ModelSummary` callback."
                )
            else:  # Lightning's default: its table at on_fit_start (rich's where rich is installed)
                callbacks.append(RichModelSummary() if _RICH_AVAILABLE else ModelSummary())
        callbacks.extend(external_callbacks())
        check_supported_callbacks(callbacks)
        _validate_callbacks_list(callbacks)
        return order_callbacks(callbacks)

    # ------------------------------------------------------------------ what modules and callbacks read
    @property
    def lightning_module(self):
        return self._module

    @property
    def model(self):
        return self._module

    # the running stage, as Lightning keeps it: trainer.state.stage, which these flags set and
    # read (identity tests: read by self.log on every call)
    training = _stage_flag(RunningStage.TRAINING)
    sanity_checking = _stage_flag(RunningStage.SANITY_CHECKING)
    validating = _stage_flag(RunningStage.VALIDATING)
    testing = _stage_flag(RunningStage.TESTING)
    predicting = _stage_flag(RunningStage.PREDICTING)

    @property
    def evaluating(self) -> bool:
        return self.state.stage is not None and self.state.stage.evaluating

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank() if _distributed() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size() if _distributed() else 1

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def ckpt_path(self):
        """The checkpoint the last ``fit``/``validate``/``test``/``predict`` loaded; assigning
        one makes the next run load it (Lightning's stateful ``ckpt_path``)."""
        return self._ckpt_path

    @ckpt_path.setter
    def ckpt_path(self, path) -> None:
        self._ckpt_path = path
        self._ckpt_path_user_managed = bool(path)

    @property
    def logger(self):
        return self._loggers[0] if self._loggers else None

    @logger.setter
    def logger(self, logger) -> None:
        # Lightning's setter: a falsy value removes every logger
        self._loggers = [logger] if logger else []

    @property
    def loggers(self) -> list:
        return self._loggers

    @loggers.setter
    def loggers(self, loggers) -> None:
        self._loggers = list(loggers) if loggers else []

    @property
    def log_dir(self) -> str:
        logger = self.logger
        if logger is None:
            return self.default_root_dir
        return getattr(logger, "log_dir", None) or logger.save_dir

    @property
    def checkpoint_callbacks(self) -> list:
        return [cb for cb in self.callbacks if isinstance(cb, Checkpoint)]

    @property
    def checkpoint_callback(self):
        callbacks = self.checkpoint_callbacks
        return callbacks[0] if callbacks else None

    @property
    def early_stopping_callback(self):
        callbacks = self.early_stopping_callbacks
        return callbacks[0] if callbacks else None

    @property
    def early_stopping_callbacks(self) -> list:
        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def scaler(self):
        """The fp16 loss scaler of the run's precision plugin (None without one), as Lightning's."""
        return getattr(self.precision_plugin, "scaler", None)

    @property
    def _results(self):
        if self._active_eval_results is not None:
            return self._active_eval_results
        fn = self.state.fn
        # read by every self.log: the identity test spares the string comparison of the enum
        return self._train_results if fn is TrainerFn.FITTING or fn == TrainerFn.FITTING else None

    @property
    def callback_metrics(self) -> dict:
        return self._logger_connector.callback_metrics

    @property
    def logged_metrics(self) -> dict:
        return self._logger_connector.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict:
        """Host numbers; with a progress bar, as of the last flush (see progress_bars.py)."""
        return self._pbar_metrics.get()

    @property
    def enable_validation(self) -> bool:
        # loaders not requested yet (a fit without a sanity check requests them when it first validates)
        loaded = bool(self._val_loaders) or self._load_val_later is not None
        return loaded and self._has_val_step and self.limit_val_batches != 0

    @property
    def num_val_batches(self) -> list:
        return [num_batches(RunningStage.VALIDATING, dl, self.limit_val_batches) for dl in flat(self._val_loaders)]

    @property
    def num_test_batches(self) -> list:
        return [num_batches(RunningStage.TESTING, dl, self.limit_test_batches) for dl in flat(self._test_loaders)]

    @property
    def num_predict_batches(self) -> list:
        return [num_batches(RunningStage.PREDICTING, dl, self.limit_predict_batches) for dl in flat(self._predict_loaders)]

    @property
    def val_check_batch(self):
        if self._val_check_time_interval is not None:
            return None  # time-based: Lightning has no batch cadence then
        interval = self.val_check_interval
        if isinstance(interval, int):
            return interval
        if self.num_training_batches == float("inf"):
            return float("inf")  # 1.0 over data of unknown length (other fractions are an error at the fit's start)
        return max(1, int(self.num_training_batches * interval))

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer updates the fit will make: Lightning's estimate. Read before the fit has
        loaded its training data (in ``configure_optimizers``), it loads it, as Lightning does."""
        if self._load_train_data is not None:
            self._load_train_data()
        if self.num_training_batches == float("inf") or self.max_epochs == -1:
            return float("inf") if self.max_steps == -1 else self.max_steps
        total = math.ceil(self.num_training_batches / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return total if self.max_steps == -1 else min(total, self.max_steps)

    @property
    def train_dataloader(self):
        return as_given(self._train_loader)  # several loaders: as the user combined them

    @property
    def val_dataloaders(self):
        return _one_or_all(self._val_loaders)

    @property
    def test_dataloaders(self):
        return _one_or_all(self._test_loaders)

    @property
    def predict_dataloaders(self):
        """The loaders of the last predict() (rebuilt, as Lightning rebuilds them, so that their
        batch sampler records each batch's sample indices)."""
        return _one_or_all(self._predict_loaders)

    @property
    def progress_bar_callback(self):
        """The first ``ProgressBar`` among the callbacks, as in Lightning (None: none)."""
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def num_nodes(self) -> int:
        return self._args.num_nodes

    @property
    def device_ids(self) -> list:
        """The device indices of this node, as Lightning lists them (see strategy.device_ids)."""
        return device_ids(self)

    @contextlib.contextmanager
    def init_module(self, empty_init: Optional[bool] = None):
        """Lightning's ``with trainer.init_module():``: tensors the block creates go straight to
        the device the run will use (``empty_init`` is accepted; the weights are initialised
        either way, as under Lightning's single-device strategies)."""
        with torch.device(planned_device(self)):
            yield

    @property
    def precision(self) -> str:
        return {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[self._args.mixed_precision]

    @property
    def interrupted(self) -> bool:
        return self.state.status == TrainerStatus.INTERRUPTED

    @property
    def engine(self) -> str:
        """The engine that ran the last training steps (after any fallback)."""
        return self._runner.active_engine if self._runner is not None else None

    @property
    def compiled_graphs(self) -> dict:
        """What the compiled step's forward hooks became (``fasttrain.Trainer.compiled_graphs``):
        the training and validation steps appear as ``calculate_train_batch_loss`` and
        ``calculate_eval_batch_loss``."""
        return self._runner.compiled_graphs if self._runner is not None else {}

    def print(self, *args, **kwargs) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ entry points
    def fit(self, model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None,
            weights_only: Optional[bool] = None) -> None:
        """``weights_only`` is ``torch.load``'s for ``ckpt_path``, as in Lightning: None or True load
        only tensors and plain values (a file with other pickled objects is refused); pass False
        only for a file you trust."""
        from fasttrain.lightning.fit import fit

        fit(self, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)

    def validate(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None,
                 weights_only: Optional[bool] = None) -> list:
        from fasttrain.lightning.fit import evaluate

        self.validate_loop.verbose = verbose  # Lightning's results table at the end (verbose=True)
        return evaluate(self, "validate", model, dataloaders, ckpt_path, datamodule, weights_only)

    def test(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None,
             weights_only: Optional[bool] = None) -> list:
        from fasttrain.lightning.fit import evaluate

        self.test_loop.verbose = verbose  # Lightning's results table at the end (verbose=True)
        return evaluate(self, "test", model, dataloaders, ckpt_path, datamodule, weights_only)

    def predict(self, model=None, dataloaders=None, datamodule=None, return_predictions=None, ckpt_path=None,
                weights_only: Optional[bool] = None):
        from fasttrain.lightning.fit import predict

        return predict(self, model, dataloaders, datamodule, ckpt_path, return_predictions, weights_only)

    @property
    def _checkpoint_connector(self) -> ckpt_io.CheckpointConnector:
        return ckpt_io.CheckpointConnector(self)

    def save_checkpoint(self, filepath, weights_only: Optional[bool] = None,
                        storage_options: Optional[Any] = None) -> None:
        """Lightning's: ``storage_options`` goes to the ``CheckpointIO`` plugin; without one,
        the default writer takes none (Lightning's ``TypeError``)."""
        ckpt_io.save(self, filepath, weights_only, storage_options)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        # torch.save(trainer) works as under Lightning: the run's engine and accelerator (the
        # runner) are not kept, nor the optimizer wrappers (classes Lightning builds per
        # optimizer class, which pickle cannot find by name); they are rebuilt on loading
        state = self.__dict__.copy()
        state["_runner"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._wrap_optimizers()

    def _wrap_optimizers(self) -> None:
        """``strategy._lightning_optimizers`` for ``self.optimizers`` (what ``self.optimizers()``
        returns to the module); under manual optimization each step counts a global step."""
        strategy = self.strategy
        strategy._lightning_optimizers = [LightningOptimizer._to_lightning_optimizer(o, strategy) for o in self.optimizers]
        module = self._module
        if module is not None and not module.automatic_optimization:
            counts = self.fit_loop.epoch_loop.manual_optimization
            for lightning_optimizer in strategy._lightning_optimizers:
                lightning_optimizer._on_before_step = counts.step_starting
                lightning_optimizer._on_after_step = counts.step_done

    # ------------------------------------------------------------------ loop support
    def _scaler(self):
        runner = self._runner
        return runner._accelerator.scaler if runner is not None else None

    def _load_scaler_state(self) -> None:
        """The resumed checkpoint's loss-scaler state into this fit's scaler (a run without one,
        bf16 or full precision, ignores it, as Lightning's precision plugins do)."""
        state, self._scaler_state = self._scaler_state, None
        scaler = self._scaler()
        if state and scaler is not None:
            scaler.load_state_dict(state)

    def _num_sanity_batches(self, loader=None) -> int:
        if not self.enable_validation or self.num_sanity_val_steps == 0:
            return 0
        loaders = [loader] if loader is not None else self._val_loaders
        if not loaders:  # not requested yet: no sanity check runs (see run_data.load_data)
            return 0
        counts = [num_batches(RunningStage.VALIDATING, dl, self.limit_val_batches) for dl in loaders]
        return min(self.num_sanity_val_steps, max(counts))  # inf (all batches) when -1 was given

    def _step_schedulers(self, interval: str, batch_idx: int, plateau: bool = False) -> None:
        if not self.lr_scheduler_configs or not self._module.automatic_optimization:
            return
        for config in self.lr_scheduler_configs:
            if plateau != bool(config.reduce_on_plateau) or config.interval != interval:
                continue
            index = (batch_idx if interval == "step" else self.current_epoch) + 1
            if index % config.frequency:
                continue
            monitor_value = None
            if config.reduce_on_plateau:
                monitor_value = self.callback_metrics.get(config.monitor)
                if monitor_value is None:  # Lightning's error, or its warning with strict=False
                    if config.strict:
                        raise LightningConfigError(
                            f"ReduceLROnPlateau conditioned on metric {config.monitor}"
                            f" which is not available. Available metrics are: {list(self.callback_metrics)}."
                            " Condition can be set using `monitor` key in lr scheduler dict"
                        )
                    rank_zero_warn(
                        f"ReduceLROnPlateau conditioned on metric {config.monitor}"
                        " which is not available but strict is set to `False`. Skipping learning rate update.",
                        category=RuntimeWarning,
                    )
                    continue
            counts = self.fit_loop.epoch_loop.scheduler_progress
            counts.increment_ready()
            self._hooks.module_hook("lr_scheduler_step", config.scheduler, monitor_value)
            counts.increment_completed()

    def _manual_step(self, batch, batch_idx: int) -> dict:
        runner = self._runner
        output = runner.run_step("training_step", *runner.step_args("training_step", batch, batch_idx))
        if isinstance(output, torch.Tensor):
            return {"loss": output.detach()}
        if isinstance(output, Mapping):
            outputs = dict(output)
            if "loss" in outputs:
                outputs["loss"] = outputs["loss"].detach()
            return outputs
        if output is not None:
            raise LightningConfigError(
                "In manual optimization, `training_step` must either return a Tensor or have no return."
            )
        return {}

    def _epoch_end_metrics_ready(self) -> None:
        # the last batch's step values stay in callback_metrics, as Lightning's per-batch update leaves them
        self._logger_connector.absorb(self._train_results, on_step=True)
        self._logger_connector.on_step = False
        # the epoch's end: the bar's metrics (the step values and, as in Lightning from here on,
        # the epoch values) to the host
        self._pbar_metrics.refresh()

    def _collect_epoch_metrics(self, results: ResultStore, logged_in_hooks: bool) -> None:
        self._logger_connector.absorb(results, on_step=False)
        if logged_in_hooks:
            # SYNC(epoch-end): what the epoch-end hooks logged reaches the bar's host copy, as it
            # reaches Lightning's progress_bar_metrics (no read when they logged nothing)
            self._pbar_metrics.refresh()

    def _log_step_metrics(self) -> None:
        self._logger_connector.log_train_step()

    def _log_epoch_metrics(self, results: ResultStore) -> None:
        self._logger_connector.log_metrics(results.metrics(on_step=False)["log"])
        self._logger_connector.on_step = True

    def _finish_evaluation(self, results: ResultStore, num_loaders: int) -> list:
        """The evaluation's epoch metrics into the metric dicts and the loggers; returns
        Lightning's result list: one dict per loader, with the values its batches logged and
        those logged outside the loaders' batches (in the epoch hooks)."""
        connector = self._logger_connector
        logged = connector.absorb(results, on_step=False)
        self._pbar_metrics.refresh()  # an evaluation's end: the bar's metrics to the host
        connector.log_metrics(logged)
        # SYNC(epoch-end): validate()/test() return host numbers, as Lightning's do
        host = dict(zip(logged, to_host(logged).values()))
        if num_loaders == 1:
            return [host]
        # each loader's dict holds what its batches logged (with or without the loader's index
        # in the name) and what was logged outside them, as Lightning splits its results
        owner = results.logged_loaders()
        return [{k: v for k, v in host.items() if owner.get(k) in (i, None)} for i in range(num_loaders)]


def _one_or_all(loaders: list):
    # a run's evaluation loaders as Lightning's properties give them: the one, the list, or None
    return loaders[0] if len(loaders) == 1 else (loaders or None)


def planned_device(trainer) -> torch.device:
    """The device a run of ``trainer`` trains on, before a run has placed anything."""
    if trainer._force_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


class _AcceleratorConnector:
    @property
    def is_distributed(self) -> bool:
        return _distributed()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


__all__ = ["Trainer"]
