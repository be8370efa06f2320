"""Set-up of a run, decided once before the first step: accelerate's preparation, the run
configuration and the step context the engine is built with.

Every accelerate and precision decision lives here (which optimizer the hooks step, whether
backward goes through accelerate, what keeps the step out of a CUDA graph), so that the step
loop and the engines never ask again.
"""

from __future__ import annotations

import warnings

import torch

from accelerate.utils import DistributedType, set_seed

from fasttrain import auto_resume, checkpointing, validation
from fasttrain.accelerate_state import check_accelerator
from fasttrain.callbacks.events import asks_for_model_outputs
from fasttrain.data import place_single_process, with_device_attribute
from fasttrain.engine import create_engine
from fasttrain.engine.clipping import GradientClipper, UpdateClip
from fasttrain.engine.context import StepContext, no_sync_for, optimizer_step_was_skipped
from fasttrain.engine.loss_scaling import LossScaling
from fasttrain.nonfinite import NonFiniteGuard
from fasttrain.torch_logs import quiet_profiler_notices
from fasttrain.sharding import reshard_fsdp2
from fasttrain.run_config import TrainerRunConfig, build_run_config, uneven_eval_batches_message


def prepare_run(trainer) -> None:
    """A fresh accelerator prepares the trainer's model, optimizer and (with several processes)
    dataloaders; the loaders of a single process are placed on its device instead."""
    # The previous run's accelerator lets go of what it prepared. accelerate's own
    # free_memory() also runs a full gc.collect(), which costs a quarter to half a second per
    # train() call and frees nothing still in use, so only the references are dropped.
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
        prepared = getattr(trainer._accelerator, name, None)
        if isinstance(prepared, list):
            prepared.clear()
    trainer._accelerator = trainer._create_accelerator()
    # also for an accelerator from an overridden _create_accelerator or a launcher's environment
    check_accelerator(trainer._accelerator)
    if trainer.seed is not None:
        set_seed(trainer.seed, device_specific=True)
    acc = trainer._accelerator
    shard_dataloaders = acc.num_processes > 1 or acc.distributed_type != DistributedType.NO
    reshard_fsdp2(trainer.model)
    optimizer = trainer.optimizer
    if optimizer is None and acc.is_fsdp2:
        # accelerate's FSDP2 preparation refuses a model without an optimizer (it remaps the
        # optimizer's parameters to the sharded ones); an evaluation-only run has none, so a
        # stand-in that is never stepped (plain SGD keeps no state) takes its place
        optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
    components = [trainer.model, optimizer]
    if shard_dataloaders:
        components += [dl for dl in (trainer._train_dataloader, trainer._eval_dataloader) if dl is not None]
    prepared = list(acc.prepare(*components))
    trainer.model = prepared[0]
    if trainer.optimizer is not None:
        trainer.optimizer = prepared[1]
    if not shard_dataloaders:
        if trainer._train_dataloader is not None:
            trainer._train_dataloader = place_single_process(trainer._train_dataloader, acc.device)
        if trainer._eval_dataloader is not None:
            trainer._eval_dataloader = place_single_process(trainer._eval_dataloader, acc.device)
        rest = []
    else:
        rest = prepared[2:]
    if rest and trainer._train_dataloader is not None:
        trainer._train_dataloader = rest.pop(0)
        # every process sees the same number of training batches, so the update count is
        # known on the host without asking the other processes
        trainer._train_dataloader.batch_sampler.even_batches = True
    if rest and trainer._eval_dataloader is not None:
        trainer._eval_dataloader = rest.pop(0)
        # no padding samples in evaluation: the mean loss is over real samples only. Except
        # with FSDP and ZeRO-3, whose forward all-gathers the parameters: a process with one
        # batch more would wait forever for the others, so there the last batches are padded
        # (docs/distributed.md: a few samples count twice in the eval loss)
        forward_gathers = acc.distributed_type == DistributedType.FSDP or (
            acc.distributed_type == DistributedType.DEEPSPEED
            and getattr(acc.state.deepspeed_plugin, "zero_stage", 0) == 3
        )
        trainer._eval_dataloader.batch_sampler.even_batches = trainer._pad_uneven_eval_batches or forward_gathers
    for name in ("_train_dataloader", "_eval_dataloader"):
        if getattr(trainer, name) is not None:  # the loaders have a device, as prepared ones do
            setattr(trainer, name, with_device_attribute(getattr(trainer, name), acc.device))
    trainer._plain_backward = acc.scaler is None and acc.distributed_type != DistributedType.DEEPSPEED
    # accelerate's optimizer wrapper is needed for loss scaling and for XLA/DeepSpeed/
    # Megatron; otherwise it only adds per-step bookkeeping (package look-ups, signature
    # inspection) that costs more than a small model's whole step
    trainer._wrapped_optimizer_needed = acc.scaler is not None or acc.distributed_type in (
        DistributedType.XLA,
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
    )


