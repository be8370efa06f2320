"""Callbacks: the event system and the built-in callbacks.

Events fire in the order documented in ``docs/migrating.md``; each callback event fires after the
trainer hook of the same moment, and callbacks run in list order.

Per-step events (``on_train_step_start``, ``on_train_step_end``, ``on_eval_step_start``,
``on_eval_step_end``) are dispatched only to callbacks that override them, from a table built
when a callback is added, so a callback that does nothing per step costs nothing per step.

None of the built-in callbacks reads a device value per step. Step losses, gradient norms and the
non-finite flag reach them as host values through the batched ``on_metrics_flush`` event
(:class:`fasttrain.metrics.FlushedMetrics`), every ``log_every_n_steps`` updates and at epoch ends.
"""

from __future__ import annotations

import difflib
import inspect
import operator as op
import shutil
import sys
import warnings
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch
from torch import nn
from tqdm import tqdm

from fasttrain.utils import DataLoaderSlice, ModelEma

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
    "EVENTS",
    "PER_STEP_EVENTS",
]


class StopTrainingError(Exception):
    """Raised by a callback to end the current training (or evaluation) run cleanly."""


class CallbackMethodNotImplementedError(Exception):
    """Kept for compatibility: raising it from a callback method skips that callback."""


#: Every event the trainer fires, in the order of a training run with evaluation.
EVENTS = (
    "on_init_end",
    "on_training_run_start",
    "on_train_epoch_start",
    "on_train_step_start",
    "on_train_step_end",
    "on_metrics_flush",
    "on_train_epoch_end",
    "on_eval_epoch_start",
    "on_eval_step_start",
    "on_eval_step_end",
    "on_eval_epoch_end",
    "on_training_run_epoch_end",
    "on_training_run_end",
    "on_evaluation_run_start",
    "on_evaluation_run_end",
    "on_stop_training_error",
    "on_training_interrupted",
)

PER_STEP_EVENTS = (
    "on_train_step_start",
    "on_train_step_end",
    "on_eval_step_start",
    "on_eval_step_end",
)


class TrainerCallback:
    """Base class for callbacks. Override the events you need; every method takes
    ``(trainer, ..., **kwargs)``.

    Per-step events receive device tensors in ``batch_output``: reading them on the host
    (``.item()``, ``float()``, printing) makes the host wait for the device on every step. To
    observe losses without that cost, implement :meth:`on_metrics_flush`, which receives host
    values in batches.
    """

    def on_init_end(self, trainer, **kwargs):
        pass

    def on_training_run_start(self, trainer, **kwargs):
        pass

    def on_train_epoch_start(self, trainer, **kwargs):
        pass

    def on_train_step_start(self, trainer, **kwargs):
        pass

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        pass

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        """Host values of the step metrics since the previous flush
        (a :class:`fasttrain.metrics.FlushedMetrics`)."""

    def on_train_epoch_end(self, trainer, **kwargs):
        pass

    def on_eval_epoch_start(self, trainer, **kwargs):
        pass

    def on_eval_step_start(self, trainer, **kwargs):
        pass

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        pass

    def on_eval_epoch_end(self, trainer, **kwargs):
        pass

    def on_training_run_epoch_end(self, trainer, **kwargs):
        pass

    def on_training_run_end(self, trainer, **kwargs):
        pass

    def on_evaluation_run_start(self, trainer, **kwargs):
        pass

    def on_evaluation_run_end(self, trainer, **kwargs):
        pass

    def on_stop_training_error(self, trainer, **kwargs):
        pass

    def on_training_interrupted(self, trainer, signal_number, **kwargs):
        """Fired once when SIGINT or SIGTERM asks a training run to stop."""


def _overrides(callback, event: str) -> bool:
    """Whether ``callback`` does something on ``event`` (the base class's no-op does not count)."""
    method = getattr(type(callback), event, None)
    if method is None:
        # instance attributes (a function assigned to the object) count too
        return callable(getattr(callback, event, None))
    base = getattr(TrainerCallback, event, None)
    return method is not base


