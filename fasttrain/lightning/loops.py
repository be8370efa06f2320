"""Lightning's fit, evaluation and prediction loops, each batch run by a fasttrain step engine.

Read :func:`run_fit` top to bottom for Lightning's order: batch hooks -> the engine's step
(training_step, backward, clip, optimizer step) -> schedulers -> ``on_train_batch_end`` ->
loggers (every ``log_every_n_steps`` stepping batches: the one host copy of the logged values)
-> validation when due; then the epoch-end hooks, the epoch metrics, the next epoch.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Mapping

import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.seed import isolate_rng

from lightning.pytorch.loops import _EvaluationLoop as _LightningEvaluationLoop
from lightning.pytorch.loops.utilities import _verify_dataloader_idx_requirement
from lightning.pytorch.trainer.states import RunningStage

from fasttrain.lightning.arguments import check_interval_fits_epoch, num_batches
from fasttrain.lightning.combined import CombinedData, check_trainable_mode, flat, limited_counts, set_sampler_epoch
from fasttrain.lightning.grad_modes import evaluation_context
from fasttrain.lightning.profiler import profiling, strategy_action, timed, timed_iterator
from fasttrain.lightning.progress_bars import EpochProgressBar
from fasttrain.lightning.skipped_steps import StepReturnedNone, skip_none_batch, skip_step


# ---------------------------------------------------------------------------------- batches
def transfer(lt, batch, dataloader_idx: int = 0):
    """Lightning's batch hooks around the move to the device: the DataModule's or the module's
    override, as chosen at the run's start (skipped when neither overrides the hook)."""
    selected = lt._batch_hooks
    hook = selected["on_before_batch_transfer"]
    if hook is not None:
        batch = hook(batch, dataloader_idx)
    hook = selected["transfer_batch_to_device"]
    if hook is not None:
        batch = hook(batch, lt.lightning_module.device, dataloader_idx)
    elif lt._device.type != "cpu":
        batch = lt._hooks.module_hook("transfer_batch_to_device", batch, lt.lightning_module.device, dataloader_idx)
    hook = selected["on_after_batch_transfer"]
    if hook is not None:
        batch = hook(batch, dataloader_idx)
    return batch


def prepare_eval_loader(runner, loader):
    """An evaluation loader (each loader combined in it) sharded over the processes, without
    padding samples (the epoch means are over real samples only)."""
    if isinstance(loader, CombinedData):
        return loader.map(lambda part: prepare_eval_loader(runner, part))
    prepared = runner._accelerator.prepare(loader)
    prepared.batch_sampler.even_batches = False
    return prepared


def prepare_train_loader(runner, loader):
    """A training loader (each loader combined in it) sharded over the processes, each process
    taking the same number of batches."""
    if isinstance(loader, CombinedData):
        return loader.map(lambda part: prepare_train_loader(runner, part))
    prepared = runner._accelerator.prepare(loader)
    prepared.batch_sampler.even_batches = True
    return prepared


