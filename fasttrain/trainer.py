"""The Trainer: pytorch-accelerated's API, with a step loop that never waits on the device.

Read ``_run_train_epoch`` top to bottom to see a training epoch: each micro-step runs through
the chosen step engine, its loss is kept on the device, and the host sees step metrics only at
flushes (every ``log_every_n_steps`` optimizer updates and at epoch ends).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Iterable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm import tqdm

from fasttrain import checkpointing, signals
from fasttrain.accelerate_state import build_accelerator
from fasttrain.compat import ForwardBackwardHelper
from fasttrain.callbacks import (
    CallbackHandler,
    LimitBatchesCallback,
    StopTrainingError,
    get_default_callbacks,
)
from fasttrain.data import (
    default_dataloader_kwargs,
    merge_dataloader_kwargs,
    place_single_process,
    with_device_attribute,
)
from fasttrain.engine import create_engine
from fasttrain.engine.clipping import GradientClipper
from fasttrain.nonfinite import NonFiniteGuard
from fasttrain.placeholders import TrainerPlaceholderValues, resolve_placeholders
from fasttrain.run_config import TrainerRunConfig, build_run_config, uneven_eval_batches_message
from fasttrain.step_metrics import StepMetricsBuffer
from fasttrain.torch_logs import quiet_profiler_notices
from fasttrain.tracking import InMemoryRunHistory, RunHistory
from fasttrain.utils import LIMIT_BATCHES_ENV_VAR
from fasttrain import validation

# names that pytorch-accelerated's trainer module also offers, imported from it by its users
from fasttrain.callbacks import (  # noqa: F401
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    PrintProgressCallback,
    ProgressBarCallback,
    TerminateOnNaNCallback,
)
from fasttrain.tracking import LossTracker  # noqa: F401
from fasttrain.utils import remove_padding, worker_init_fn  # noqa: F401

DEFAULT_CALLBACKS = get_default_callbacks()

__all__ = ["Trainer", "TrainerPlaceholderValues", "DEFAULT_CALLBACKS", "replace_trainer_placeholder_values"]


def replace_trainer_placeholder_values(trainer, instance):
    """``instance`` (usually a ``functools.partial``) with every placeholder among its keyword
    arguments replaced by the trainer's current value."""
    config = trainer.run_config
    eval_dl = trainer._eval_dataloader
    values = {
        "NUM_EPOCHS": config.num_epochs,
        "NUM_UPDATE_STEPS_PER_EPOCH": config.num_update_steps_per_epoch,
        "PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH": config.num_local_update_steps_per_epoch,
        "TRAIN_DATALOADER_LEN": len(trainer._train_dataloader) if trainer._train_dataloader is not None else None,
        "EVAL_DATALOADER_LEN": len(eval_dl) if eval_dl is not None else None,
    }
    return resolve_placeholders(instance, values)


def _callback_sequence(callbacks) -> tuple:
    """``callbacks`` as a tuple: ``None`` means no callbacks, a single callback (class or
    instance) is accepted alone; anything else must be an iterable of callbacks."""
    from fasttrain.callbacks import TrainerCallback

    if callbacks is None:
        return ()
    if isinstance(callbacks, TrainerCallback) or (
        isinstance(callbacks, type) and issubclass(callbacks, TrainerCallback)
    ):
        return (callbacks,)
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise TypeError(
            f"callbacks must be a list of callback classes or instances (or None for no callbacks), "
            f"not {type(callbacks).__name__}; for example callbacks=[ProgressBarCallback] or "
            "callbacks=DEFAULT_CALLBACKS"
        )
    return tuple(callbacks)