def _warn_misspelled_events(callback) -> None:
    known = set(EVENTS)
    for name in dir(type(callback)):
        if not name.startswith("on_") or name in known:
            continue
        close = difflib.get_close_matches(name, EVENTS, n=1, cutoff=0.85)
        if close:
            warnings.warn(
                f"{type(callback).__name__}.{name} is not a trainer event and will only run if "
                f"fired with call_event({name!r}); did you mean {close[0]!r}?",
                stacklevel=4,
            )


class CallbackHandler:
    """Holds the callbacks of a trainer and fires events on them.

    The handler keeps, for every event, the list of bound methods of the callbacks that implement
    it. The lists are updated in place when callbacks are added, so the trainer may hold on to
    them across steps.
    """

    def __init__(self, callbacks=()):
        self.callbacks: List = []
        self._dispatch: Dict[str, List] = {}
        self._enabled = True
        self.add_callbacks(callbacks)

    def add_callbacks(self, callbacks):
        for callback in callbacks:
            self.add_callback(callback)

    def add_callback(self, callback):
        instance = callback() if isinstance(callback, type) else callback
        cls = type(instance)
        if any(type(existing) is cls for existing in self.callbacks):
            raise ValueError(
                f"The callback {cls.__name__} was added twice; a trainer takes one instance of "
                f"each callback class. Callbacks already present: {self.callback_list}"
            )
        _warn_misspelled_events(instance)
        self.callbacks.append(instance)
        self._rebuild()

    def clear_callbacks(self):
        self.callbacks = []
        self._rebuild()

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self):
        return len(self.callbacks)

    @property
    def callback_list(self) -> List[str]:
        return [type(cb).__name__ for cb in self.callbacks]

    def _rebuild(self):
        for event, methods in self._dispatch.items():
            methods[:] = [getattr(cb, event) for cb in self.callbacks if _overrides(cb, event)]

    def handlers(self, event: str) -> List:
        """The bound methods that ``event`` calls, in callback order (a live list)."""
        methods = self._dispatch.get(event)
        if methods is None:
            methods = [getattr(cb, event) for cb in self.callbacks if _overrides(cb, event)]
            self._dispatch[event] = methods
        return methods

    def call_event(self, event: str, *args, **kwargs):
        """Call ``event`` on every callback that implements it; others are skipped."""
        self.call_methods(self.handlers(event), *args, **kwargs)

    def call_methods(self, methods: List, *args, **kwargs):
        """Call the bound methods returned by :meth:`handlers` (the trainer resolves per-step
        events once per epoch); a callback raising ``CallbackMethodNotImplementedError`` is
        skipped."""
        if not self._enabled:
            return
        for method in methods:
            try:
                method(*args, **kwargs)
            except CallbackMethodNotImplementedError:
                continue


# --------------------------------------------------------------------------- built-in callbacks


class MoveModulesToDeviceCallback(TrainerCallback):
    """Moves every ``nn.Module`` attribute of the trainer other than the model (for example a
    loss function with weights) to the trainer's device."""

    def _move_modules_to_device(self, trainer):
        for name, value in list(vars(trainer).items()):
            if name != "model" and isinstance(value, nn.Module):
                value.to(trainer.device)

    def on_training_run_start(self, trainer, **kwargs):
        self._move_modules_to_device(trainer)

    def on_evaluation_run_start(self, trainer, **kwargs):
        self._move_modules_to_device(trainer)


class TerminateOnNaNCallback(TrainerCallback):
    """Stops the run at the first flush that sees a non-finite loss.

    The check uses the batched host values, so it costs no per-step synchronisation; the stop
    happens at most ``log_every_n_steps`` updates after the bad step. The process is not exited:
    ``train()`` returns and ``triggered`` tells what happened. It acts only under the trainer's
    default ``nonfinite="stop"``: with ``"skip"`` or ``"ignore"`` training goes on.
    """

    def __init__(self):
        self.triggered = False

    def on_training_run_start(self, trainer, **kwargs):
        self.triggered = False

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if metrics.nonfinite and getattr(trainer, "nonfinite", "stop") == "stop":
            self.triggered = True
            bad = next(
                (i for i, loss in zip(metrics.step_indices, metrics.losses) if loss != loss or loss in (float("inf"), float("-inf"))),
                None,
            )
            phase = "training" if metrics.phase == "train" else "validation"
            raise StopTrainingError(
                f"Stopping training due to a non-finite {phase} loss at step {bad} of epoch "
                f"{metrics.epoch}"
            )