# ---------------------------------------------------------------------------------- fit
def run_fit(lt, runner) -> None:
    hooks = lt._hooks
    state = lt.fit_loop
    epoch_loop = state.epoch_loop
    engine = runner._engine
    distributed = runner.run_config.is_distributed
    if distributed:
        # accelerate's prepared loaders shard the batches over the processes
        lt._train_loader = runner._train_dataloader
        lt._val_loaders = [prepare_eval_loader(runner, dl) for dl in lt._val_loaders]
    # on_fit_start has run in fit(): Lightning calls it before requesting the dataloaders
    # not when the tuner runs the loop again (fit_loop.run(), as Lightning's runs no sanity check)
    if lt._num_sanity_batches() > 0 and not lt._restarting and not state._again:
        lt.sanity_checking = True
        hooks.callbacks_only("on_sanity_check_start")
        # as in Lightning, the sanity check leaves the random state as it found it, so the
        # training data order does not depend on whether it ran
        with isolate_rng():
            run_evaluation(lt, runner, "validate", sanity=True)
        hooks.callbacks_only("on_sanity_check_end")
        # as in Lightning, the sanity check leaves no trace in the validation loop's counters,
        # and what its hooks read of its values goes
        lt._logger_connector.reset_metrics()
        lt._pbar_metrics.clear()
        epoch_loop.val_loop.batch_progress.reset()
        lt.sanity_checking = False
    check_interval_fits_epoch(lt.val_check_interval, lt)  # after the sanity check, as in Lightning
    # Lightning creates the first epoch's data iterator here, after the sanity check and before
    # on_train_start (a DataLoader draws its base seed when the iterator is created)
    iterator, state._iterator_ahead = state._iterator_ahead, None
    if iterator is None or distributed:  # (sharded: the prepared loader's own iterator, made now)
        iterator = iter(lt._train_loader) if lt.num_training_batches > 0 else None
    state.start_run()
    every = lt.check_val_every_n_epoch
    if lt._load_val_later is not None and (every is None or (lt.current_epoch + 1) % every == 0):
        # without a sanity check Lightning requests the validation loaders now when the first
        # epoch validates (sharded over the processes there, as the run is prepared), else at
        # the first validation (see _load_deferred_val)
        _load_deferred_val(lt)
    lt.training = True
    # no .train() here: as in Lightning, each submodule keeps the mode the user left it in (a
    # frozen backbone or BatchNorm in eval mode stays so); evaluation restores the modes it found
    lt._last_val_time = time.monotonic()  # a time-based val_check_interval counts from here
    in_eval = [name for name, m in lt.lightning_module.named_modules() if not m.training]
    if in_eval:
        rank_zero_warn(
            f"Found {len(in_eval)} module(s) in eval mode at the start of training."
            " This may lead to unexpected behavior during training. If this is intentional,"
            " you can ignore this warning.",
            category=PossibleUserWarning,
        )
    hooks("on_train_start")
    k = lt.accumulate_grad_batches
    max_steps = lt.max_steps
    module = lt.lightning_module
    # decided once per fit: what a batch needs beyond the engine's step
    moves_batches = any(h is not None for h in lt._batch_hooks.values()) or lt._device.type != "cpu"
    batch_start_hooked = hooks.overridden("on_train_batch_start")
    batch_end_hooked = hooks.overridden("on_train_batch_end")
    # Lightning's progress counters, advanced where Lightning advances them (host integers)
    epochs = state.epoch_progress
    batches = epoch_loop.batch_progress
    current, total = batches.current, batches.total
    optimization = epoch_loop.automatic_optimization
    optimizer_counts = optimization.optim_progress.optimizer
    # the step and zero-grad counters advanced in place, as Lightning's increment_ready,
    # increment_completed and increment_by(1) advance them (a dozen calls a batch otherwise)
    step_total, step_current = optimizer_counts.step.total, optimizer_counts.step.current
    zero_grad_total, zero_grad_current = optimizer_counts.zero_grad.total, optimizer_counts.zero_grad.current
    count_zero_grad = not lt._own_zero_grad  # else counted around the zero-grad hooks (runner)
    connector, pbar_metrics = lt._logger_connector, lt._pbar_metrics
    train_step = runner.engine_steps()[0]
    automatic_step, manual_step = functools.partial(_automatic_step, lt, runner, train_step), lt._manual_step
    profiler = lt.profiler if profiling(lt) else None
    # fasttrain's default bar is the one listener of on_train_batch_end in most fits: it only
    # advances its counter (it reads no outputs and logs nothing), so the loop advances it
    # without the hook's dispatch or the outputs built for it (decided once per fit, as the
    # callbacks of a fit are; a profiler times the hook as Lightning does)
    bar = hooks.sole_callback("on_train_batch_end") if batch_end_hooked and profiler is None else None
    advance_bar = bar.advance if type(bar) is EpochProgressBar else None
    if advance_bar is not None:
        batch_end_hooked = False
    if profiler is not None:  # the optimization of each batch timed as Lightning times it
        automatic_step = timed(profiler, "run_training_batch", automatic_step)
        manual_step = timed(profiler, "run_training_batch", manual_step)
    while not _fit_done(lt):
        epoch = lt.current_epoch
        if _reload_due(lt, lt._train_reloaded_epoch):
            lt._reload_train_data()
            lt._last_val_time = time.monotonic()  # Lightning counts a time-based interval anew here
            if lt.num_training_batches > 0:
                # Lightning creates an iterator of the reloaded loader here (prefetching one batch
                # when its length is unknown) and another after on_train_epoch_start; the first
                # is dropped, but what it drew from the random generators shapes the next shuffles
                dropped = iter(lt._train_loader)
                if lt.num_training_batches == float("inf"):
                    next(dropped, None)
                del dropped
        loader = lt._train_loader
        set_sampler_epoch(loader, epoch)
        num_batches = lt.num_training_batches
        # not reset here: values logged in on_train_start count in the first epoch, as in
        # Lightning (the store is reset when a run starts and after each epoch's metrics)
        results = lt._train_results
        # a fit resumed inside an epoch continues it without a new start (Lightning's rule), from
        # the batch it stopped at, on a fresh iterator: the epoch takes the loader's first
        # remaining-count batches, as Lightning's does
        first = state.begin_epoch(lambda: hooks("on_train_epoch_start"), num_batches, k)
        # after the epoch's start hooks, which may add one (StochasticWeightAveraging's SWALR)
        schedulers = bool(lt.lr_scheduler_configs)
        engine.start_train_epoch()  # after the hooks, which may unfreeze layers
        if epoch_loop.restarting and not state._resumed_after_validation and _should_validate(
            lt, first - 1, batches.is_last_batch
        ):
            # the checkpoint was saved before the validation due at its batch: Lightning counts
            # that validation as run (requesting the validation data for its batch counts)
            if lt._load_val_later is not None:
                _load_deferred_val(lt)
            epoch_loop.val_loop.pass_over(lt.num_val_batches)
        check_trainable_mode(loader)  # Lightning's error for a sequential CombinedLoader, raised here
        if iterator is None:
            iterator = iter(loader)  # later epochs: after on_train_epoch_start, as in Lightning
        # no batch is requested past the epoch's last: a sampler run to its end draws from the
        # loader's generator once more, which Lightning's fetcher never does for a loader with a
        # length, so the next epochs' shuffles would differ. An epoch of unknown length takes a
        # one-batch look-ahead to tell the last batch, as Lightning's prefetching fetcher does.
        ended = [False] if num_batches == float("inf") else None
        if ended is not None:
            iterator = _look_ahead(iterator, ended)
        if profiler is not None:
            iterator = timed_iterator(profiler, "[_TrainingEpochLoop].train_dataloader_next", iterator)
            profiler.start("run_training_epoch")
        for batch_idx, batch in _numbered(iterator, first, num_batches):
            last = batch_idx + 1 == num_batches or (ended is not None and ended[0])
            batches.is_last_batch = last
            if moves_batches:
                batch = transfer(lt, batch)
            runner.batch_idx = batch_idx
            current.ready += 1
            total.ready += 1
            results.start_batch(batch)
            if batch_start_hooked and batch is not None and hooks("on_train_batch_start", batch, batch_idx) == -1:
                # the rest of the epoch is skipped; Lightning still steps the schedulers as at
                # an epoch's last batch
                batches.is_last_batch = True
                current.processed += 1
                total.processed += 1
                lt._step_schedulers("step", batch_idx)
                lt._step_schedulers("epoch", batch_idx)
                break
            if batch is not None:  # a None batch starts nothing (Lightning skips its hooks and step)
                current.started += 1
                total.started += 1
            update = (batch_idx + 1) % k == 0 or last
            window_start = runner.window_start = batch_idx % k == 0
            if batch is None or module.automatic_optimization:
                if batch is None:  # no step, no update (see skipped_steps.py)
                    outputs = skip_none_batch(lt)
                else:
                    skip_backward = optimization._skip_backward
                    if skip_backward:
                        # StochasticWeightAveraging's BatchNorm epoch: the callback sets the
                        # accumulation past the epoch's end, so Lightning's only step is at its
                        # final batch, on the gradients the last backward left
                        update = last
                    if update:
                        step_total.ready += 1
                        step_current.ready += 1
                    if skip_backward:
                        batch_output = _step_without_backward(runner, batch, update)
                    else:
                        batch_output = automatic_step(batch, batch_idx, update)
                    if results.pending:
                        results.drain(module.device)
                    if window_start and count_zero_grad and not (update and lt._module_steps) and not skip_backward:
                        # a closure step counts its own
                        zero_grad_total.ready += 1
                        zero_grad_total.started += 1
                        zero_grad_total.completed += 1
                        zero_grad_current.ready += 1
                        zero_grad_current.started += 1
                        zero_grad_current.completed += 1
                    if update:
                        step_total.completed += 1
                        step_current.completed += 1
                        runner.progress.num_updates += 1
                    if batch_end_hooked:
                        outputs = _batch_end_outputs(batch_output, k)
                current.processed += 1
                total.processed += 1
                if schedulers:
                    if update:
                        lt._step_schedulers("step", batch_idx)
                    if last:
                        lt._step_schedulers("epoch", batch_idx)
            else:
                outputs = manual_step(batch, batch_idx)
                update = True
                current.processed += 1
                total.processed += 1
            # decided before on_train_batch_end, so that a progress bar reads this batch's
            # values at a flush there, as Lightning's bar reads them after every batch
            flush = update and connector.flush_due()
            if flush:
                pbar_metrics.refresh()
            if batch_end_hooked:
                hooks("on_train_batch_end", outputs, batch, batch_idx)
            elif advance_bar is not None:
                advance_bar()
            current.completed += 1
            total.completed += 1
            if flush or (update and lt.should_stop and connector.flush_due()):
                lt._log_step_metrics()
            if _should_validate(lt, batch_idx, last):
                if lt._load_val_later is not None:
                    _load_deferred_val(lt)
                elif _reload_due(lt, lt._val_reloaded_epoch):
                    lt._reload_val_data()
                if update:
                    hooks.module_hook("on_validation_model_zero_grad")
                lt._logger_connector.absorb(results, on_step=True)
                run_evaluation(lt, runner, "validate")
                lt.training = True
            if update:
                if schedulers:
                    lt._step_schedulers("step", batch_idx, plateau=True)
                epoch_loop._batches_that_stepped += 1
            if epoch_loop._restarting:  # as in Lightning, the first batch after a resume ends its restart
                epoch_loop.restarting = False
            # global_step, read from the counter it is under automatic optimization
            if (max_steps != -1 and (step_total.completed if module.automatic_optimization else lt.global_step)
                    >= max_steps) or (lt.should_stop and can_stop_early(lt)):
                break
        iterator = None
        if profiler is not None:
            profiler.stop("run_training_epoch")
        epochs.increment_processed()
        lt._epoch_end_metrics_ready()
        filed = results.filed
        hooks.callbacks_only("on_train_epoch_end", monitoring=False)
        hooks.module_hook("on_train_epoch_end")
        hooks.callbacks_only("on_train_epoch_end", monitoring=True)
        lt._collect_epoch_metrics(results, logged_in_hooks=results.filed != filed)
        # not when max_steps ended the epoch early, nor in the epoch a resume restarted (Lightning
        # does not keep the monitored values in checkpoints)
        if batches.is_last_batch and not state.restarting:
            lt._step_schedulers("epoch", 0, plateau=True)
        epoch_loop._batches_that_stepped -= 1  # loggers get epoch metrics at the epoch's last step
        lt._log_epoch_metrics(results)
        epoch_loop._batches_that_stepped += 1
        results.reset()
        epochs.increment_completed()
        lt._restarting = False  # the first epoch after a resume has run
    hooks("on_train_end")


