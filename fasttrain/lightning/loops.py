"""Lightning's fit, evaluation and prediction loops, each batch run by a fasttrain step engine.

Read :func:`run_fit` top to bottom for Lightning's order: batch hooks -> the engine's step
(training_step, backward, clip, optimizer step) -> schedulers -> ``on_train_batch_end`` ->
loggers (every ``log_every_n_steps`` stepping batches: the one host copy of the logged values)
-> validation when due; then the epoch-end hooks, the epoch metrics, the next epoch.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.seed import isolate_rng

from lightning.pytorch.trainer.states import RunningStage

from fasttrain.lightning.arguments import check_interval_fits_epoch, num_batches


class _Progress:
    """The counters of Lightning's loops that callbacks and checkpoints read."""

    def __init__(self):
        self.is_last_batch = False
        self.current = SimpleNamespace(ready=0, completed=0, processed=0, started=0)
        self.total = SimpleNamespace(ready=0, completed=0, processed=0, started=0)


class FitLoopState:
    """``trainer.fit_loop`` as Lightning's callbacks read it."""

    def __init__(self):
        self.epoch_progress = _Progress()
        self.epoch_loop = SimpleNamespace(
            _batches_that_stepped=0,
            batch_progress=_Progress(),
            val_loop=SimpleNamespace(_has_run=False),
            batch_idx=0,
            total_batch_idx=0,
        )
        #: the batch to resume at in the first epoch (a mid-epoch checkpoint)
        self.resume_batch = 0


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
    """An evaluation loader sharded over the processes, without padding samples (the epoch
    means are over real samples only)."""
    prepared = runner._accelerator.prepare(loader)
    prepared.batch_sampler.even_batches = False
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
    if lt._num_sanity_batches() > 0 and not lt._restarting:
        lt.sanity_checking = True
        hooks.callbacks_only("on_sanity_check_start")
        # as in Lightning, the sanity check leaves the random state as it found it, so the
        # training data order does not depend on whether it ran
        with isolate_rng():
            run_evaluation(lt, runner, "validate", sanity=True)
        hooks.callbacks_only("on_sanity_check_end")
        lt.sanity_checking = False
    check_interval_fits_epoch(lt.val_check_interval, lt)  # after the sanity check, as in Lightning
    # Lightning creates the first epoch's data iterator here, after the sanity check and before
    # on_train_start (a DataLoader draws its base seed when the iterator is created)
    iterator = iter(lt._train_loader) if lt.num_training_batches > 0 else None
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
    schedulers = bool(lt.lr_scheduler_configs)
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
        _set_sampler_epoch(loader, epoch)
        num_batches = lt.num_training_batches
        # not reset here: values logged in on_train_start count in the first epoch, as in
        # Lightning (the store is reset when a run starts and after each epoch's metrics)
        results = lt._train_results
        epoch_loop.batch_progress.current.ready = 0
        epoch_loop.batch_progress.is_last_batch = False
        state.epoch_progress.current.ready += 1
        progress = lt._progress
        progress.start_epoch(epoch, num_batches)
        hooks("on_train_epoch_start")
        if iterator is None:
            iterator = iter(loader)  # later epochs: after on_train_epoch_start, as in Lightning
        # a mid-epoch resume counts on from the batch it stopped at, on a fresh iterator: the
        # epoch takes the loader's first remaining-count batches, as Lightning's does
        first = state.resume_batch
        state.resume_batch = 0
        # no batch is requested past the epoch's last: a sampler run to its end draws from the
        # loader's generator once more, which Lightning's fetcher never does for a loader with a
        # length, so the next epochs' shuffles would differ. An epoch of unknown length takes a
        # one-batch look-ahead to tell the last batch, as Lightning's prefetching fetcher does.
        ended = [False] if num_batches == float("inf") else None
        if ended is not None:
            iterator = _look_ahead(iterator, ended)
        for batch_idx, batch in _numbered(iterator, first, num_batches):
            last = batch_idx + 1 == num_batches or (ended is not None and ended[0])
            if moves_batches:
                batch = transfer(lt, batch)
            epoch_loop.batch_idx = runner.batch_idx = batch_idx
            epoch_loop.batch_progress.current.ready = batch_idx + 1
            epoch_loop.batch_progress.total.ready += 1
            epoch_loop.total_batch_idx = epoch_loop.batch_progress.total.ready - 1
            epoch_loop.batch_progress.is_last_batch = last
            results.start_batch(batch)
            if batch_start_hooked and hooks("on_train_batch_start", batch, batch_idx) == -1:
                # the rest of the epoch is skipped; Lightning still steps the schedulers as at
                # an epoch's last batch
                epoch_loop.batch_progress.is_last_batch = True
                lt._step_schedulers("step", batch_idx)
                lt._step_schedulers("epoch", batch_idx)
                break
            update = (batch_idx + 1) % k == 0 or last
            runner.window_start = batch_idx % k == 0
            if module.automatic_optimization:
                if update and lt._module_steps:
                    batch_output = runner.closure_step(batch)
                else:
                    batch_output = engine.train_step(batch, update)
                    if results.pending:
                        results.drain()
                if update:
                    lt._global_step += 1
                    runner.progress.num_updates += 1
                if batch_end_hooked:
                    outputs = _batch_end_outputs(batch_output, k)
                if schedulers:
                    if update:
                        lt._step_schedulers("step", batch_idx)
                    if last:
                        lt._step_schedulers("epoch", batch_idx)
            else:
                outputs = lt._manual_step(batch, batch_idx)
                update = True
            if batch_end_hooked:
                hooks("on_train_batch_end", outputs, batch, batch_idx)
            if update and lt._logger_connector.flush_due():
                lt._log_step_metrics()
                progress.update(batch_idx + 1, results.metrics(on_step=True)["pbar"])
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
            if (max_steps != -1 and lt.global_step >= max_steps) or (lt.should_stop and can_stop_early(lt)):
                break
        iterator = None
        state.epoch_progress.current.processed += 1
        progress.update(epoch_loop.batch_progress.current.ready, results.metrics(on_step=True)["pbar"])
        lt._epoch_end_metrics_ready()
        hooks.callbacks_only("on_train_epoch_end", monitoring=False)
        hooks.module_hook("on_train_epoch_end")
        hooks.callbacks_only("on_train_epoch_end", monitoring=True)
        lt._collect_epoch_metrics(results)
        if epoch_loop.batch_progress.is_last_batch:  # not when max_steps ended the epoch early
            lt._step_schedulers("epoch", 0, plateau=True)
        epoch_loop._batches_that_stepped -= 1  # loggers get epoch metrics at the epoch's last step
        lt._log_epoch_metrics(results)
        epoch_loop._batches_that_stepped += 1
        results.reset()
        state.epoch_progress.current.completed += 1
        progress.close()
    hooks("on_train_end")


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