class PrintProgressCallback(TrainerCallback):
    """Prints the start and end of runs and epochs."""

    def on_training_run_start(self, trainer, **kwargs):
        trainer.print("\nStarting training run")

    def on_train_epoch_start(self, trainer, **kwargs):
        trainer.print(f"\nStarting epoch {trainer.run_history.current_epoch}")

    def on_training_run_end(self, trainer, **kwargs):
        trainer.print("Finishing training run")

    def on_eval_epoch_start(self, trainer, **kwargs):
        trainer.print("\nStarting eval epoch")

    def on_evaluation_run_start(self, trainer, **kwargs):
        trainer.print("\nStarting evaluation run")

    def on_evaluation_run_end(self, trainer, **kwargs):
        trainer.print("Finishing evaluation run")


class ProgressBarCallback(TrainerCallback):
    """A tqdm bar per epoch showing steps, the running loss and samples per second.

    The step count is a host counter; the loss and throughput come from the batched flushes.
    """

    def __init__(self, file=None):
        self.pbar = None
        self.eval_pbar = None
        self._file = file

    def _new_bar(self, trainer, dataloader, desc):
        return tqdm(
            total=len(dataloader),
            desc=desc,
            file=self._file,
            disable=not trainer._accelerator.is_local_main_process,
            leave=True,
        )

    def on_train_epoch_start(self, trainer, **kwargs):
        self.pbar = self._new_bar(trainer, trainer._train_dataloader, "train")

    def on_train_step_end(self, trainer, **kwargs):
        self.pbar.update(1)

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        bar = self.pbar if metrics.phase == "train" else self.eval_pbar
        if bar is None or bar.disable:
            return
        postfix = {"loss": f"{metrics.epoch_mean_loss:.4g}"}
        if metrics.elapsed_s > 0:
            postfix["samples/s"] = f"{metrics.num_samples / metrics.elapsed_s:.4g}"
        bar.set_postfix(postfix, refresh=False)

    def on_train_epoch_end(self, trainer, **kwargs):
        if self.pbar is not None:
            self.pbar.close()

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.eval_pbar = self._new_bar(trainer, trainer._eval_dataloader, "eval")

    def on_eval_step_end(self, trainer, **kwargs):
        self.eval_pbar.update(1)

    def on_eval_epoch_end(self, trainer, **kwargs):
        if self.eval_pbar is not None:
            self.eval_pbar.close()


class LogMetricsCallback(TrainerCallback):
    """Prints the latest value of each metric at the end of every epoch. Subclass it and
    override :meth:`log_metrics` to send metrics elsewhere."""

    def on_train_epoch_end(self, trainer, **kwargs):
        names = [m for m in trainer.run_history.get_metric_names() if "train" in m]
        self._log_latest_metrics(trainer, names)

    def on_eval_epoch_end(self, trainer, **kwargs):
        names = [m for m in trainer.run_history.get_metric_names() if "train" not in m]
        self._log_latest_metrics(trainer, names)

    def _log_latest_metrics(self, trainer, metric_names):
        metrics = {
            name: trainer.run_history.get_latest_metric(name) for name in sorted(metric_names)
        }
        self.log_metrics(trainer, metrics)

    def log_metrics(self, trainer, metrics: dict):
        for name, value in metrics.items():
            trainer.print(f"\n{name}: {value}")


def get_default_callbacks(progress_bar: bool = True):
    """The callbacks a trainer uses unless told otherwise, in order."""
    if progress_bar:
        return (
            MoveModulesToDeviceCallback,
            TerminateOnNaNCallback,
            PrintProgressCallback,
            ProgressBarCallback,
            LogMetricsCallback,
        )
    return (
        MoveModulesToDeviceCallback,
        TerminateOnNaNCallback,
        PrintProgressCallback,
        LogMetricsCallback,
    )