def _automatic_step(lt, runner, train_step, batch, batch_idx: int, update: bool):
    """A batch under automatic optimization: the engine's step (``train_step``, from
    :meth:`ModuleRunner.engine_steps`), or on a stepping batch the module's ``optimizer_step``
    with its closure (``lt._module_steps``); a batch whose ``training_step`` returned None ends
    on the host (see skipped_steps.py). Returns the step's output, None for a skipped step."""
    try:
        if update and lt._module_steps:
            return runner.closure_step(batch)
        return train_step(batch, update)
    except StepReturnedNone:
        return skip_step(lt, runner, update, batch_idx)


def _step_without_backward(runner, batch, update: bool):
    """A batch while ``fit_loop._skip_backward`` is set, as Lightning runs it: its closure
    without zero-grad and backward (``training_step`` under grad mode), eagerly; on a stepping
    batch through the ``optimizer_step`` hook, whose update applies the gradients there are.
    Returns the step's output, None for a step that returned None."""
    if update:
        return runner.closure_step(batch, backward=False)
    with torch.enable_grad():
        try:
            return runner.calculate_train_batch_loss(batch)
        except StepReturnedNone:
            return None


def _numbered(iterator, first: int, end):
    """``(index, batch)`` from ``first`` up to ``end`` (``inf``: until the data ends), never
    requesting a batch past ``end``."""
    return enumerate(itertools.islice(iterator, None if end == float("inf") else end - first), first)