def _batch_end_outputs(batch_output: dict, k: int) -> dict:
    """``on_train_batch_end``'s ``outputs``, as Lightning builds them: the detached loss divided
    by the accumulation steps, and the other entries of a dict that ``training_step`` returned."""
    loss = batch_output["loss"].detach()
    outputs = {"loss": loss / k if k > 1 else loss}
    output = batch_output["output"]
    if isinstance(output, dict):
        outputs.update({key: value for key, value in output.items() if key != "loss"})
    return outputs


def _fit_done(lt) -> bool:
    if lt.num_training_batches == 0:
        return True
    if lt.max_steps != -1 and lt.global_step >= lt.max_steps:
        return True
    if lt.max_epochs != -1 and lt.fit_loop.epoch_progress.current.processed >= lt.max_epochs:
        return True
    return bool(lt.should_stop) and can_stop_early(lt)


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


def _should_validate(lt, batch_idx: int, last: bool) -> bool:
    """Lightning's decision after each training batch (time-based, batch-based, or at the end
    of an epoch of unknown length)."""
    if not lt.enable_validation:
        return False
    every = lt.check_val_every_n_epoch
    if every is not None and (lt.current_epoch + 1) % every != 0:
        return False
    infinite = lt.num_training_batches == float("inf")
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
    interval = lt.val_check_batch
    index = lt.fit_loop.epoch_loop.total_batch_idx if every is None else batch_idx
    return (index + 1) % interval == 0