class SaveBestModelCallback(TrainerCallback):
    """Saves a checkpoint whenever ``watch_metric`` improves, and loads the best one at the end
    of the run when ``load_saved_checkpoint`` is set."""

    def __init__(
        self,
        save_path="best_model.pt",
        watch_metric="eval_loss_epoch",
        greater_is_better: bool = False,
        reset_on_train: bool = True,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        load_saved_checkpoint: bool = True,
    ):
        self.save_path = save_path
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.operator = op.gt if greater_is_better else op.lt
        self.reset_on_train = reset_on_train
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self.load_saved_checkpoint = load_saved_checkpoint
        self.best_metric = None
        self.best_metric_epoch = None

    def on_training_run_start(self, trainer, **kwargs):
        if self.reset_on_train:
            self.best_metric = None

    def on_training_run_epoch_end(self, trainer, **kwargs):
        current = trainer.run_history.get_latest_metric(self.watch_metric)
        if self.best_metric is None or self.operator(current, self.best_metric):
            self.best_metric = current
            self.best_metric_epoch = trainer.run_history.current_epoch
            trainer.save_checkpoint(
                save_path=self.save_path,
                checkpoint_kwargs={self.watch_metric: self.best_metric},
                save_optimizer=self.save_optimizer,
                save_scheduler=self.save_scheduler,
            )

    def on_training_run_end(self, trainer, **kwargs):
        if self.load_saved_checkpoint and self.best_metric is not None:
            trainer.print(
                f"Loading checkpoint with {self.watch_metric}: {self.best_metric} "
                f"from epoch {self.best_metric_epoch}"
            )
            trainer.load_checkpoint(self.save_path)


class EarlyStoppingCallback(TrainerCallback):
    """Stops training when ``watch_metric`` has not improved by more than
    ``early_stopping_threshold`` for ``early_stopping_patience`` epochs."""

    def __init__(
        self,
        early_stopping_patience: int = 1,
        early_stopping_threshold: float = 0.01,
        watch_metric="eval_loss_epoch",
        greater_is_better: bool = False,
        reset_on_train: bool = True,
    ):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.watch_metric = watch_metric
        self.greater_is_better = greater_is_better
        self.operator = op.gt if greater_is_better else op.lt
        self.reset_on_train = reset_on_train
        self.early_stopping_patience_counter = 0
        self.best_metric = None

    def on_training_run_start(self, trainer, **kwargs):
        if self.reset_on_train:
            self.best_metric = None
            self.early_stopping_patience_counter = 0

    def on_training_run_epoch_end(self, trainer, **kwargs):
        current = trainer.run_history.get_latest_metric(self.watch_metric)
        if self.best_metric is None:
            self.best_metric = current
        else:
            improvement = abs(current - self.best_metric)
            if self.operator(current, self.best_metric) and improvement > self.early_stopping_threshold:
                trainer.print(f"\nImprovement of {improvement} observed, resetting counter. ")
                self.best_metric = current
                self.early_stopping_patience_counter = 0
            else:
                trainer.print("No improvement above threshold observed, incrementing counter. ")
                self.early_stopping_patience_counter += 1
            trainer.print(
                f"Early stopping counter: {self.early_stopping_patience_counter}/"
                f"{self.early_stopping_patience}"
            )
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            raise StopTrainingError(
                f"Stopping training due to no improvement after "
                f"{self.early_stopping_patience} epochs"
            )


