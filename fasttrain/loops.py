"""The epoch loops: one training epoch and one evaluation epoch.

Read :func:`train_epoch` top to bottom to see a training epoch: each micro-step runs through the
engine chosen at set-up, its loss stays on the device, and the host sees step metrics only at
flushes (every ``log_every_n_steps`` optimizer updates and at epoch ends).
"""

from __future__ import annotations

from tqdm import tqdm

from fasttrain import checkpointing, signals
from fasttrain.callbacks import CallbackMethodNotImplementedError, StopTrainingError
from fasttrain.step_metrics import StepMetricsBuffer, add_epoch_loss_to_run_history, flush


def train_epoch(trainer, train_dl) -> bool:
    """Train on every batch of ``train_dl`` (from the resume point of a resumed epoch);
    returns True when ``max_num_train_steps`` was reached."""
    trainer.train_epoch_start()
    handler = trainer.callback_handler
    handler.call_event("on_train_epoch_start", trainer)
    trainer._engine.start_train_epoch()  # after the callbacks, which may unfreeze layers
    buffer = trainer._train_buffer = StepMetricsBuffer("train", trainer.run_history.current_epoch)
    k = trainer.run_config.gradient_accumulation_steps
    max_updates = trainer.run_config.max_num_train_steps
    num_batches = len(train_dl)
    batches, first_step = checkpointing.epoch_batches(trainer, train_dl, buffer)
    # Resolved once per epoch, so a step pays no lookup. These are the handler's live lists:
    # adding, removing or reassigning callbacks (handler.callbacks.remove(cb), ...) updates them
    # in place, so a change made mid-epoch applies from the next event, not the next epoch.
    step_start = handler.handlers("on_train_step_start")
    step_end = handler.handlers("on_train_step_end")
    engine = trainer._engine
    interrupt = trainer._interrupt
    progress = trainer.progress
    reached_max_steps = False
    # The per-step work of the loop stays a few attribute reads: on a launch-bound GPU step
    # (benchmarks/README.md, the overhead workload) every call here is host time per step.
    for step, batch in enumerate(batches, start=first_step):
        progress.step_in_epoch = step
        if step_start:  # an event without callbacks costs no call
            handler.call_methods(step_start, trainer)
        update = (step + 1) % k == 0 or step + 1 == num_batches
        batch_output = engine.train_step(batch, update)
        buffer.add(step, batch_output)
        if update:
            progress.num_updates += 1
            if engine.last_grad_norm is not None:
                buffer.add_grad_norm(engine.last_grad_norm)
        progress.step_in_epoch = step + 1
        if step_end and handler._enabled:
            # CallbackHandler.call_methods, written out: it runs every micro-step, and forwarding
            # the arguments through *args/**kwargs there costs as much as a cheap callback
            for method in step_end:
                try:
                    method(trainer, batch=batch, batch_output=batch_output, step=step)
                except CallbackMethodNotImplementedError:
                    continue
        if update:
            if progress.num_updates % trainer.log_every_n_steps == 0:
                flush(trainer, buffer, is_epoch_end=False)
            if progress.num_updates >= max_updates:
                reached_max_steps = True
                break
        if interrupt.stop_requested:  # a host bool set by the signal handler
            raise signals.TrainingInterrupted(interrupt.signal_number)
    trainer.train_epoch_end()
    metrics = flush(trainer, buffer, is_epoch_end=True)
    trainer._train_buffer = None
    add_epoch_loss_to_run_history(trainer, "train_loss_epoch", metrics)
    handler.call_event("on_train_epoch_end", trainer)
    return reached_max_steps


def eval_epoch(trainer, valid_dl, is_training: bool = True, is_intermediate: bool = False) -> None:
    """Evaluate on every batch of ``valid_dl``; records ``eval_loss_epoch`` during training,
    ``evaluation_loss`` in ``evaluate()`` and ``intermediate_eval_loss`` mid-epoch."""
    trainer.eval_epoch_start()
    handler = trainer.callback_handler
    loader_before = trainer._eval_dataloader
    handler.call_event("on_eval_epoch_start", trainer, is_intermediate=is_intermediate)
    if valid_dl is loader_before and trainer._eval_dataloader is not loader_before:
        # a callback replaced the loader for this epoch (LimitEvalStepsCallback)
        valid_dl = trainer._eval_dataloader
    buffer = StepMetricsBuffer("eval", trainer.run_history.current_epoch)
    step_start = handler.handlers("on_eval_step_start")  # live lists, as in train_epoch
    step_end = handler.handlers("on_eval_step_end")
    engine = trainer._engine
    # an intermediate evaluation belongs to a training step, which finishes it
    interrupt = trainer._interrupt if not is_intermediate else signals.InterruptFlag()
    # No torch Join around evaluation (accelerate's join_uneven_inputs uses one on GPUs): its
    # DDP hook makes a process that runs out of batches post the all-reduces of a backward
    # pass that never comes in evaluation, so the processes deadlock or mismatch collectives
    # (reproduced with gloo in tests/test_distributed.py). None is needed: under no_grad
    # DDP's forward communicates only to broadcast buffers on the first forward after a
    # synced training forward, and every process has at least one eval batch
    # (prepare.check_eval_batch_size).
    for step, batch in enumerate(valid_dl):
        handler.call_methods(step_start, trainer)
        batch_output = engine.eval_step(batch)
        buffer.add(step, batch_output)
        handler.call_methods(step_end, trainer, batch=batch, batch_output=batch_output)
        if len(buffer) >= trainer.log_every_n_steps:
            flush(trainer, buffer, is_epoch_end=False)
        if interrupt.stop_requested:  # checked before the next batch is fetched
            raise signals.TrainingInterrupted(interrupt.signal_number)
    trainer.eval_epoch_end()
    metrics = flush(trainer, buffer, is_epoch_end=True)
    if is_intermediate:
        name = "intermediate_eval_loss"
    elif is_training:
        name = "eval_loss_epoch"
    else:
        name = "evaluation_loss"
    add_epoch_loss_to_run_history(trainer, name, metrics)
    handler.call_event("on_eval_epoch_end", trainer, is_intermediate=is_intermediate)


def stop_training(trainer, error: StopTrainingError) -> None:
    """End the run after ``error`` and record why (``stop_reason``); a signal's stop saves the
    training state and fires ``on_training_interrupted`` first."""
    if trainer._accelerator.is_local_main_process:
        # on a line of its own, not after the progress bar of the epoch it interrupted
        tqdm.write(str(error))
    if isinstance(error, signals.TrainingInterrupted):
        signals.finish_interrupted_run(trainer, error.signal_number)
    elif trainer.stop_reason is None:
        trainer.stop_reason = "stop_training_error"
    trainer.callback_handler.call_event("on_stop_training_error", trainer)


def run_evaluation(trainer) -> None:
    """The whole of ``evaluate()`` after set-up: one evaluation epoch between the run hooks."""
    trainer.evaluation_run_start()
    trainer.callback_handler.call_event("on_evaluation_run_start", trainer)
    try:
        # through the trainer's method, as train()'s epoch loop does: a subclass may override it
        trainer._run_eval_epoch(trainer._eval_dataloader, is_training=False)
    except StopTrainingError as e:
        trainer._accelerator.print(e)
        trainer.callback_handler.call_event("on_stop_training_error", trainer)
    trainer.evaluation_run_end()
    trainer.callback_handler.call_event("on_evaluation_run_end", trainer)
