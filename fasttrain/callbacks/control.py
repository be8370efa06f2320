"""Callbacks that shape a run: early stopping, intermediate evaluation, batch limits."""

from __future__ import annotations

import operator as op

import torch

from fasttrain.callbacks.events import StopTrainingError, TrainerCallback
from fasttrain.utils import DataLoaderSlice


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


class ConvertSyncBatchNormCallback(TrainerCallback):
    """Converts batch norm layers to ``SyncBatchNorm`` when training on several processes."""

    def on_training_run_start(self, trainer, **kwargs):
        if trainer.run_config.is_distributed:
            trainer.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(trainer.model)


class StepBasedEvaluationCallback(TrainerCallback):
    """Runs an intermediate evaluation every ``eval_every_n_steps`` training steps."""

    #: reads no ``model_outputs`` at step ends (the graphed engine need not keep them)
    model_outputs_phases = ()

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