class ModelEmaCallback(SaveBestModelCallback):
    """Keeps an exponential moving average of the model's weights, updated at each epoch end,
    evaluates it after each eval epoch (metrics prefixed ``ema_model_``) and saves the best."""

    def __init__(
        self,
        decay: float = 0.99,
        evaluate_during_training: bool = True,
        save_path: str = "ema_model.pt",
        watch_metric: str = "ema_model_eval_loss_epoch",
        greater_is_better: bool = False,
        model_ema=ModelEma,
        callbacks=(),
    ):
        super().__init__(
            save_path=save_path,
            watch_metric=watch_metric,
            greater_is_better=greater_is_better,
            reset_on_train=False,
            save_optimizer=False,
        )
        self.decay = decay
        self.evaluate_during_training = evaluate_during_training
        self.model_ema_cls = model_ema
        self.ema_model = None
        self._track_prefix = "ema_model_"
        self.callback_handler = CallbackHandler(callbacks)

    def on_training_run_start(self, trainer, **kwargs):
        self.ema_model = self.model_ema_cls(trainer.get_model(keep_torch_compile=False), decay=self.decay)
        if self.evaluate_during_training:
            self.ema_model.to(trainer.device)

    def on_train_epoch_end(self, trainer, **kwargs):
        self.ema_model.update(trainer.get_model(keep_torch_compile=False))

    def on_eval_epoch_end(self, trainer, **kwargs):
        if not self.evaluate_during_training:
            return
        model, handler = trainer.model, trainer.callback_handler
        prefix = trainer.run_history.metric_name_prefix
        trainer.print("Running evaluation on EMA model")
        trainer.model = self.ema_model.module
        trainer.callback_handler = self.callback_handler
        trainer.run_history.set_metric_name_prefix(self._track_prefix)
        try:
            trainer._run_eval_epoch(trainer._eval_dataloader)
        finally:
            trainer.model = model
            trainer.callback_handler = handler
            trainer.run_history.set_metric_name_prefix(prefix)

    def on_training_run_epoch_end(self, trainer, **kwargs):
        model = trainer.model
        trainer.model = self.ema_model.module
        try:
            if self.evaluate_during_training:
                super().on_training_run_epoch_end(trainer)
            else:
                trainer.save_checkpoint(save_path=self.save_path, save_optimizer=False)
        finally:
            trainer.model = model

    def on_training_run_end(self, trainer, **kwargs):
        pass


class ConvertSyncBatchNormCallback(TrainerCallback):
    """Converts batch norm layers to ``SyncBatchNorm`` when training on several processes."""

    def on_training_run_start(self, trainer, **kwargs):
        if trainer.run_config.is_distributed:
            trainer.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(trainer.model)


class StepBasedEvaluationCallback(TrainerCallback):
    """Runs an intermediate evaluation every ``eval_every_n_steps`` training steps."""

    def __init__(self, eval_every_n_steps: int):
        if eval_every_n_steps <= 0:
            raise ValueError(f"eval_every_n_steps must be a positive integer, got {eval_every_n_steps}")
        self.eval_every_n_steps = eval_every_n_steps

    def on_train_step_end(self, trainer, step, **kwargs):
        if step != 0 and step % self.eval_every_n_steps == 0:
            trainer.print(f"\nRunning evaluation after {step} training steps")
            # the eval epoch keeps its own loss counters, so the training epoch's are untouched
            try:
                trainer._run_eval_epoch(trainer._eval_dataloader, is_intermediate=True)
            finally:
                trainer.run_history.delete_metric("intermediate_eval_loss")
                # the eval epoch put the model in eval mode; training continues in train mode
                trainer.model.train()
            trainer.print("\nResuming training...")


class LimitEvalStepsCallback(TrainerCallback):
    """Limits evaluation epochs (by default only intermediate ones) to ``num_eval_steps`` steps
    in total across processes."""

    def __init__(self, num_eval_steps: int, limit_intermediate_only=True):
        self.num_eval_steps = num_eval_steps
        self.limit_intermediate_only = limit_intermediate_only
        self._original_eval_dataloader = None

    def on_eval_epoch_start(self, trainer, is_intermediate=False, **kwargs):
        if is_intermediate or not self.limit_intermediate_only:
            self._original_eval_dataloader = trainer._eval_dataloader
            per_process = self.num_eval_steps // trainer.run_config.num_processes
            trainer._eval_dataloader = DataLoaderSlice(self._original_eval_dataloader, per_process)
            trainer.print(f"Limiting evaluation to {per_process} steps per process")

    def on_eval_epoch_end(self, trainer, is_intermediate=False, **kwargs):
        if is_intermediate or not self.limit_intermediate_only:
            trainer._eval_dataloader = self._original_eval_dataloader