def stepping_optimizer(trainer):
    """The optimizer whose ``step``/``zero_grad`` the default hooks call: accelerate's wrapper
    when it does real work, the wrapped optimizer otherwise. (The hooks write this test out
    themselves: they run every update.)"""
    if trainer._wrapped_optimizer_needed:
        return trainer.optimizer
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def clears_like_torch(optimizer) -> bool:
    """Whether ``optimizer.zero_grad()`` is torch's own, so that :func:`clear_gradients` may do
    its work: not overridden by the optimizer's class or on the instance (accelerate's wrapper,
    a ZeRO optimizer or a user's subclass keep theirs), and no profiler running (torch's labels
    the zeroing in a trace)."""
    return (
        type(optimizer).zero_grad is _TORCH_ZERO_GRAD
        and "zero_grad" not in optimizer.__dict__
        and not torch._C._autograd._profiler_enabled()
    )


def clear_gradients(optimizer) -> None:
    """What torch's ``optimizer.zero_grad()`` (``set_to_none=True``) does: every parameter of
    every group loses its gradient. Written out, it costs a few attribute writes; torch's call
    also enters a dynamo-disabling wrapper and a profiler range, about 7 microseconds a step on
    the overhead workload (benchmarks/README.md), which is most of what a launch-bound step's
    default hooks cost."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def create_run_config(
    trainer, per_device_batch_size, num_epochs, gradient_accumulation_steps, max_num_train_steps, gradient_clip_value
) -> TrainerRunConfig:
    return build_run_config(
        trainer._accelerator,
        train_dataloader=trainer._train_dataloader,
        train_dl_kwargs=trainer._train_dl_kwargs,
        eval_dl_kwargs=trainer._eval_dl_kwargs,
        per_device_batch_size=per_device_batch_size,
        num_epochs=num_epochs,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_num_train_steps=max_num_train_steps,
        gradient_clip_value=gradient_clip_value,
    )


def check_eval_batch_size(trainer) -> None:
    """With several processes: an error when the evaluation set cannot give every process a
    batch, and a warning when the last batches are uneven (some samples count twice)."""
    config = trainer.run_config
    if trainer.eval_dataset is None or not config.is_distributed:
        return
    if config.eval_total_batch_size > len(trainer.eval_dataset):
        raise ValueError(
            f"The total evaluation batch size {config.eval_total_batch_size} across "
            f"all processes is larger than the evaluation dataset ({len(trainer.eval_dataset)} "
            "samples); lower per_device_batch_size or the eval batch_size."
        )
    sampler = getattr(trainer._eval_dataloader, "batch_sampler", None)
    if not getattr(sampler, "even_batches", False):  # padded last batches cannot hang
        message = uneven_eval_batches_message(
            len(trainer.eval_dataset), config.eval_per_device_batch_size, config.num_processes
        )
        if message is not None:
            # to the train() call: through Trainer._check_eval_batch_size, set_up_training, train
            warnings.warn(message, UserWarning, stacklevel=5)


def step_context(trainer, base: type) -> StepContext:
    """The step context of the trainer's current run; ``base`` is the class whose hooks count
    as the defaults (a subclass overriding one changes what the graphed engine may do)."""
    config = trainer.run_config
    trainer._update_clip = UpdateClip(trainer._nonfinite, trainer._clipper, trainer._accelerator)
    blockers = ()
    if not trainer._plain_backward or trainer._wrapped_optimizer_needed:
        blockers = ("fp16 loss scaling and DeepSpeed check the gradients on the host every step",)
    blockers += trainer._unchecked_step_python(base)
    distributed = config is not None and config.is_distributed

    def train_batches():
        try:
            return len(trainer._train_dataloader)
        except TypeError:  # no loader (evaluate()) or one without a length
            return None

    step_in_epoch, last_batch = trainer._epoch_position()
    return StepContext(
        trainer=trainer,
        loss_for_backward=LossScaling.from_run_config(config) if config is not None else LossScaling(),
        clip=trainer._clip_for_update(),
        step_was_skipped=lambda: optimizer_step_was_skipped(trainer.optimizer),
        no_sync=no_sync_for(trainer._accelerator, lambda: trainer.model, distributed),
        overridden_hooks=trainer._overridden_step_hooks(base),
        capture_blockers=blockers,
        training=trainer._train_dataloader is not None,
        step_in_epoch=step_in_epoch,
        train_batches=train_batches,
        last_batch=last_batch,
        mutated_flags=trainer._update_clip.mutated_flags,
        update_read_host=lambda: trainer._nonfinite.last_update_read_host,
        before_update_capture=trainer._update_clip.before_capture,
        host_effects=trainer._host_effects(),
        zero_grad_before_step=trainer._zero_grad_before_step(),
        compile_owner=trainer._compile_owner(),
        keeps_model_outputs=lambda phase: any(
            asks_for_model_outputs(cb, phase) for cb in trainer.callback_handler.callbacks
        ),
    )


def setup_engine(trainer, base: type) -> None:
    """Build the run's step context and the engine named by ``trainer.engine_name``."""
    quiet_profiler_notices()  # the compiled optimizer step's marker is not the user's concern
    trainer._step_context = step_context(trainer, base)
    trainer._engine = create_engine(trainer.engine_name, trainer._step_context)
    trainer._engine.setup()