def _look_ahead(loader, ended: list):
    """``loader``'s batches, setting ``ended[0]`` before the last one is yielded."""
    iterator = iter(loader)
    try:
        upcoming = next(iterator)
    except StopIteration:
        return
    while True:
        batch = upcoming
        try:
            upcoming = next(iterator)
        except StopIteration:
            ended[0] = True
            yield batch
            return
        yield batch


def _batch_end_outputs(batch_output, k: int) -> dict:
    """``on_train_batch_end``'s ``outputs``, as Lightning builds them: the detached loss divided
    by the accumulation steps, and the other entries of a dict that ``training_step`` returned;
    an empty dict for a step that returned None."""
    if batch_output is None:
        return {}
    loss = batch_output["loss"].detach()
    outputs = {"loss": loss / k if k > 1 else loss}
    output = batch_output["output"]
    if isinstance(output, dict) or isinstance(output, Mapping):
        outputs.update({key: value for key, value in output.items() if key != "loss"})
    return outputs


def _fit_done(lt) -> bool:
    # with Lightning's line saying which limit ended the fit
    if lt.num_training_batches == 0:
        return True
    if lt.max_steps != -1 and lt.global_step >= lt.max_steps:
        rank_zero_info(f"`Trainer.fit` stopped: `max_steps={lt.max_steps!r}` reached.")
        return True
    if lt.max_epochs != -1 and lt.fit_loop.epoch_progress.current.processed >= lt.max_epochs:
        rank_zero_info(f"`Trainer.fit` stopped: `max_epochs={lt.max_epochs!r}` reached.")
        return True
    if lt.should_stop and can_stop_early(lt):
        rank_zero_debug("`Trainer.fit` stopped: `trainer.should_stop` was set.")
        return True
    return False


