"""``fasttrain.lightning.Trainer``: fits an unchanged LightningModule on fasttrain's engines.

The object plays the part of ``lightning.Trainer`` for the module and its callbacks (they reach
it as ``self.trainer``): counters, ``callback_metrics``, ``optimizers``, ``strategy``,
``save_checkpoint`` and the rest of what Lightning's own code reads. The work is fasttrain's: a
:class:`~fasttrain.lightning.runner.ModuleRunner` prepares model and optimizer through
accelerate and runs each batch through the chosen step engine; :mod:`.loops` keeps Lightning's
order around it; :mod:`.results` keeps ``self.log`` values on the device.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import TrainerFn, TrainerState, TrainerStatus
from lightning.pytorch.utilities import GradClipAlgorithmType

from fasttrain.lightning import checkpoint as ckpt_io
from fasttrain.lightning.arguments import limited_batches, parse_arguments
from fasttrain.lightning.hooks import HookCaller, check_supported_callbacks, order_callbacks
from fasttrain.lightning.loggers import LoggerConnector, build_loggers, to_host
from fasttrain.lightning.loops import FitLoopState
from fasttrain.lightning.progress import EpochProgress
from fasttrain.lightning.results import ResultStore
from fasttrain.lightning.runner import ModuleRunner
from fasttrain.lightning.strategy import Strategy


class Trainer:
    """Lightning's ``Trainer`` arguments (those fasttrain honours; any other is an error naming
    it) plus fasttrain's keyword options ``engine`` (``"auto"``, ``"eager"``, ``"compiled"``,
    ``"cudagraph"``), ``compile_options`` and ``nonfinite`` (default ``"ignore"``, as Lightning)."""

    def __init__(self, **kwargs):
        args = self._args = parse_arguments(kwargs)
        self.max_epochs, self.max_steps = args.max_epochs, args.max_steps
        self.accumulate_grad_batches = args.accumulate_grad_batches
        self.gradient_clip_val = args.gradient_clip_val
        self.gradient_clip_algorithm = (
            GradClipAlgorithmType(args.gradient_clip_algorithm) if args.gradient_clip_algorithm else None
        )
        self.limit_train_batches, self.limit_val_batches = args.limit_train_batches, args.limit_val_batches
        self.limit_test_batches, self.limit_predict_batches = args.limit_test_batches, args.limit_predict_batches
        self.val_check_interval = args.val_check_interval
        self.check_val_every_n_epoch = args.check_val_every_n_epoch
        self.num_sanity_val_steps = args.num_sanity_val_steps
        self.log_every_n_steps = args.log_every_n_steps
        self.default_root_dir = args.default_root_dir
        self._force_cpu = args.accelerator == "cpu"
        if args.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=args.deterministic == "warn")
        self.callbacks = self._build_callbacks(args)
        self.loggers = build_loggers(args.logger, self.default_root_dir)
        self._progress = EpochProgress(args.enable_progress_bar)
        self.profiler = PassThroughProfiler()
        self.precision_plugin = Precision()
        self.strategy = Strategy(self)
        self.state = TrainerState()
        self.barebones = False
        self.fast_dev_run = False
        self.should_stop = False
        self.received_sigterm = False
        self.sanity_checking = self.training = self.validating = self.testing = self.predicting = False
        self._logger_connector = LoggerConnector(self)
        self._accelerator_connector = _AcceleratorConnector()
        self._train_results = ResultStore(training=True)
        self._val_results = ResultStore(training=False)
        self._test_results = ResultStore(training=False)
        self._active_eval_results = None
        self.fit_loop = FitLoopState()
        self._global_step = 0
        self._module = None
        self._runner: Optional[ModuleRunner] = None
        self.datamodule = None
        self.optimizers: list = []
        self.lr_scheduler_configs: list = []
        self.ckpt_path = None
        #: a fit resumed inside an epoch (or limited by max_steps): no sanity check, as in Lightning
        self._restarting = False
        #: loads the fit's training data when something reads the estimate before the fit
        #: loads it (configure_optimizers); None once loaded
        self._load_train_data = None
        #: the loss scaler's state from the checkpoint a fit resumes from, loaded once the fit's
        #: accelerator (and its scaler) exists
        self._scaler_state = None
        self._device = torch.device("cpu")
        self._train_loader = None
        self._val_loaders: list = []
        self._test_loaders: list = []
        self._eval_step_name = "validation_step"
        self._eval_dataloader_idx = None
        self.num_training_batches = 0
        self._hooks: Optional[HookCaller] = None
        #: whether the attached module defines validation_step (decided when a run attaches it)
        self._has_val_step = False
        #: requests the fit's validation loaders when no sanity check does (see fit._load_data)
        self._load_val_later = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_callbacks(args) -> list:
        """The run's callbacks: ``callbacks=`` (a list, or one callback, as Lightning takes it), a
        ``ModelCheckpoint`` added when checkpointing is on and none is given, checkpoints last."""
        given = args.callbacks
        callbacks = [given] if isinstance(given, Callback) else list(given or [])
        check_supported_callbacks(callbacks)
        if args.enable_checkpointing and not any(isinstance(cb, Checkpoint) for cb in callbacks):
            callbacks.append(ModelCheckpoint())
        elif not args.enable_checkpointing and any(isinstance(cb, Checkpoint) for cb in callbacks):
            raise ValueError(
                "enable_checkpointing=False but a checkpoint callback was passed; remove one of the two"
            )
        return order_callbacks(callbacks)

    # ------------------------------------------------------------------ what modules and callbacks read
    @property
    def lightning_module(self):
        return self._module

    @property
    def model(self):
        return self._module

    @property
    def current_epoch(self) -> int:
        return self.fit_loop.epoch_progress.current.completed

    @property
    def global_step(self) -> int:
        return self._global_step

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
        return self.world_size

    @property
    def logger(self):
        return self.loggers[0] if self.loggers else None

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
        callbacks = [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]
        return callbacks[0] if callbacks else None

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
        return self._logger_connector.progress_bar_metrics

    @property
    def enable_validation(self) -> bool:
        return bool(self._val_loaders) and self._has_val_step and self.limit_val_batches != 0

    @property
    def num_val_batches(self) -> list:
        return [limited_batches(self.limit_val_batches, len(dl)) for dl in self._val_loaders]

    @property
    def val_check_batch(self) -> int:
        interval = self.val_check_interval
        if isinstance(interval, int):
            return interval
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
        return self._train_loader

    @property
    def val_dataloaders(self):
        loaders = self._val_loaders
        return loaders[0] if len(loaders) == 1 else (loaders or None)

    @property
    def test_dataloaders(self):
        loaders = self._test_loaders
        return loaders[0] if len(loaders) == 1 else (loaders or None)

    #: no Lightning progress-bar callback: LightningModule.print then prints directly
    progress_bar_callback = None
    num_nodes = 1

    @property
    def precision(self) -> str:
        return {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[self._args.mixed_precision]

    @property
    def is_last_batch(self) -> bool:
        return bool(self.fit_loop.epoch_loop.batch_progress.is_last_batch)

    @property
    def interrupted(self) -> bool:
        return self.state.status == TrainerStatus.INTERRUPTED

    @property
    def engine(self) -> str:
        """The engine that ran the last training steps (after any fallback)."""
        return self._runner.active_engine if self._runner is not None else None

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

        return evaluate(self, "validate", model, dataloaders, ckpt_path, datamodule, weights_only)

    def test(self, model=None, dataloaders=None, ckpt_path=None, verbose=True, datamodule=None,
             weights_only: Optional[bool] = None) -> list:
        from fasttrain.lightning.fit import evaluate

        return evaluate(self, "test", model, dataloaders, ckpt_path, datamodule, weights_only)

    def predict(self, model=None, dataloaders=None, datamodule=None, return_predictions=None, ckpt_path=None,
                weights_only: Optional[bool] = None):
        from fasttrain.lightning.fit import predict

        return predict(self, model, dataloaders, datamodule, ckpt_path, return_predictions, weights_only)

    def save_checkpoint(self, filepath, weights_only: bool = False, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise ValueError("save_checkpoint(storage_options=...) is not supported; save to a local path")
        checkpoint = ckpt_io.dump_checkpoint(self, weights_only)
        if self.is_global_zero:
            ckpt_io.write(checkpoint, filepath)
        self.strategy.barrier("save_checkpoint")

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
        counts = [limited_batches(self.limit_val_batches, len(dl)) for dl in loaders]
        if self.num_sanity_val_steps == -1:
            return max(counts)
        return min(self.num_sanity_val_steps, max(counts))

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
                if monitor_value is None:
                    if config.strict:
                        raise KeyError(
                            f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged; logged "
                            f"metrics: {sorted(self.callback_metrics)}. Log it or set 'strict': False."
                        )
                    warnings.warn(f"ReduceLROnPlateau monitors {config.monitor!r}, not logged: skipped", RuntimeWarning)
                    continue
            self._hooks.module_hook("lr_scheduler_step", config.scheduler, monitor_value)

    def _manual_step(self, batch, batch_idx: int) -> dict:
        output = self._runner.run_step("training_step", batch, batch_idx)
        if isinstance(output, torch.Tensor):
            return {"loss": output.detach()}
        if isinstance(output, dict):
            return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
        return {}

    def _manual_optimizer_stepped(self) -> None:
        self._global_step += 1

    def _epoch_end_metrics_ready(self) -> None:
        # the last batch's step values stay in callback_metrics, as Lightning's per-batch update leaves them
        self._logger_connector.absorb(self._train_results, on_step=True)
        self._logger_connector.on_step = False

    def _collect_epoch_metrics(self, results: ResultStore) -> None:
        self._logger_connector.absorb(results, on_step=False)

    def _log_step_metrics(self) -> None:
        self._logger_connector.log_train_step()

    def _log_epoch_metrics(self, results: ResultStore) -> None:
        self._logger_connector.log_metrics(results.metrics(on_step=False)["log"])
        self._logger_connector.on_step = True

    def _finish_evaluation(self, results: ResultStore, num_loaders: int) -> list:
        """The evaluation's epoch metrics into the metric dicts and the loggers; returns
        Lightning's result list: one dict per loader, with that loader's ``/dataloader_idx_N``
        values and those logged without a loader index (in the epoch hooks)."""
        connector = self._logger_connector
        logged = connector.absorb(results, on_step=False)
        connector.log_metrics(logged)
        # SYNC(epoch-end): validate()/test() return host numbers, as Lightning's do
        host = dict(zip(logged, to_host(logged).values()))
        if num_loaders == 1:
            return [host]
        shared = {k: v for k, v in host.items() if "/dataloader_idx_" not in k}
        return [
            {**{k: v for k, v in host.items() if k.endswith(f"/dataloader_idx_{i}")}, **shared}
            for i in range(num_loaders)
        ]


class _AcceleratorConnector:
    @property
    def is_distributed(self) -> bool:
        return _distributed()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


__all__ = ["Trainer"]