# ---------------------------------------------------------------------------------- evaluation
def run_evaluation(lt, runner, stage: str, sanity: bool = False) -> list:
    """One validation or test run over every loader of ``stage``; returns Lightning's list of
    logged epoch metrics (one dict per loader)."""
    hooks = lt._hooks
    module = lt.lightning_module
    testing = stage == "test"
    prefix = "test" if testing else "validation"
    loaders = lt._test_loaders if testing else lt._val_loaders
    limit = lt.limit_test_batches if testing else lt.limit_val_batches
    stage_before = lt.state.stage
    if not sanity:  # the sanity check keeps its own stage
        lt.state.stage = RunningStage.TESTING if testing else RunningStage.VALIDATING
    results = lt._test_results if testing else lt._val_results
    lt._active_eval_results = results
    results.reset()
    lt._eval_step_name = "test_step" if testing else "validation_step"
    fitting = lt.state.fn == "fit"
    val_loop = lt.fit_loop.epoch_loop.val_loop
    if fitting:
        # Lightning's flag for "a validation ran": reset each run, set by a batch outside the
        # sanity check (ModelCheckpoint only warns about a missing monitored value until then)
        val_loop._has_run = False
    mode = [m.training for m in module.modules()]
    if fitting:
        # Lightning sets the evaluation samplers' epoch in a fit (some shuffle by training progress)
        for loader in loaders:
            _set_sampler_epoch(loader, lt.fit_loop.epoch_progress.current.processed)
    # as in Lightning, the first loader's iterator exists before the hooks, the others' are
    # created when their turn comes, and no batch is requested past a loader's count
    first_iterator = iter(loaders[0]) if loaders else None
    hooks.module_hook(f"on_{prefix}_model_eval")
    hooks(f"on_{prefix}_start")
    hooks(f"on_{prefix}_epoch_start")
    engine = runner._engine
    several = len(loaders) > 1
    logged = []
    with torch.no_grad():
        for loader_idx, loader in enumerate(loaders):
            count = num_batches(RunningStage.TESTING if testing else RunningStage.VALIDATING, loader, limit)
            if sanity:
                count = lt._num_sanity_batches(loader)
            lt._eval_dataloader_idx = loader_idx if several else None
            extra = (loader_idx,) if several else ()
            iterator = first_iterator if loader_idx == 0 else iter(loader)
            for batch_idx, batch in _numbered(iterator, 0, count):
                batch = transfer(lt, batch, loader_idx)
                runner.batch_idx = batch_idx
                results.start_batch(batch, loader_idx if several else None)
                hooks(f"on_{prefix}_batch_start", batch, batch_idx, *extra)
                output = engine.eval_step(batch)
                if results.pending:
                    results.drain()
                hooks(f"on_{prefix}_batch_end", output, batch, batch_idx, *extra)
                if not sanity:
                    if fitting:
                        val_loop._has_run = True
                    # values logged with on_step=True in an evaluation step reach logged_metrics
                    # and the loggers per batch, at a step counting this loader's batches, as in
                    # Lightning
                    step_logged = results.metrics(on_step=True)["log"]
                    key = (stage, loader_idx)
                    if step_logged:
                        lt._logger_connector._logged_metrics.update(step_logged)
                        lt._logger_connector.log_metrics(step_logged, step=lt._eval_seen[key])
                    lt._eval_seen[key] += 1
    lt._eval_dataloader_idx = None
    results.dataloader_idx = None
    lt._logger_connector.eval_epoch_ended = not sanity
    hooks(f"on_{prefix}_epoch_end")
    if not sanity:
        logged = lt._finish_evaluation(results, len(loaders))
    hooks(f"on_{prefix}_end")
    lt._logger_connector.eval_epoch_ended = False
    results.reset()
    lt._active_eval_results = None
    if module_hook_overridden(module, f"on_{prefix}_model_train"):
        hooks.module_hook(f"on_{prefix}_model_train")
    else:
        for m, training in zip(module.modules(), mode):
            m.training = training
    lt.state.stage = stage_before if stage_before is RunningStage.TRAINING or sanity else None
    lt._last_val_time = time.monotonic()  # a time-based val_check_interval counts from here
    return logged


def module_hook_overridden(module, name: str) -> bool:
    from fasttrain.lightning.hooks import module_overrides

    return module_overrides(module, name)


def run_predict(lt, runner, loaders) -> list:
    hooks = lt._hooks
    module = lt.lightning_module
    mode = [m.training for m in module.modules()]
    lt.predicting = True
    hooks.module_hook("on_predict_model_eval")
    hooks("on_predict_start")
    hooks("on_predict_epoch_start")
    several = len(loaders) > 1
    all_predictions = []
    with torch.no_grad():
        for loader_idx, loader in enumerate(loaders):
            count = num_batches(RunningStage.PREDICTING, loader, lt.limit_predict_batches)
            extra = (loader_idx,) if several else ()
            predictions = []
            for batch_idx, batch in _numbered(iter(loader), 0, count):  # no batch requested past the count
                batch = transfer(lt, batch, loader_idx)
                hooks("on_predict_batch_start", batch, batch_idx, *extra)
                module._current_fx_name = "predict_step"
                output = runner.model("predict_step", *runner.step_args("predict_step", batch, batch_idx, *extra))
                if output is None and "predict None" not in lt._said:
                    lt._said.add("predict None")  # once per trainer, as Lightning warns it
                    rank_zero_warn("predict returned None if it was on purpose, ignore this warning...")
                module._current_fx_name = None
                hooks("on_predict_batch_end", output, batch, batch_idx, *extra)
                predictions.append(output)
            all_predictions.append(predictions)
    hooks("on_predict_epoch_end")
    hooks("on_predict_end")
    for m, training in zip(module.modules(), mode):
        m.training = training
    lt.predicting = False
    return all_predictions if several else all_predictions[0]