def can_stop_early(lt) -> bool:
    """Whether ``should_stop`` may end the fit: ``min_epochs`` and ``min_steps`` are met. While
    they are not, training goes on, with Lightning's message once."""
    met_epochs = lt.fit_loop.epoch_progress.current.processed >= lt.min_epochs if lt.min_epochs else True
    met_steps = lt.global_step >= lt.min_steps if lt.min_steps else True
    if met_epochs and met_steps:
        return True
    message = (
        f"Trainer was signaled to stop but the required `min_epochs={lt.min_epochs!r}` or"
        f" `min_steps={lt.min_steps!r}` has not been met. Training will continue..."
    )
    if message not in lt._said:
        lt._said.add(message)
        rank_zero_info(message)
    return False


def _reload_due(lt, last_epoch) -> bool:
    """``reload_dataloaders_every_n_epochs``: whether the loader loaded at ``last_epoch`` is due
    to be requested again."""
    every = lt.reload_dataloaders_every_n_epochs
    return bool(every) and lt.current_epoch - last_epoch >= every


def _load_deferred_val(lt) -> None:
    load, lt._load_val_later = lt._load_val_later, None
    load()
    # the validation loop counts its loaders when it requests them, as Lightning's does
    lt.fit_loop.epoch_loop.val_loop._max_batches = lt.num_val_batches