class Trainer(ForwardBackwardHelper):
    """Trains and evaluates a model with overridable hooks and callbacks.

    The first five arguments are pytorch-accelerated's. fasttrain's own options are keyword-only:

    :param engine: how a step runs: ``"eager"``, ``"compiled"``, ``"cudagraph"`` or ``"auto"``
        (the fastest that works on the device).
    :param log_every_n_steps: optimizer updates between flushes of the step metrics to the host
        (the ``on_metrics_flush`` event). Larger means fewer synchronisations.
    :param mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; ``None`` honours
        accelerate's configuration and environment (``accelerate launch``).
    :param seed: when given, seeds every library (distinct per process) at the start of each
        ``train()``/``evaluate()``. fasttrain never seeds on its own.
    :param compile_options: keyword arguments for ``torch.compile`` used by the compiled engines.
    :param nonfinite: what a non-finite loss or gradient does (docs/reliability.md):
        ``"stop"`` (default) ends training at the next flush, ``"skip"`` drops the update whose
        gradients are not finite and counts it in ``skipped_updates``, ``"ignore"`` checks
        nothing. Why a run stopped is in ``stop_reason``.
    :param interrupt_save_dir: where to save the training state when SIGINT/SIGTERM stops
        training; by default ``<save_dir>/interrupted`` of a ``SaveTrainingStateCallback``, and
        no save without one.
    :param handle_signals: stop cleanly on the first SIGINT/SIGTERM during ``train()`` (main
        thread only); a second one aborts at once.
    :param resume_data_skip: how a run resumed mid-epoch passes over the batches already trained
        on: ``"sampler"`` draws their indices without loading them, ``"replay"`` loads and drops
        them (needed for an exact resume when data-loader workers draw random augmentations).
    :param activation_checkpointing: module classes (one, or a tuple) whose forward is
        recomputed in the backward instead of keeping its activations
        (:mod:`fasttrain.checkpoint_activations`).
    :param compile_regions: compile each repeated block once instead of the whole model
        (:mod:`fasttrain.regional`): ``True`` finds the blocks, or give their classes. It shortens
        compile time with ``engine="eager"`` (the compiled engines compile the whole step, blocks
        included); it takes ``compile_options``.
    """

    def __init__(
        self,
        model,
        loss_func,
        optimizer,
        callbacks=DEFAULT_CALLBACKS,
        run_history: Optional[RunHistory] = None,
        *,
        engine: str = "auto",
        log_every_n_steps: int = 50,
        mixed_precision: Optional[str] = None,
        seed: Optional[int] = None,
        compile_options: Optional[dict] = None,
        nonfinite: str = "stop",
        interrupt_save_dir=None,
        handle_signals: bool = True,
        resume_data_skip: str = "sampler",
        activation_checkpointing=None,
        compile_regions=None,
    ):
        validation.positive_int("log_every_n_steps", log_every_n_steps)
        validation.engine_name(engine)
        validation.compile_options(compile_options, engine)
        validation.trainer_options(
            nonfinite=nonfinite,
            interrupt_save_dir=interrupt_save_dir,
            handle_signals=handle_signals,
            resume_data_skip=resume_data_skip,
        )
        self.nonfinite = nonfinite
        self.interrupt_save_dir = interrupt_save_dir
        self.handle_signals = handle_signals
        self.resume_data_skip = resume_data_skip
        #: why the last train() ended early: None, "nonfinite_loss", "nonfinite_gradients",
        #: "interrupted" or "stop_training_error" (a callback raised StopTrainingError)
        self.stop_reason: Optional[str] = None
        self._interrupt = signals.InterruptFlag()
        self._nonfinite = NonFiniteGuard(nonfinite)  # rebuilt by train() with the prepared optimizer
        self._nonfinite_applied = False
        self._epoch_in_progress = None
        self._epoch_start_loader_iteration = None
        self.model = validation.apply_model_transforms(
            model, activation_checkpointing, compile_regions, compile_options
        )
        self.loss_func = loss_func
        self.optimizer = optimizer
        self._callbacks = _callback_sequence(callbacks)
        self.callback_handler = self._create_callback_handler()
        self.run_history: RunHistory = run_history if run_history is not None else InMemoryRunHistory()
        self.engine_name = engine
        self.log_every_n_steps = log_every_n_steps
        self.mixed_precision = mixed_precision
        self.seed = seed
        self.compile_options = dict(compile_options or {})
        self._accelerator = self._create_accelerator()
        self._pad_uneven_eval_batches = False
        self._engine = None
        self._clipper: Optional[GradientClipper] = None
        self._num_updates = 0
        self._skipped_updates = 0
        self._resume_position = None
        self._train_buffer: Optional[StepMetricsBuffer] = None
        self._epoch_start_rng = None
        self._step_in_epoch = 0
        self._plain_backward = True
        self._wrapped_optimizer_needed = False
        # filled in by train()/evaluate()
        self.create_scheduler_fn = None
        self.scheduler = None
        self.collate_fn = None
        self.train_dataset = None
        self.eval_dataset = None
        self._train_dataloader = None
        self._train_dl_kwargs = None
        self._eval_dl_kwargs = None
        self._eval_dataloader = None
        self.run_config: Optional[TrainerRunConfig] = None
        self.callback_handler.call_event("on_init_end", self)

    # ------------------------------------------------------------------ construction helpers
    def _create_callback_handler(self) -> CallbackHandler:
        callbacks = []
        limit = os.getenv(LIMIT_BATCHES_ENV_VAR)
        if limit is not None and limit.lower() != "none":
            callbacks.append(LimitBatchesCallback(int(limit)))
        callbacks.extend(self._callbacks)
        return CallbackHandler(callbacks)

    def _create_accelerator(self) -> Accelerator:
        return build_accelerator(self.mixed_precision)

    def create_train_dataloader(self, batch_size: int, train_dl_kwargs: dict = None) -> Iterable:
        """The training dataloader: the defaults of :meth:`get_default_train_dl_kwargs` updated
        with ``train_dl_kwargs``."""
        self._train_dl_kwargs = merge_dataloader_kwargs(self.get_default_train_dl_kwargs(batch_size), train_dl_kwargs)
        return DataLoader(dataset=self.train_dataset, collate_fn=self.collate_fn, **self._train_dl_kwargs)

    def create_eval_dataloader(self, batch_size: int, eval_dl_kwargs: dict = None) -> Iterable:
        """The evaluation dataloader, built like :meth:`create_train_dataloader`."""
        self._eval_dl_kwargs = merge_dataloader_kwargs(self.get_default_eval_dl_kwargs(batch_size), eval_dl_kwargs)
        return DataLoader(dataset=self.eval_dataset, collate_fn=self.collate_fn, **self._eval_dl_kwargs)

    def create_scheduler(self):
        """Call ``create_scheduler_fn`` with the optimizer, placeholders resolved."""
        scheduler_fn = replace_trainer_placeholder_values(self, self.create_scheduler_fn)
        return scheduler_fn(self.optimizer)

    def get_default_train_dl_kwargs(self, batch_size) -> dict:
        return default_dataloader_kwargs(batch_size, shuffle=True)

    def get_default_eval_dl_kwargs(self, batch_size) -> dict:
        return default_dataloader_kwargs(batch_size, shuffle=False)

    @property
    def device(self):
        return self._accelerator.device

    @property
    def num_updates(self) -> int:
        """Optimizer updates performed in the current training run.

        pytorch-accelerated had no such property, and its subclasses (``TrainerWithTimmScheduler``)
        keep their own ``self.num_updates``: an assigned value is theirs and is returned from
        then on, while the trainer keeps counting in ``_num_updates``."""
        return self.__dict__.get("_assigned_num_updates", self._num_updates)

    @num_updates.setter
    def num_updates(self, value) -> None:
        self._assigned_num_updates = value

    @property
    def skipped_updates(self) -> int:
        return self._skipped_updates

    # ------------------------------------------------------------------ hooks
    def training_run_start(self):
        pass

    def train_epoch_start(self):
        self.model.train()

    def calculate_train_batch_loss(self, batch) -> dict:
        """Compute the loss of a training batch. Returns a dict with ``loss``,
        ``model_outputs``, ``batch_size`` and optionally ``num_items_in_batch`` and any other
        keys, which reach the callbacks."""
        xb, yb = batch[0], batch[1]
        model_outputs = self.model(xb)
        loss = self.loss_func(model_outputs, yb)
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": yb.size(0)}

    def backward_step(self, loss):
        if self._plain_backward:
            loss.backward()
        else:
            # a loss scaler (fp16) or DeepSpeed needs accelerate's backward
            self._accelerator.backward(loss)

    def optimizer_step(self):
        optimizer = self._stepping_optimizer()
        # True without a sync except for nonfinite="skip" with a non-fused optimizer
        if self._nonfinite.allow_update():
            optimizer.step()
        if optimizer is not self.optimizer:
            # torch's LR schedulers were given accelerate's wrapper, whose step is bypassed
            # above; they warn "lr_scheduler.step() before optimizer.step()" unless marked
            self.optimizer._opt_called = True

    def scheduler_step(self):
        if self.scheduler is not None:
            self.scheduler.step()

    def optimizer_zero_grad(self):
        self._stepping_optimizer().zero_grad()

    def train_epoch_end(self):
        pass

    def eval_epoch_start(self):
        self.model.eval()

    def calculate_eval_batch_loss(self, batch) -> dict:
        with torch.no_grad():
            xb, yb = batch[0], batch[1]
            model_outputs = self.model(xb)
            loss = self.loss_func(model_outputs, yb)
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": yb.size(0)}

    def eval_epoch_end(self):
        pass

    def training_run_epoch_end(self):
        pass

    def training_run_end(self):
        pass

    def evaluation_run_start(self):
        pass

    def evaluation_run_end(self):
        pass

    # ------------------------------------------------------------------ public entry points
    def train(
        self,
        train_dataset,
        num_epochs,
        eval_dataset=None,
        per_device_batch_size=8,
        max_num_train_steps=None,
        gradient_accumulation_steps=1,
        gradient_clip_value=None,
        create_scheduler_fn=None,
        train_dataloader_kwargs: dict = None,
        eval_dataloader_kwargs: dict = None,
        reset_run_history=True,
        collate_fn=None,
        resume_from=None,
        *,
        gradient_clip_norm=None,
    ):
        """Train the model; evaluate after every epoch when ``eval_dataset`` is given.

        ``max_num_train_steps`` counts optimizer updates and, when given, sets the number of
        epochs. ``gradient_clip_value`` clamps every gradient element, ``gradient_clip_norm``
        rescales all gradients to a global L2 norm; both happen once per update, after the
        gradients of all micro-steps are accumulated. ``resume_from`` is a directory written by
        :meth:`save_training_state`: training continues from the exact step it was saved at.
        """
        validation.train_arguments(
            train_dataset=train_dataset,
            num_epochs=num_epochs,
            per_device_batch_size=per_device_batch_size,
            max_num_train_steps=max_num_train_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
            create_scheduler_fn=create_scheduler_fn,
            eval_dataset=eval_dataset,
        )
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.create_scheduler_fn = create_scheduler_fn
        self.collate_fn = collate_fn
        if resume_from is not None:
            reset_run_history = False
        if reset_run_history:
            self.run_history.reset()
        self._train_dataloader = self.create_train_dataloader(
            batch_size=per_device_batch_size, train_dl_kwargs=train_dataloader_kwargs
        )
        self._eval_dataloader = None
        if self.eval_dataset is not None:
            self._eval_dataloader = self.create_eval_dataloader(
                batch_size=per_device_batch_size, eval_dl_kwargs=eval_dataloader_kwargs
            )
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(
            num_epochs=num_epochs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_num_train_steps=max_num_train_steps,
            per_device_batch_size=per_device_batch_size,
            gradient_clip_value=gradient_clip_value,
        )
        if hasattr(type(self.train_dataset), "__len__"):
            # a sized dataset whose loader yields nothing (drop_last); the loader of a dataset
            # without a length has no meaningful length either
            validation.dataloader_not_empty(self._train_dataloader, "train", per_device_batch_size)
        self._check_eval_batch_size()
        self._clipper = GradientClipper(
            self.model.parameters(), clip_value=gradient_clip_value, clip_norm=gradient_clip_norm
        )
        self.scheduler = self.create_scheduler() if self.create_scheduler_fn is not None else None
        # gradients of a window left open by a run that stopped mid-window must not reach this
        # run's first update (a resumed state brings its own back); cleared before the engine is
        # set up, since the graphed engine keeps the gradient tensors it captures
        self.model.zero_grad(set_to_none=True)
        self._setup_engine()
        self._nonfinite = NonFiniteGuard(
            self.nonfinite, self.optimizer, has_loss_scaler=self._accelerator.scaler is not None
        )
        checkpointing.begin_training(self, resume_from)
        try:
            with signals.handle_interrupts(self):
                self._run_training()
        finally:
            self._nonfinite.close()

    def evaluate(self, dataset=None, per_device_batch_size=8, dataloader_kwargs: dict = None, collate_fn=None):
        """Evaluate the model on ``dataset``; records ``evaluation_loss``. Resets the run
        history."""
        validation.positive_int("per_device_batch_size", per_device_batch_size)
        self.eval_dataset = dataset
        self.collate_fn = collate_fn
        self.run_history.reset()
        self._train_dataloader = None
        self._eval_dataloader = self.create_eval_dataloader(
            batch_size=per_device_batch_size, eval_dl_kwargs=dataloader_kwargs
        )
        self._prepare_model_optimizer_and_dataloaders()
        self.run_config = self._create_run_config(
            num_epochs=1,
            gradient_accumulation_steps=1,
            max_num_train_steps=None,
            per_device_batch_size=per_device_batch_size,
            gradient_clip_value=None,
        )
        validation.dataloader_not_empty(self._eval_dataloader, "eval", per_device_batch_size)
        self._check_eval_batch_size()
        self._setup_engine()
        self._run_evaluation()

    # ------------------------------------------------------------------ setup
    def _prepare_model_optimizer_and_dataloaders(self):
        # The previous run's accelerator lets go of what it prepared. accelerate's own
        # free_memory() also runs a full gc.collect(), which costs a quarter to half a second per
        # train() call and frees nothing still in use, so only the references are dropped.
        for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
            prepared = getattr(self._accelerator, name, None)
            if isinstance(prepared, list):
                prepared.clear()
        self._accelerator = self._create_accelerator()
        if self.seed is not None:
            set_seed(self.seed, device_specific=True)
        acc = self._accelerator
        shard_dataloaders = acc.num_processes > 1 or acc.distributed_type != DistributedType.NO
        components = [self.model, self.optimizer]
        if shard_dataloaders:
            components += [dl for dl in (self._train_dataloader, self._eval_dataloader) if dl is not None]
        prepared = list(acc.prepare(*components))
        self.model, self.optimizer = prepared[0], prepared[1]
        if not shard_dataloaders:
            if self._train_dataloader is not None:
                self._train_dataloader = place_single_process(self._train_dataloader, acc.device)
            if self._eval_dataloader is not None:
                self._eval_dataloader = place_single_process(self._eval_dataloader, acc.device)
            rest = []
        else:
            rest = prepared[2:]
        if rest and self._train_dataloader is not None:
            self._train_dataloader = rest.pop(0)
            # every process sees the same number of training batches, so the update count is
            # known on the host without asking the other processes
            self._train_dataloader.batch_sampler.even_batches = True
        if rest and self._eval_dataloader is not None:
            self._eval_dataloader = rest.pop(0)
            # no padding samples in evaluation: the mean loss is over real samples only. Except
            # with FSDP and ZeRO-3, whose forward all-gathers the parameters: a process with one
            # batch more would wait forever for the others, so there the last batches are padded
            # (docs/distributed.md: a few samples count twice in the eval loss)
            forward_gathers = acc.distributed_type == DistributedType.FSDP or (
                acc.distributed_type == DistributedType.DEEPSPEED
                and getattr(acc.state.deepspeed_plugin, "zero_stage", 0) == 3
            )
            self._eval_dataloader.batch_sampler.even_batches = self._pad_uneven_eval_batches or forward_gathers
        for name in ("_train_dataloader", "_eval_dataloader"):
            if getattr(self, name) is not None:  # the loaders have a device, as prepared ones do
                setattr(self, name, with_device_attribute(getattr(self, name), acc.device))
        self._plain_backward = acc.scaler is None and acc.distributed_type != DistributedType.DEEPSPEED
        # accelerate's optimizer wrapper is needed for loss scaling and for XLA/DeepSpeed/
        # Megatron; otherwise it only adds per-step bookkeeping (package look-ups, signature
        # inspection) that costs more than a small model's whole step
        self._wrapped_optimizer_needed = acc.scaler is not None or acc.distributed_type in (
            DistributedType.XLA,
            DistributedType.DEEPSPEED,
            DistributedType.MEGATRON_LM,
        )

    def _setup_engine(self):
        quiet_profiler_notices()  # the compiled optimizer step's marker is not the user's concern
        self._engine = create_engine(self.engine_name, self)
        self._engine.setup()

    def _create_run_config(
        self, per_device_batch_size, num_epochs, gradient_accumulation_steps, max_num_train_steps, gradient_clip_value
    ) -> TrainerRunConfig:
        return build_run_config(
            self._accelerator,
            train_dataloader=self._train_dataloader,
            train_dl_kwargs=self._train_dl_kwargs,
            eval_dl_kwargs=self._eval_dl_kwargs,
            per_device_batch_size=per_device_batch_size,
            num_epochs=num_epochs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_num_train_steps=max_num_train_steps,
            gradient_clip_value=gradient_clip_value,
        )

    def _check_eval_batch_size(self):
        if self.eval_dataset is None or not self.run_config.is_distributed:
            return
        if self.run_config.eval_total_batch_size > len(self.eval_dataset):
            raise ValueError(
                f"The total evaluation batch size {self.run_config.eval_total_batch_size} across "
                f"all processes is larger than the evaluation dataset ({len(self.eval_dataset)} "
                "samples); lower per_device_batch_size or the eval batch_size."
            )
        sampler = getattr(self._eval_dataloader, "batch_sampler", None)
        if not getattr(sampler, "even_batches", False):  # padded last batches cannot hang
            message = uneven_eval_batches_message(
                len(self.eval_dataset), self.run_config.eval_per_device_batch_size, self.run_config.num_processes
            )
            if message is not None:
                warnings.warn(message, UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ the loops
    def _run_training(self):
        self.training_run_start()
        self.callback_handler.call_event("on_training_run_start", self)
        # a resumed run starts in the saved epoch, possibly after its training part
        epochs_done, train_done = checkpointing.resume_start(self)
        for _ in range(epochs_done, self.run_config.num_epochs):
            try:
                if train_done:
                    train_done = False
                    reached_max_steps = self._num_updates >= self.run_config.max_num_train_steps
                else:
                    reached_max_steps = self._run_train_epoch(self._train_dataloader)
                if self.eval_dataset is not None:
                    self._run_eval_epoch(self._eval_dataloader)
                self.training_run_epoch_end()
                self.callback_handler.call_event("on_training_run_epoch_end", self)
                self.run_history._increment_epoch()
            except StopTrainingError as e:
                self._stop_training(e)
                break
            if reached_max_steps:
                self.print(
                    f"Reached max number of training steps {self.run_config.max_num_train_steps} "
                    f"in epoch {self.run_history.current_epoch - 1}"
                )
                break
        self.training_run_end()
        self.callback_handler.call_event("on_training_run_end", self)

    def _stop_training(self, error: StopTrainingError):
        """End the run after ``error`` and record why (``stop_reason``); a signal's stop saves
        the training state and fires ``on_training_interrupted`` first."""
        if self._accelerator.is_local_main_process:
            # on a line of its own, not after the progress bar of the epoch it interrupted
            tqdm.write(str(error))
        if isinstance(error, signals.TrainingInterrupted):
            signals.finish_interrupted_run(self, error.signal_number)
        elif self.stop_reason is None:
            self.stop_reason = "stop_training_error"
        self.callback_handler.call_event("on_stop_training_error", self)

    def _run_evaluation(self):
        self.evaluation_run_start()
        self.callback_handler.call_event("on_evaluation_run_start", self)
        try:
            self._run_eval_epoch(self._eval_dataloader, is_training=False)
        except StopTrainingError as e:
            self._accelerator.print(e)
            self.callback_handler.call_event("on_stop_training_error", self)
        self.evaluation_run_end()
        self.callback_handler.call_event("on_evaluation_run_end", self)

    def _run_train_epoch(self, train_dl) -> bool:
        self.train_epoch_start()
        handler = self.callback_handler
        handler.call_event("on_train_epoch_start", self)
        buffer = self._train_buffer = StepMetricsBuffer("train", self.run_history.current_epoch)
        k = self.run_config.gradient_accumulation_steps
        max_updates = self.run_config.max_num_train_steps
        num_batches = len(train_dl)
        batches, first_step = checkpointing.epoch_batches(self, train_dl, buffer)
        step_start = handler.handlers("on_train_step_start")
        step_end = handler.handlers("on_train_step_end")
        engine = self._engine
        interrupt = self._interrupt
        reached_max_steps = False
        for step, batch in enumerate(batches, start=first_step):
            self._step_in_epoch = step
            handler.call_methods(step_start, self)
            update = (step + 1) % k == 0 or step + 1 == num_batches
            batch_output = engine.train_step(batch, update)
            buffer.add(step, batch_output)
            if update:
                self._num_updates += 1
                buffer.add_grad_norm(engine.last_grad_norm)
            self._step_in_epoch = step + 1
            handler.call_methods(step_end, self, batch=batch, batch_output=batch_output, step=step)
            if update:
                if self._num_updates % self.log_every_n_steps == 0:
                    self._flush(buffer, is_epoch_end=False)
                if self._num_updates >= max_updates:
                    reached_max_steps = True
                    break
            if interrupt.stop_requested:  # a host bool set by the signal handler
                raise signals.TrainingInterrupted(interrupt.signal_number)
        self.train_epoch_end()
        metrics = self._flush(buffer, is_epoch_end=True)
        self._train_buffer = None
        self._add_epoch_loss_to_run_history("train_loss_epoch", metrics)
        handler.call_event("on_train_epoch_end", self)
        return reached_max_steps

    def _run_eval_epoch(self, valid_dl, is_training: bool = True, is_intermediate: bool = False):
        self.eval_epoch_start()
        handler = self.callback_handler
        loader_before = self._eval_dataloader
        handler.call_event("on_eval_epoch_start", self, is_intermediate=is_intermediate)
        if valid_dl is loader_before and self._eval_dataloader is not loader_before:
            # a callback replaced the loader for this epoch (LimitEvalStepsCallback)
            valid_dl = self._eval_dataloader
        buffer = StepMetricsBuffer("eval", self.run_history.current_epoch)
        step_start = handler.handlers("on_eval_step_start")
        step_end = handler.handlers("on_eval_step_end")
        engine = self._engine
        # an intermediate evaluation belongs to a training step, which finishes it
        interrupt = self._interrupt if not is_intermediate else signals.InterruptFlag()
        # No torch Join around evaluation (accelerate's join_uneven_inputs uses one on GPUs): its
        # DDP hook makes a process that runs out of batches post the all-reduces of a backward
        # pass that never comes in evaluation, so the processes deadlock or mismatch collectives
        # (reproduced with gloo in tests/test_distributed.py). None is needed: under no_grad
        # DDP's forward communicates only to broadcast buffers on the first forward after a
        # synced training forward, and every process has at least one eval batch
        # (_check_eval_batch_size).
        for step, batch in enumerate(valid_dl):
            handler.call_methods(step_start, self)
            batch_output = engine.eval_step(batch)
            buffer.add(step, batch_output)
            handler.call_methods(step_end, self, batch=batch, batch_output=batch_output)
            if len(buffer) >= self.log_every_n_steps:
                self._flush(buffer, is_epoch_end=False)
            if interrupt.stop_requested:  # checked before the next batch is fetched
                raise signals.TrainingInterrupted(interrupt.signal_number)
        self.eval_epoch_end()
        metrics = self._flush(buffer, is_epoch_end=True)
        if is_intermediate:
            name = "intermediate_eval_loss"
        elif is_training:
            name = "eval_loss_epoch"
        else:
            name = "evaluation_loss"
        self._add_epoch_loss_to_run_history(name, metrics)
        handler.call_event("on_eval_epoch_end", self, is_intermediate=is_intermediate)

    def _flush(self, buffer: StepMetricsBuffer, is_epoch_end: bool):
        if len(buffer) == 0 and not is_epoch_end:
            return None
        train = buffer.phase == "train"
        guard = self._nonfinite
        metrics = buffer.flush(
            num_updates=self._num_updates,
            skipped_updates=self._skipped_updates,
            is_epoch_end=is_epoch_end,
            pending_skips=guard.take_pending() if train else None,
        )
        if train:
            self._skipped_updates = metrics.skipped_updates
        # host values only (with several processes, one shared decision about non-finite values
        # and stop signals); records the reason before the event, where TerminateOnNaNCallback
        # may raise first
        stop = guard.check_flush(self, metrics)
        if guard.shared_totals is not None:
            loss_sum, count = guard.shared_totals
            metrics = dataclasses.replace(metrics, global_epoch_loss_sum=loss_sum, global_epoch_sample_count=count)
        self.callback_handler.call_event("on_metrics_flush", self, metrics=metrics)
        if stop is not None:
            raise stop
        return metrics

    def _add_epoch_loss_to_run_history(self, metric_name: str, metrics):
        """Record the epoch's mean loss from its epoch-end flush: host values only. With several
        processes that flush already carries the totals of all of them (shared together with
        the stop decisions), so nothing more is read or reduced here."""
        loss_sum, count = metrics.global_epoch_loss_sum, metrics.global_epoch_sample_count
        if loss_sum is None:  # no process-wide totals at this flush: this process's own
            loss_sum, count = metrics.epoch_loss_sum, metrics.epoch_sample_count
        self.run_history.update_metric(metric_name, loss_sum / count if count else float("nan"))

    # ------------------------------------------------------------------ engine support
    def _loss_for_backward(self, batch_output: dict):
        """The loss that backward sees: divided by the accumulation steps, and multiplied by the
        number of processes for token-normalised losses, whose normaliser already spans all
        processes while DDP averages gradients over them."""
        loss = validation.train_loss(batch_output)  # host-only checks: a clear error before backward
        return self._scale_loss(loss, batch_output)

    def _scale_loss(self, loss, batch_output: dict):
        config = self.run_config
        if "num_items_in_batch" in batch_output and config.is_distributed:
            loss = loss * config.num_processes
        if config.gradient_accumulation_steps > 1:
            loss = loss / config.gradient_accumulation_steps
        return loss

    def _clip_gradients(self):
        """Clip the gradients once per update (after all micro-steps have accumulated); returns
        the global norm as a device tensor when clipping by norm. With ``nonfinite="skip"`` the
        same kernels flag non-finite gradients on the device."""
        guard = self._nonfinite
        if not guard.checks_gradients and (self._clipper is None or not self._clipper.enabled):
            return None
        if self._accelerator.scaler is not None:
            # fp16: gradients are scaled until the optimizer step; clip the true values
            self._accelerator.unscale_gradients()
        return guard.clip(self._clipper)

    def _stepping_optimizer(self):
        """The optimizer whose ``step``/``zero_grad`` the default hooks call: accelerate's
        wrapper when it does real work, the wrapped optimizer otherwise."""
        if self._wrapped_optimizer_needed:
            return self.optimizer
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _optimizer_step_was_skipped(self) -> bool:
        return bool(getattr(self.optimizer, "step_was_skipped", False))

    # ------------------------------------------------------------------ utilities
    def gather(self, tensor, padding_value=None):
        """Gather ``tensor`` from all processes, concatenated on the first dimension; with
        ``padding_value``, tensors of different lengths are padded and the padding removed."""
        if padding_value is not None:
            tensor = self._accelerator.pad_across_processes(tensor, pad_index=padding_value)
        gathered = self._accelerator.gather(tensor)
        if padding_value is not None:
            from fasttrain.utils import remove_padding

            gathered = remove_padding(gathered, padding_value)
        return gathered

    def print(self, *args, **kwargs):
        """``print`` once per node."""
        if self._accelerator is not None:
            self._accelerator.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    def get_model(self, keep_torch_compile=True):
        """The model without its distributed wrappers."""
        return self._accelerator.unwrap_model(self.model, keep_torch_compile=keep_torch_compile)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_path, checkpoint_kwargs=None, save_optimizer=True, save_scheduler=True, save_per_node=True):
        """Save model (and optimizer, scheduler) state and ``checkpoint_kwargs`` as one ``.pt``
        file, written atomically."""
        checkpointing.save_checkpoint(self, save_path, checkpoint_kwargs, save_optimizer, save_scheduler, save_per_node)

    def load_checkpoint(self, checkpoint_path, load_optimizer=True, load_scheduler=True):
        """Load a file written by :meth:`save_checkpoint`; returns the whole dict."""
        return checkpointing.load_checkpoint(self, checkpoint_path, load_optimizer, load_scheduler)

    def save_training_state(self, output_dir, checkpoint_kwargs=None):
        """Save everything needed to continue training from this exact step. Returns False,
        writing nothing, when an update with non-finite values was applied since the last good
        state (``nonfinite="stop"``)."""
        return checkpointing.save_training_state(self, output_dir, checkpoint_kwargs)

    def load_training_state(self, input_dir):
        """Load a directory written by :meth:`save_training_state`; returns its metadata."""
        return checkpointing.load_training_state(self, input_dir)


class TrainerWithTimmScheduler(Trainer):
    """A trainer for timm-style schedulers, which are told the update count
    (``step_update(num_updates)``) after every optimizer update and the epoch
    (``step(epoch)``) after every evaluation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_updates = None

    def train_epoch_start(self):
        super().train_epoch_start()
        self.num_updates = self.run_history.current_epoch * len(self._train_dataloader)

    def eval_epoch_end(self):
        if self.scheduler is not None:
            self.scheduler.step(self.run_history.current_epoch + 1)

    def scheduler_step(self):
        self.num_updates += 1
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.num_updates)