class LimitBatchesCallback(TrainerCallback):
    """Limits every epoch to ``num_batches`` batches; handy for checking a script end to end.
    Also switched on by the environment variable ``PT_ACC_LIMIT_BATCHES``."""

    def __init__(self, num_batches):
        self.num_batches = num_batches

    def on_training_run_start(self, trainer, **kwargs):
        trainer._train_dataloader = DataLoaderSlice(trainer._train_dataloader, self.num_batches)
        if trainer._eval_dataloader is not None:
            trainer._eval_dataloader = DataLoaderSlice(trainer._eval_dataloader, self.num_batches)

    def on_evaluation_run_start(self, trainer, **kwargs):
        trainer._eval_dataloader = DataLoaderSlice(trainer._eval_dataloader, self.num_batches)


class SaveTrainingStateCallback(TrainerCallback):
    """Saves the complete training state every n epochs and/or optimizer updates and at the end,
    keeping at most ``max_checkpoints`` of them (the newest are kept)."""

    def __init__(
        self,
        save_dir: str = "training_states",
        save_every_n_epochs: Optional[int] = None,
        save_every_n_steps: Optional[int] = None,
        save_at_end: bool = True,
        max_checkpoints: Optional[int] = None,
    ):
        for name, value in (
            ("save_every_n_epochs", save_every_n_epochs),
            ("save_every_n_steps", save_every_n_steps),
            ("max_checkpoints", max_checkpoints),
        ):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        self.save_dir = Path(save_dir)
        self.save_every_n_epochs = save_every_n_epochs
        self.save_every_n_steps = save_every_n_steps
        self.save_at_end = save_at_end
        self.max_checkpoints = max_checkpoints
        self._saved_checkpoints: List[Path] = []
        self._global_step = 0

    def _save(self, trainer, name):
        output_dir = self.save_dir / name
        previous = list(self._saved_checkpoints)
        if output_dir in self._saved_checkpoints:
            self._saved_checkpoints.remove(output_dir)
        # listed before saving, so that the state written (which includes this callback's
        # state) knows itself and a run resumed from it keeps rotating the same list
        self._saved_checkpoints.append(output_dir)
        try:
            saved = trainer.save_training_state(
                str(output_dir), checkpoint_kwargs={"global_step": self._global_step}
            )
        except BaseException:
            self._saved_checkpoints = previous  # the failed save left the older states intact
            raise
        if saved is False:  # refused after a non-finite update: keep the older, good states
            self._saved_checkpoints = previous
            return
        trainer.print(f"\nSaved training state to {output_dir}")
        self._cleanup_old_checkpoints(trainer)

    def state_dict(self) -> dict:
        """The states this callback saved and still keeps, oldest first (saved with the
        training state, so that ``max_checkpoints`` holds across a resume)."""
        return {"saved_checkpoints": [str(path) for path in self._saved_checkpoints]}

    def load_state_dict(self, state: dict) -> None:
        self._saved_checkpoints = [Path(path) for path in state.get("saved_checkpoints", [])]

    def _cleanup_old_checkpoints(self, trainer):
        if self.max_checkpoints is None:
            return
        # runs only after the newest state was written completely, and removes from the oldest
        # end, so the newest good state is never the one removed
        while len(self._saved_checkpoints) > self.max_checkpoints:
            old = self._saved_checkpoints.pop(0)
            if old.exists() and trainer.run_config.is_world_process_zero:
                shutil.rmtree(old)
                trainer.print(f"Removed old training state: {old}")

    def on_training_run_start(self, trainer, **kwargs):
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self._global_step = trainer._num_updates

    def on_train_step_end(self, trainer, step, **kwargs):
        if self.save_every_n_steps is None:
            return
        # saved on optimizer updates only, so a state never splits an accumulation window
        if trainer._num_updates != self._global_step:
            self._global_step = trainer._num_updates
            if self._global_step % self.save_every_n_steps == 0:
                self._save(trainer, f"step_{self._global_step}")

    def on_train_epoch_end(self, trainer, **kwargs):
        epoch = trainer.run_history.current_epoch
        if self.save_every_n_epochs is not None and epoch % self.save_every_n_epochs == 0:
            self._global_step = trainer._num_updates
            self._save(trainer, f"epoch_{epoch}")

    def on_training_run_end(self, trainer, **kwargs):
        if self.save_at_end:
            self._global_step = trainer._num_updates
            self._save(trainer, "final")