def _should_validate(lt, batch_idx: int, last: bool) -> bool:
    """Lightning's decision after each training batch (time-based, batch-based, or at the end
    of an epoch of unknown length)."""
    if not lt.enable_validation:
        return False
    every = lt.check_val_every_n_epoch
    if every is not None and (lt.current_epoch + 1) % every != 0:
        return False
    interval = lt.val_check_batch
    # no batch cadence: an epoch of unknown length validates at its end (a batch-count interval
    # over such data keeps its cadence, as in Lightning)
    infinite = interval == float("inf")
    if last and infinite:
        return True
    if lt.should_stop and can_stop_early(lt):
        return True
    seconds = lt._val_check_time_interval
    if seconds is not None:
        return time.monotonic() - lt._last_val_time >= seconds
    if infinite:
        limit = lt.limit_train_batches
        return isinstance(limit, int) and (batch_idx + 1) % limit == 0
    index = lt.fit_loop.epoch_loop.total_batch_idx if every is None else batch_idx
    return (index + 1) % interval == 0


# ---------------------------------------------------------------------------------- evaluation
def run_evaluation(lt, runner, stage: str, sanity: bool = False) -> list:
    """One validation or test run over every loader of ``stage``, hooks included under the
    run's grad mode (see grad_modes.py); returns Lightning's list of logged epoch metrics (one
    dict per loader)."""
    with evaluation_context(lt):
        return _run_evaluation(lt, runner, stage, sanity)


