"""The Trainer: pytorch-accelerated's API, with a step loop that never waits on the device.

Read :meth:`Trainer.train` for a run: set-up (prepare.py), then the epoch loop, whose training
epoch (loops.py) runs each micro-step through the step engine chosen at set-up (engine/). The
loss stays on the device; the host sees step metrics only at flushes (step_metrics.py), every
``log_every_n_steps`` optimizer updates and at epoch ends. docs/architecture.md has the picture.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from fasttrain import checkpointing, loops, prepare, signals
from fasttrain.accelerate_state import build_accelerator, check_accelerator, GivenAccelerator
from fasttrain.compat import ForwardBackwardHelper
from fasttrain.engine_seams import EngineSeams
from fasttrain.callbacks import (
    CallbackHandler,
    LimitBatchesCallback,
    StopTrainingError,
    get_default_callbacks,
)
from fasttrain.data import default_dataloader_kwargs, merge_dataloader_kwargs
from fasttrain.engine.clipping import GradientClipper
from fasttrain.engine.loss_scaling import LossScaling
from fasttrain.nonfinite import NonFiniteGuard
from fasttrain.placeholders import TrainerPlaceholderValues, resolve_placeholders
from fasttrain.progress import TrainProgress
from fasttrain.run_config import TrainerRunConfig
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
from accelerate.utils import DistributedType, set_seed  # noqa: F401
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


def _engine_running(engine, attribute: str) -> Optional[str]:
    # eager has one path for both phases and no fallback: its name is what runs
    return None if engine is None else getattr(engine, attribute, engine.name)


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


class Trainer(EngineSeams, ForwardBackwardHelper):
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
        (:mod:`fasttrain.regional`): ``True`` finds the blocks, or give their classes. With
        ``engine="eager"`` each block class is compiled once; inside the compiled engines' step the
        graph breaks at each block, which runs that same compiled block. It takes ``compile_options``;
        on the CPU, blocks run eagerly compile with Inductor's C++ wrapper unless those name a
        ``mode``, another backend or ``options={"cpp_wrapper": ...}``.
    :param accelerator_kwargs: keyword arguments for accelerate's ``Accelerator``, for the
        distributed set-up: ``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)``,
        ``parallelism_config``, ``kwargs_handlers=[DistributedDataParallelKwargs(...)]``
        (docs/distributed.md). Mixed precision is ``mixed_precision``'s.
    :param accelerator: a ready ``accelerate.Accelerator`` used for every ``train()`` and
        ``evaluate()`` instead of one built per run; its settings are its own, so it excludes
        ``accelerator_kwargs`` and ``mixed_precision``.
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
        accelerator_kwargs: Optional[dict] = None,
        accelerator: Optional[Accelerator] = None,
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
        #: the run's counters: updates, the step in the epoch, the resume point (progress.py);
        #: every train() resets them
        self.progress = TrainProgress()
        self._train_buffer = None  # the training epoch's step metrics while it runs (loops.py)
        self._interrupt = signals.InterruptFlag()
        self._nonfinite = NonFiniteGuard(nonfinite)  # rebuilt by train() with the prepared optimizer
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
        self.accelerator_kwargs = validation.accelerator_kwargs(accelerator_kwargs, mixed_precision)
        given = validation.ready_accelerator(accelerator, accelerator_kwargs, mixed_precision)
        self._given_accelerator = GivenAccelerator(given) if given is not None else None
        self._accelerator = self._create_accelerator()
        check_accelerator(self._accelerator)
        self._pad_uneven_eval_batches = False
        self._engine = None
        self._step_context = None  # built with the engine by prepare.setup_engine
        self._clipper: Optional[GradientClipper] = None
        self._update_clip = None
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
        if self._given_accelerator is not None:
            return self._given_accelerator.get()
        return build_accelerator(self.mixed_precision, **self.accelerator_kwargs)

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
        then on, while the trainer keeps counting in ``progress.num_updates``."""
        return self.__dict__.get("_assigned_num_updates", self.progress.num_updates)

    @num_updates.setter
    def num_updates(self, value) -> None:
        self._assigned_num_updates = value

    @property
    def skipped_updates(self) -> int:
        return self.progress.skipped_updates

    @property
    def active_engine(self) -> Optional[str]:
        """The engine that runs the training steps (``"eager"``, ``"compiled"`` or
        ``"cudagraph"``): what ``engine="auto"`` chose, after any fallback. None before the
        engine is set up (the first ``train()`` or ``evaluate()``)."""
        return _engine_running(self._engine, "active_engine")

    @property
    def active_eval_engine(self) -> Optional[str]:
        """The engine that runs the evaluation steps, as :attr:`active_engine`."""
        return _engine_running(self._engine, "active_eval_engine")

    @property
    def compiled_graphs(self) -> dict:
        """What each compiled forward hook became when it was first traced:
        ``{"calculate_train_batch_loss": HookGraphs(graphs=1, breaks=0, reasons=()), ...}``
        (``fasttrain.engine.graph_report``), counted from dynamo's own records. A hook traced
        whole is one graph; one with graph breaks is several. Empty before the engine is set up
        and for hooks that run eagerly."""
        return {} if self._engine is None else dict(self._engine.compiled_graphs)

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
        # shape[0], an attribute, rather than size(0), a call through torch's argument parser
        return {"loss": loss, "model_outputs": model_outputs, "batch_size": yb.shape[0]}

    def backward_step(self, loss):
        if self._plain_backward:
            loss.backward()
        else:
            # a loss scaler (fp16) or DeepSpeed needs accelerate's backward
            self._accelerator.backward(loss)

    def optimizer_step(self):
        # prepare.stepping_optimizer, written out: this hook and the next run every update
        optimizer = self.optimizer
        if not self._wrapped_optimizer_needed:
            optimizer = getattr(optimizer, "optimizer", optimizer)
        guard = self._nonfinite
        # True without a sync except for nonfinite="skip" with a non-fused optimizer
        if guard.always_allows or guard.allow_update():
            optimizer.step()
        if optimizer is not self.optimizer:
            # torch's LR schedulers were given accelerate's wrapper, whose step is bypassed
            # above; they warn "lr_scheduler.step() before optimizer.step()" unless marked
            self.optimizer._opt_called = True

    def scheduler_step(self):
        if self.scheduler is not None:
            self.scheduler.step()

    def optimizer_zero_grad(self):
        optimizer = self.optimizer
        if not self._wrapped_optimizer_needed:
            optimizer = getattr(optimizer, "optimizer", optimizer)
        if prepare.clears_like_torch(optimizer):
            prepare.clear_gradients(optimizer)  # zero_grad() without its per-call wrappers
        else:
            optimizer.zero_grad()

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
        ``resume_from="latest"`` continues from the newest complete state in the run's state
        directory (a ``SaveTrainingStateCallback``'s ``save_dir``, ``interrupt_save_dir``), or
        starts from the beginning when there is none: the same call starts a run and resumes it
        after a restart (docs/reliability.md, "Failures at scale").
        """
        # every decision about the run is made here, once: arguments, loaders, accelerate,
        # clipping, the scheduler, the engine and its step context, the non-finite guard, the
        # resume point
        prepare.set_up_training(
            self,
            Trainer,
            train_dataset=train_dataset,
            num_epochs=num_epochs,
            eval_dataset=eval_dataset,
            per_device_batch_size=per_device_batch_size,
            max_num_train_steps=max_num_train_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
            create_scheduler_fn=create_scheduler_fn,
            train_dataloader_kwargs=train_dataloader_kwargs,
            eval_dataloader_kwargs=eval_dataloader_kwargs,
            reset_run_history=reset_run_history,
            collate_fn=collate_fn,
            resume_from=resume_from,
        )
        self._run_training()

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
        prepare.setup_engine(self, Trainer)
        self._run_evaluation()

    # ------------------------------------------------------------------ the run's seams
    # pytorch-accelerated's private names for the parts of a run. train() and evaluate() go
    # through them, so a subclass that overrides one (or a test that patches it) changes the run
    # as it did in the original; each is a thin entry to prepare.py or loops.py, where the work
    # is done. Callbacks call the epoch methods too (an evaluation in the middle of a training
    # epoch, say). docs/migrating.md lists them; pytorch-accelerated's own test suite, run in CI,
    # guards them.
    def _create_run_config(
        self, per_device_batch_size, num_epochs, gradient_accumulation_steps, max_num_train_steps, gradient_clip_value
    ) -> TrainerRunConfig:
        """The run config of the run being set up, from the prepared loaders and accelerator."""
        return prepare.create_run_config(
            self,
            per_device_batch_size=per_device_batch_size,
            num_epochs=num_epochs,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_num_train_steps=max_num_train_steps,
            gradient_clip_value=gradient_clip_value,
        )

    def _prepare_model_optimizer_and_dataloaders(self):
        """A fresh accelerator prepares the model, the optimizer and (with several processes)
        the dataloaders; a single process's loaders are placed on its device."""
        prepare.prepare_run(self)

    def _check_eval_batch_size(self):
        """With several processes: a ``ValueError`` when the evaluation set cannot give every
        process a batch, a warning when the last evaluation batches are uneven."""
        prepare.check_eval_batch_size(self)

    def _run_training(self):
        """The epoch loop of :meth:`train`, after its set-up: training and evaluation epochs
        between the run hooks, until the epochs or ``max_num_train_steps`` are done or training
        is stopped."""
        try:
            with signals.handle_interrupts(self):
                self.training_run_start()
                self.callback_handler.call_event("on_training_run_start", self)
                # a resumed run starts in the saved epoch, possibly after its training part
                epochs_done, train_done = checkpointing.resume_start(self)
                for _ in range(epochs_done, self.run_config.num_epochs):
                    try:
                        if train_done:
                            train_done = False
                            reached_max_steps = self.progress.num_updates >= self.run_config.max_num_train_steps
                        else:
                            reached_max_steps = self._run_train_epoch(self._train_dataloader)
                        if self.eval_dataset is not None:
                            self._run_eval_epoch(self._eval_dataloader)
                        self.training_run_epoch_end()
                        self.callback_handler.call_event("on_training_run_epoch_end", self)
                        self.run_history._increment_epoch()
                    except StopTrainingError as e:
                        loops.stop_training(self, e)
                        break
                    if reached_max_steps:
                        self.print(
                            f"Reached max number of training steps {self.run_config.max_num_train_steps} "
                            f"in epoch {self.run_history.current_epoch - 1}"
                        )
                        break
                self.training_run_end()
                self.callback_handler.call_event("on_training_run_end", self)
        finally:
            self._nonfinite.close()

    def _run_evaluation(self):
        """The whole of :meth:`evaluate` after its set-up."""
        loops.run_evaluation(self)

    def _run_train_epoch(self, train_dl) -> bool:
        """One training epoch over ``train_dl``; True when ``max_num_train_steps`` was reached."""
        return loops.train_epoch(self, train_dl)

    def _run_eval_epoch(self, valid_dl, is_training: bool = True, is_intermediate: bool = False):
        """One evaluation epoch over ``valid_dl``."""
        loops.eval_epoch(self, valid_dl, is_training=is_training, is_intermediate=is_intermediate)

    def _clip_for_update(self):
        """The callable that clips the gradients once per update (a subclass may add steps
        around the clipping); the step context hands it to the engine."""
        if type(self)._clip_gradients is not Trainer._clip_gradients:
            return self._own_clipping  # a subclass clips its own way (pytorch-accelerated's seam)
        return self._update_clip

    def _clip_gradients(self):
        """pytorch-accelerated's place for how gradients are clipped: called once per update,
        before :meth:`optimizer_step`, where ``gradient_clip_value`` is set. A subclass that
        overrides it clips its own way (by norm, say) instead of fasttrain's fused clipping by
        value; this default clips by value as that does."""
        self._accelerator.clip_grad_value_(self.model.parameters(), clip_value=self.run_config.gradient_clip_value)

    def _own_clipping(self):
        # a subclass's _clip_gradients takes the place of the clipping by value (the clipper is
        # built without it, prepare.py); the norm clipping and the non-finite check still follow
        if self.run_config.gradient_clip_value is not None:
            self._clip_gradients()
        return self._update_clip()

    def _scale_loss(self, loss, batch_output: dict):
        # the scaling of the engines, for pytorch-accelerated's _perform_forward_and_backward_passes
        return LossScaling.from_run_config(self.run_config).scale(loss, batch_output)

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
        file, written atomically. A sharded (FSDP2) model's state is gathered whole first, so
        the file loads with any number of processes; every process must call this."""
        checkpointing.save_checkpoint(self, save_path, checkpoint_kwargs, save_optimizer, save_scheduler, save_per_node)

    def load_checkpoint(self, checkpoint_path, load_optimizer=True, load_scheduler=True):
        """Load a file written by :meth:`save_checkpoint`; returns the whole dict."""
        return checkpointing.load_checkpoint(self, checkpoint_path, load_optimizer, load_scheduler)

    def save_training_state(self, output_dir, checkpoint_kwargs=None):
        """Save everything needed to continue training from this exact step (a sharded model's
        shards through ``torch.distributed.checkpoint``, by every process). Returns False,
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