class WSDCheckpointCallback(TrainerCallback):
    """With a :class:`~fasttrain.schedulers.WSDLrScheduler`, saves a full training state just
    before each decay phase (to branch from) and a model checkpoint at the end of each decay."""

    def __init__(
        self,
        save_dir: str = "checkpoints",
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        initial_checkpoint: Optional[Union[str, Path]] = None,
    ):
        self.save_dir = Path(save_dir)
        self.save_optimizer = save_optimizer
        self.save_scheduler = save_scheduler
        self.initial_checkpoint = Path(initial_checkpoint) if initial_checkpoint else None
        self.last_checkpoint_step = None
        self.checkpoint_steps = None
        self.decay_fraction = None
        self.decay_info = None
        self.save_dir.mkdir(parents=True, exist_ok=True)

    def _metadata(self, trainer, step, kind):
        return {
            "step": step,
            "checkpoint_type": kind,
            "total_steps": trainer.run_config.max_num_train_steps,
            "decay_fraction": self.decay_fraction,
            "timestamp": datetime.now().isoformat(),
        }

    def _save_pre_decay(self, trainer, step: int):
        path = self.save_dir / f"checkpoint_{step}_wsd_pre_decay"
        trainer.save_training_state(str(path), checkpoint_kwargs=self._metadata(trainer, step, "wsd_pre_decay"))
        trainer.print(f"\nSaved wsd_pre_decay training state at step {step}")

    def _save_post_decay(self, trainer, step: int):
        path = self.save_dir / f"checkpoint_{step}_wsd_post_decay.pt"
        trainer.save_checkpoint(
            path,
            save_optimizer=self.save_optimizer,
            save_scheduler=self.save_scheduler,
            checkpoint_kwargs=self._metadata(trainer, step, "wsd_post_decay"),
        )
        trainer.print(f"\nSaved wsd_post_decay checkpoint at step {step}")

    def on_training_run_start(self, trainer, **kwargs):
        if not hasattr(trainer.scheduler, "get_checkpoint_steps"):
            raise ValueError(
                "WSDCheckpointCallback needs a scheduler with get_checkpoint_steps(); create the "
                "trainer's scheduler with WSDLrScheduler.create_scheduler_fn(...)"
            )
        self.checkpoint_steps = set(trainer.scheduler.get_checkpoint_steps())
        self.decay_fraction = trainer.scheduler.decay_phase_ratio
        self.decay_info = trainer.scheduler.get_decay_info()
        if self.initial_checkpoint is not None and self.initial_checkpoint.exists():
            trainer.print(f"\nLoading checkpoint from {self.initial_checkpoint}")
            if self.initial_checkpoint.is_dir():
                metadata = trainer.load_training_state(str(self.initial_checkpoint))
                self.last_checkpoint_step = metadata.get("step")
            else:
                checkpoint = trainer.load_checkpoint(self.initial_checkpoint)
                self.last_checkpoint_step = checkpoint.get("step")

    def on_train_step_end(self, trainer, step: int, **kwargs):
        total_steps = trainer.scheduler.get_current_step() + 1
        if total_steps == self.last_checkpoint_step:
            return
        phase = trainer.scheduler.get_phase_info(total_steps)
        if total_steps == phase["pre_decay_step"]:
            trainer.print(f"\nWSD Lr Scheduler entering decay phase at step {total_steps}")
            self._save_pre_decay(trainer, total_steps)
            self.last_checkpoint_step = total_steps
        elif total_steps == phase["period_end"]:
            self._save_post_decay(trainer, total_steps)
            self.last_checkpoint_step = total_steps

    def on_training_run_end(self, trainer, **kwargs):
        total_steps = trainer.scheduler.get_current_step() + 1
        if self.last_checkpoint_step != total_steps:
            if total_steps == trainer.scheduler.get_phase_info(total_steps)["period_end"]:
                self._save_post_decay(trainer, total_steps)
                self.last_checkpoint_step = total_steps