def _run_evaluation(lt, runner, stage: str, sanity: bool) -> list:
    hooks = lt._hooks
    module = lt.lightning_module
    testing = stage == "test"
    prefix = "test" if testing else "validation"
    stage_before = lt.state.stage
    if not sanity:  # the sanity check keeps its own stage
        lt.state.stage = RunningStage.TESTING if testing else RunningStage.VALIDATING
    results = lt._test_results if testing else lt._val_results
    lt._active_eval_results = results
    results.reset()
    lt._eval_step_name = "test_step" if testing else "validation_step"
    fitting = lt.state.fn == "fit"
    loop = lt.fit_loop.epoch_loop.val_loop if fitting else lt.test_loop if testing else lt.validate_loop
    running = RunningStage.TESTING if testing else RunningStage.VALIDATING

    def loaders_and_counts():
        loaders = lt._test_loaders if testing else lt._val_loaders
        limit = lt.limit_test_batches if testing else lt.limit_val_batches
        # counted per loader, those combined in a CombinedLoader one by one (as Lightning lists them)
        loop._max_batches = [num_batches(running, loader, limit) for loader in flat(loaders)]
        return loaders, limited_counts(loaders, loop.max_batches)  # the sanity check's, while it runs

    loaders, counts = loaders_and_counts()
    # Lightning's "a validation ran" flag (set by a batch outside the sanity check:
    # ModelCheckpoint only warns about a missing monitored value until then) and batch counters
    loop.start_run()
    progress = loop.batch_progress
    mode = [m.training for m in module.modules()]
    if fitting:
        # Lightning sets the evaluation samplers' epoch in a fit (some shuffle by training progress)
        for loader in loaders:
            set_sampler_epoch(loader, lt.fit_loop.epoch_progress.current.processed)
    # as in Lightning, the first loader's iterator exists before the hooks, the others' are
    # created when their turn comes, and no batch is requested past a loader's count
    first_iterator = iter(loaders[0]) if loaders else None
    verify_dataloader_idx(module, prefix, lt.state.stage, len(loaders) > 1)
    hooks.module_hook(f"on_{prefix}_model_eval")
    runs_before = loop._runs_again
    hooks(f"on_{prefix}_start")
    hooks(f"on_{prefix}_epoch_start")
    if loop._runs_again != runs_before:
        # Lightning's batch size finder ran this loop again from a start hook and loaded the
        # loaders anew (at the size it found): the run goes on over those, from a fresh start
        loaders, counts = loaders_and_counts()
        results.reset()
        lt._active_eval_results = results  # (the run inside ended its own)
        lt._eval_step_name = "test_step" if testing else "validation_step"
        loop.start_run()
        first_iterator = iter(loaders[0]) if loaders else None
    loop._running = True  # from here on the loop cannot run again inside itself
    eval_step = runner.engine_steps()[1]
    several = len(loaders) > 1
    logged = []
    with torch.no_grad():
        for loader_idx, (loader, count, ends) in enumerate(zip(loaders, counts, _last_batch_flags(counts))):
            lt._eval_dataloader_idx = loader_idx if several else None
            extra = (loader_idx,) if several else ()
            iterator = first_iterator if loader_idx == 0 else iter(loader)
            ended = [False] if ends is None else None
            if ended is not None:
                iterator = _look_ahead(iterator, ended)
            if profiling(lt):
                iterator = timed_iterator(lt.profiler, f"[_EvaluationLoop].{running.dataloader_prefix}_next", iterator)
            for batch_idx, batch in _numbered(iterator, 0, count):
                progress.is_last_batch = ends == batch_idx + 1 if ended is None else ended[0]
                batch = transfer(lt, batch, loader_idx)
                runner.batch_idx = batch_idx
                progress.increment_ready()
                results.start_batch(batch, loader_idx if several else None)
                hooks(f"on_{prefix}_batch_start", batch, batch_idx, *extra)
                progress.increment_started()
                output = eval_step(batch)
                if results.pending:
                    results.drain(lt.lightning_module.device)
                progress.increment_processed()
                hooks(f"on_{prefix}_batch_end", output, batch, batch_idx, *extra)
                progress.increment_completed()
                # values logged with on_step=True in an evaluation step reach logged_metrics and
                # progress_bar_metrics per batch (also in the sanity check, until its end resets
                # them) and, outside the sanity check, the loggers, at a step counting this
                # loader's batches, those of this loader only (several loaders), as in Lightning
                step_metrics = results.metrics(True, loader_idx) if several else results.metrics(True)
                step_logged = step_metrics["log"]
                if step_logged:
                    lt._logger_connector._logged_metrics.update(step_logged)
                if step_metrics["pbar"]:
                    lt._logger_connector._progress_bar_metrics.update(step_metrics["pbar"])
                if not sanity:
                    loop._has_run = True
                    key = (stage, loader_idx)
                    if step_logged:
                        lt._logger_connector.log_metrics(step_logged, step=lt._eval_seen[key])
                    lt._eval_seen[key] += 1
    lt._eval_dataloader_idx = None
    results.dataloader_idx = None
    # from here the epoch values reach callback_metrics when read, also in the sanity check's
    # epoch-end hooks (Lightning's metrics read the finished epoch there; reset after the check)
    lt._logger_connector.eval_epoch_ended = True
    hooks(f"on_{prefix}_epoch_end")
    if not sanity:
        logged = lt._finish_evaluation(results, len(loaders))
    else:
        # SYNC(epoch-end): the sanity check's values reach the bar at its end, as Lightning's bar
        # shows them (once per fit; the check's end clears them)
        lt._pbar_metrics.refresh()
    loop._running = False
    hooks(f"on_{prefix}_end")
    lt._logger_connector.eval_epoch_ended = False
    results.reset()
    lt._active_eval_results = None
    if module_hook_overridden(module, f"on_{prefix}_model_train"):
        hooks.module_hook(f"on_{prefix}_model_train")
    else:
        for m, training in zip(module.modules(), mode):
            m.training = training
    if loop.verbose and not sanity and lt.is_global_zero:
        # Lightning's results table for validate() and test() (verbose=True); a fit's
        # validation loop is not verbose, as in Lightning
        _LightningEvaluationLoop._print_results(logged, loop._stage.value)
    lt.state.stage = stage_before
    lt._last_val_time = time.monotonic()  # a time-based val_check_interval counts from here
    return logged


def _last_batch_flags(counts: list) -> list:
    """Per loader, when its batches include the run's last one (Lightning's ``is_last_batch``
    counts over all loaders): that batch's number, or None when the loader has no length (a
    look-ahead tells its last batch); 0 for the other loaders."""
    final = max((i for i, count in enumerate(counts) if count), default=-1)
    return [(None if count == float("inf") else count) if i == final else 0 for i, count in enumerate(counts)]


def verify_dataloader_idx(module, prefix: str, stage: RunningStage, several: bool) -> None:
    """Lightning's check, before an evaluation or prediction loop starts, that the step and batch
    hooks take a ``dataloader_idx`` exactly when several loaders run (its RuntimeError naming the
    hook, rather than a TypeError from the call)."""
    step = "validation_step" if prefix == "validation" else f"{prefix}_step"
    _verify_dataloader_idx_requirement((step,), several, stage, module)
    _verify_dataloader_idx_requirement((f"on_{prefix}_batch_start", f"on_{prefix}_batch_end"), several, stage, module)