def set_up_training(
    trainer,
    base: type,
    *,
    train_dataset,
    num_epochs,
    eval_dataset,
    per_device_batch_size,
    max_num_train_steps,
    gradient_accumulation_steps,
    gradient_clip_value,
    gradient_clip_norm,
    create_scheduler_fn,
    train_dataloader_kwargs,
    eval_dataloader_kwargs,
    reset_run_history,
    collate_fn,
    resume_from,
) -> None:
    """Everything ``train()`` decides before its first epoch, in dependency order: arguments ->
    loaders ->
    accelerate -> run configuration -> clipping and scheduler -> engine -> non-finite guard ->
    resume point. ``base`` is the class whose hooks count as the defaults."""
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
    trainer.train_dataset = train_dataset
    trainer.eval_dataset = eval_dataset
    trainer.create_scheduler_fn = create_scheduler_fn
    trainer.collate_fn = collate_fn
    # "latest" becomes the run's newest complete state, or None: a fresh start like any other
    resume_from = auto_resume.resolve(trainer, resume_from)
    if resume_from is not None:
        reset_run_history = False
    if reset_run_history:
        trainer.run_history.reset()
    trainer._train_dataloader = trainer.create_train_dataloader(
        batch_size=per_device_batch_size, train_dl_kwargs=train_dataloader_kwargs
    )
    trainer._eval_dataloader = None
    if trainer.eval_dataset is not None:
        trainer._eval_dataloader = trainer.create_eval_dataloader(
            batch_size=per_device_batch_size, eval_dl_kwargs=eval_dataloader_kwargs
        )
    # accelerate, the run config and the evaluation check go through the trainer's methods
    # (pytorch-accelerated's names), which a subclass may override as it could there
    trainer._prepare_model_optimizer_and_dataloaders()
    trainer.run_config = trainer._create_run_config(
        num_epochs=num_epochs,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_num_train_steps=max_num_train_steps,
        per_device_batch_size=per_device_batch_size,
        gradient_clip_value=gradient_clip_value,
    )
    validation.ddp_options(trainer.model, gradient_accumulation_steps)
    if hasattr(type(trainer.train_dataset), "__len__"):
        # a sized dataset whose loader yields nothing (drop_last); the loader of a dataset
        # without a length has no meaningful length either
        validation.dataloader_not_empty(trainer._train_dataloader, "train", per_device_batch_size)
    trainer._check_eval_batch_size()
    # a subclass's own _clip_gradients replaces the clipping by value (Trainer._own_clipping)
    own_clipping = trainer._clip_for_update() == trainer._own_clipping
    trainer._clipper = GradientClipper(
        trainer.model.parameters(), clip_value=None if own_clipping else gradient_clip_value, clip_norm=gradient_clip_norm
    )
    trainer.scheduler = trainer.create_scheduler() if trainer.create_scheduler_fn is not None else None
    # gradients of a window left open by a run that stopped mid-window must not reach this
    # run's first update (a resumed state brings its own back); cleared before the engine is
    # set up, since the graphed engine keeps the gradient tensors it captures
    trainer.model.zero_grad(set_to_none=True)
    setup_engine(trainer, base)
    # after the engine's set-up, which may make the optimizer capturable
    trainer._nonfinite = NonFiniteGuard(
        trainer.nonfinite, trainer.optimizer, has_loss_scaler=trainer._accelerator.scaler is not None
    )
    trainer._update_clip.guard = trainer._nonfinite
    checkpointing.begin_training(trainer, resume_from)
