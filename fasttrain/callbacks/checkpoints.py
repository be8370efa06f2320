"""Callbacks that save and restore models and training states."""

from __future__ import annotations

import operator as op
import shutil
from datetime import datetime
from pathlib import Path
from typing import List, Optional, Union

from fasttrain.callbacks.events import CallbackHandler, TrainerCallback
from fasttrain.utils import ModelEma


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


class SaveTrainingStateCallback(TrainerCallback):
    """Saves the complete training state every n epochs and/or training steps and at the end,
    keeping at most ``max_checkpoints`` of them (the newest are kept).

    ``save_every_n_steps`` counts training steps (batches) from the start of each ``train()``
    call, as pytorch-accelerated does: with gradient accumulation a state may be saved inside an
    accumulation window, and it holds that window's gradients, so a run resumed from it is
    step-exact. A resumed run continues the count from the state it was resumed from.
    """

    #: reads no ``model_outputs`` at step ends (the graphed engine need not keep them)
    model_outputs_phases = ()

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
        self._resumed = False

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
        return {
            "saved_checkpoints": [str(path) for path in self._saved_checkpoints],
            "global_step": self._global_step,
        }

    def load_state_dict(self, state: dict) -> None:
        # only this callback's own directory: a run resumed from another run's state must never
        # rotate that run's states (the one resumed from included) away
        self._saved_checkpoints = [
            Path(path) for path in state.get("saved_checkpoints", []) if Path(path).parent == self.save_dir
        ]
        # loaded before on_training_run_start, which then keeps the count
        self._global_step = state.get("global_step", 0)
        self._resumed = True

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
        if not self._resumed:
            self._global_step = 0
        self._resumed = False

    def on_train_step_end(self, trainer, step, **kwargs):
        self._global_step += 1
        if self.save_every_n_steps is not None and self._global_step % self.save_every_n_steps == 0:
            self._save(trainer, f"step_{self._global_step}")

    def on_train_epoch_end(self, trainer, **kwargs):
        epoch = trainer.run_history.current_epoch
        if self.save_every_n_epochs is not None and epoch % self.save_every_n_epochs == 0:
            self._save(trainer, f"epoch_{epoch}")

    def on_training_run_end(self, trainer, **kwargs):
        if self.save_at_end:
            self._save(trainer, "final")


class WSDCheckpointCallback(TrainerCallback):
    """With a :class:`~fasttrain.schedulers.WSDLrScheduler`, saves a full training state just
    before each decay phase (to branch from) and a model checkpoint at the end of each decay."""

    #: reads no ``model_outputs`` at step ends (the graphed engine need not keep them)
    model_outputs_phases = ()

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

    def _get_export_checkpoint_path(self, step: int, checkpoint_type: str) -> Path:
        """Where the model checkpoint (a ``.pt`` file) of ``checkpoint_type`` at ``step`` goes."""
        return self.save_dir / f"checkpoint_{step}_{checkpoint_type}.pt"

    def _get_training_state_path(self, step: int, checkpoint_type: str) -> Path:
        """Where the training state (a directory) of ``checkpoint_type`` at ``step`` goes."""
        return self.save_dir / f"checkpoint_{step}_{checkpoint_type}"

    def _save_pre_decay(self, trainer, step: int):
        path = self._get_training_state_path(step, "wsd_pre_decay")
        trainer.save_training_state(str(path), checkpoint_kwargs=self._metadata(trainer, step, "wsd_pre_decay"))
        trainer.print(f"\nSaved wsd_pre_decay training state at step {step}")

    def _save_post_decay(self, trainer, step: int):
        path = self._get_export_checkpoint_path(step, "wsd_post_decay")
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