def module_hook_overridden(module, name: str) -> bool:
    """Lightning's test (``is_overridden``): a hook set on the instance that wraps the base
    class's method (``functools.wraps``, ``Mock(wraps=...)``, ``partial``) is not an override."""
    return is_overridden(name, module)


def run_predict(lt, runner, loaders):
    """One prediction run over ``loaders``, hooks included under the run's grad mode (see
    grad_modes.py); returns the predictions (one list per loader when there are several) when
    ``predict_loop.return_predictions``, else None."""
    with evaluation_context(lt):
        return _run_predict(lt, runner, loaders)


def _run_predict(lt, runner, loaders):
    hooks = lt._hooks
    module = lt.lightning_module
    loop = lt.predict_loop
    loop.max_batches = counts = [num_batches(RunningStage.PREDICTING, dl, lt.limit_predict_batches) for dl in loaders]
    loop.start_run(loaders, lt.callbacks)
    progress = loop.batch_progress
    keep = loop.keeps_predictions()
    mode = [m.training for m in module.modules()]
    lt.predicting = True
    verify_dataloader_idx(module, "predict", RunningStage.PREDICTING, len(loaders) > 1)
    hooks.module_hook("on_predict_model_eval")
    runs_before = loop._runs_again
    hooks("on_predict_start")
    hooks("on_predict_epoch_start")
    if loop._runs_again != runs_before:
        # Lightning's batch size finder ran the prediction again from a start hook and loaded
        # the loaders anew (see _run_evaluation)
        loaders = lt._predict_loaders
        loop.max_batches = counts = [num_batches(RunningStage.PREDICTING, dl, lt.limit_predict_batches) for dl in loaders]
        loop.start_run(loaders, lt.callbacks)
        keep = loop.keeps_predictions()
    loop._running = True  # from here on the loop cannot run again inside itself
    several = len(loaders) > 1
    predict = runner.model_call("predict_step")
    profiler = lt.profiler if profiling(lt) else None
    if profiler is not None:
        predict = timed(profiler, strategy_action(lt, "predict_step"), predict)
    with torch.no_grad():
        for loader_idx, (loader, count, ends) in enumerate(zip(loaders, counts, _last_batch_flags(counts))):
            extra = (loader_idx,) if several else ()
            iterator = iter(loader)
            ended = [False] if ends is None else None
            if ended is not None:
                iterator = _look_ahead(iterator, ended)
            if profiler is not None:
                iterator = timed_iterator(profiler, "[_PredictionLoop].predict_next", iterator)
            for batch_idx, batch in _numbered(iterator, 0, count):  # no batch requested past the count
                progress.is_last_batch = ends == batch_idx + 1 if ended is None else ended[0]
                batch = transfer(lt, batch, loader_idx)
                progress.increment_ready()
                loop.note_batch_indices(batch_idx, loader_idx)
                hooks("on_predict_batch_start", batch, batch_idx, *extra)
                progress.increment_started()
                module._current_fx_name = "predict_step"
                output = predict(*runner.step_args("predict_step", batch, batch_idx, *extra))
                if output is None and "predict None" not in lt._said:
                    lt._said.add("predict None")  # once per trainer, as Lightning warns it
                    rank_zero_warn("predict returned None if it was on purpose, ignore this warning...")
                module._current_fx_name = None
                progress.increment_processed()
                hooks("on_predict_batch_end", output, batch, batch_idx, *extra)
                progress.increment_completed()
                if keep:
                    # on the host, as Lightning returns them: the caller asked for the values
                    loop._predictions[loader_idx].append(move_data_to_device(output, torch.device("cpu")))
    hooks("on_predict_epoch_end")
    returned = loop.predictions if loop.return_predictions else None
    loop.finish_run()
    loop._running = False
    hooks("on_predict_end")
    for m, training in zip(module.modules(), mode):
        m.training = training
    return returned
