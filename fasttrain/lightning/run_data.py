"""The dataloaders of a run: requested from their source (the loaders given, the DataModule's
or the module's ``*_dataloader()``), checked and processed as Lightning processes each loader it
is given, counted, and sharded over the processes; for a fit, in Lightning's order around the
sanity check (:func:`load_data`) and again where ``reload_dataloaders_every_n_epochs`` reloads
them. Several loaders are combined as Lightning combines them (see combined.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from lightning.fabric.utilities.data import _set_sampler_epoch, has_iterable_dataset, sized_len
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.connectors.data_connector import (
    _check_dataloader_iterable,
    _DataLoaderSource,
    _resolve_overfit_batches,
    _worker_check,
)
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.data import _is_dataloader_shuffled
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from fasttrain.lightning.arguments import num_batches
from fasttrain.lightning.combined import CombinedData, evaluation_loaders, flat, training_data
from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.hooks import module_overrides
from fasttrain.lightning.loops import prepare_eval_loader, prepare_train_loader
from fasttrain.lightning.profiler import datamodule_hook


class InvalidDataloaderError(TypeError, ValueError):
    """Lightning's ``TypeError`` for data a run cannot iterate (also a ``ValueError``)."""


def _source(lt, given, hook: str):
    """Where a run's loaders of ``hook`` come from: ``given`` to the run, else the DataModule
    or the module that overrides ``hook`` (the DataModule first), else None."""
    if given is not None:
        return given
    dm = lt.datamodule
    if dm is not None and datamodule_overrides(dm, hook):
        return dm
    if module_overrides(lt.lightning_module, hook):
        return lt.lightning_module
    return None


def _loaders_from(lt, source, given, hook: str):
    # what the run was given, or what the source's hook returns (the module's through the hooks)
    if source is None or source is given:
        return source
    if source is lt.lightning_module:
        return lt._hooks.module_hook(hook)
    if source is lt.datamodule:
        return datamodule_hook(lt, hook)
    return getattr(source, hook)()


def request(lt, given, hook: str):
    """The loaders of ``hook``: those given to the run, else the DataModule's or the module's
    ``hook()`` (whichever overrides it, the DataModule first), else None."""
    return _loaders_from(lt, _source(lt, given, hook), given, hook)


def request_checked(lt, given, hook: str):
    """:func:`request`'s loaders, checked as Lightning checks what a run requested: ``None``
    (nothing given, no hook), or anything in it that cannot be iterated, is Lightning's TypeError
    with its words (naming what was passed to the run, or the hook that returned it)."""
    instance = _source(lt, given, hook)
    loaders = _loaders_from(lt, instance, given, hook)
    if instance is None:
        instance = lt.lightning_module
        if callable(getattr(instance, hook, None)):
            # LightningModule's own hook, which raises this when Lightning calls it
            raise LightningConfigError(f"`{hook}` must be implemented to be used with the Lightning Trainer")
    source = _DataLoaderSource(instance, hook)
    if loaders is None:
        flattened = [None]
    else:
        # a CombinedLoader's own loaders (iterating it would start them: a shuffle's draw)
        flattened = (loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)).flattened
    for loader in flattened:
        try:
            _check_dataloader_iterable(loader, source, lt.state.fn)
        except TypeError as error:
            raise InvalidDataloaderError(str(error)) from None
    return loaders


def has_source(lt, given, hook: str) -> bool:  # whether request() would find loaders (requesting none)
    return _source(lt, given, hook) is not None


def datamodule_overrides(dm, hook: str) -> bool:
    return getattr(type(dm), hook, None) is not getattr(LightningDataModule, hook, None)


def _overfit(lt, loader, stage: RunningStage):
    """With ``overfit_batches``, a shuffling loader is rebuilt to read in order (Lightning's
    warning and rebuild), so every epoch sees the same batches."""
    if lt.overfit_batches <= 0 or loader is None:
        return loader
    holder = SimpleNamespace(flattened=[loader])
    _resolve_overfit_batches(holder, stage)
    return holder.flattened[0]


def _processed(lt, loader, stage: RunningStage):
    """``loader`` (or each loader combined in it) through ``overfit_batches`` and
    :func:`process_loader`, as Lightning processes each loader it is given."""
    if isinstance(loader, CombinedData):
        holder = SimpleNamespace(flattened=loader.flattened)
        if lt.overfit_batches > 0:
            _resolve_overfit_batches(holder, stage)
        loader.combined.flattened = holder.flattened
        return process_each(lt, loader, stage)
    return process_loader(lt, _overfit(lt, loader, stage), stage)


def process_each(lt, loader, stage: RunningStage):
    """:func:`process_loader` on ``loader``, or on each loader combined in it."""
    if isinstance(loader, CombinedData):
        return loader.map(lambda dl: process_loader(lt, dl, stage))
    return process_loader(lt, loader, stage)


def process_loader(lt, loader, stage: RunningStage):
    """What Lightning checks and sets on every loader it is given: its warnings for a shuffling
    evaluation loader and for few (or non-persistent spawned) workers, and, outside a fit, the
    sampler's epoch (a fit sets it in its loops)."""
    name = f"{stage.dataloader_prefix}_dataloader"
    if stage is not RunningStage.TRAINING and _is_dataloader_shuffled(loader):
        rank_zero_warn(
            f"Your `{name}`'s sampler has shuffling enabled,"
            " it is strongly recommended that you turn shuffling off for val/test dataloaders.",
            category=PossibleUserWarning,
        )
    _worker_check(lt, loader, name)
    if has_iterable_dataset(loader) and sized_len(loader) is not None:
        rank_zero_warn(  # Lightning's words
            "Your `IterableDataset` has `__len__` defined."
            " In combination with multi-process data loading (when num_workers > 1),"
            " `__len__` could be inaccurate if each worker is not configured independently"
            " to avoid having duplicate data."
        )
    if lt.state.fn != TrainerFn.FITTING:
        _set_sampler_epoch(loader, lt.fit_loop.epoch_progress.current.processed)
    return loader


def load_train_data(lt, given, processes: int) -> None:
    """Request the fit's training dataloader (``given`` to fit, else the DataModule's or the
    module's ``train_dataloader()``) and count its batches; again at the epochs
    ``reload_dataloaders_every_n_epochs`` names."""
    lt._load_train_data = None
    train_loader = request_checked(lt, given, "train_dataloader")
    # several loaders (a collection, a CombinedLoader) and a loader whose len() raises are
    # combined, as Lightning combines every training source (combined.py)
    train_loader = _processed(lt, training_data(train_loader), RunningStage.TRAINING)
    # accelerate gives each process every world-th batch (padded to the same count), so the
    # per-process count is known before the loaders are prepared
    lt.num_training_batches = num_batches(RunningStage.TRAINING, train_loader, lt.limit_train_batches, processes)
    if isinstance(train_loader, CombinedData):
        train_loader.set_limits(lambda dl: num_batches(RunningStage.TRAINING, dl, lt.limit_train_batches, processes))
        train_loader.length = lt.num_training_batches
    if lt.loggers and lt.num_training_batches < lt.log_every_n_steps and not lt.fast_dev_run:
        rank_zero_warn(
            f"The number of training batches ({lt.num_training_batches}) is smaller than the logging interval"
            f" Trainer(log_every_n_steps={lt.log_every_n_steps}). Set a lower value for log_every_n_steps if"
            " you want to see logs for the training epoch.",
            category=PossibleUserWarning,
        )
    lt._train_reloaded_epoch = lt.current_epoch
    # a resumable loader continues where the checkpoint of a restarting fit left it (Lightning's
    # order: after the limits are set, before the first iterator is made)
    lt._loader_states.set_loaders(flat([train_loader]), processes)
    lt._loader_states.load(lt.fit_loop.restarting)
    runner = lt._runner
    if runner is not None and runner._train_dataloader is not None and runner.run_config.is_distributed:
        # a reload inside the fit: shard the new loader as the first one was
        train_loader = prepare_train_loader(runner, train_loader)
    lt._train_loader = train_loader


def load_val_data(lt, given) -> None:
    """Request the fit's validation dataloaders, only when validation can run
    (``validation_step`` defined, ``limit_val_batches`` not 0), as Lightning requests them;
    again at the validations ``reload_dataloaders_every_n_epochs`` names."""
    wanted = lt._has_val_step and lt.limit_val_batches != 0
    loaders = evaluation_loaders(request(lt, given, "val_dataloader")) if wanted else []
    loaders = [_processed(lt, dl, RunningStage.VALIDATING) for dl in loaders]
    for dl in loaders:
        num_batches(RunningStage.VALIDATING, dl, lt.limit_val_batches)  # Lightning's checks of the limit
    every = lt.check_val_every_n_epoch
    if not lt.sanity_checking or every is None or (lt.current_epoch + 1) % every == 0:
        # the sanity check's request counts as the epoch's only when this epoch validates
        # (check_val_every_n_epoch): else the first validation requests them again, as in Lightning
        lt._val_reloaded_epoch = lt.current_epoch
    runner = lt._runner
    if runner is not None and runner._train_dataloader is not None and runner.run_config.is_distributed:
        loaders = [prepare_eval_loader(runner, dl) for dl in loaders]
    lt._val_loaders = loaders


def load_data(lt, val_dataloaders) -> None:
    """The dataloaders in Lightning's order: when a sanity check will run, the validation loaders
    first, inside the random-state isolation the sanity check runs in (what ``val_dataloader()``
    draws does not change the training data), then the training loader (unless reading
    ``estimated_stepping_batches`` in ``configure_optimizers`` loaded it already); otherwise
    the training loader, and the validation loaders once the fit loop has created the first
    epoch's data iterator (``lt._load_val_later``, see :func:`~fasttrain.lightning.loops.run_fit`)."""
    sanity = (
        lt.num_sanity_val_steps != 0 and lt._has_val_step
        and lt.limit_val_batches != 0 and not lt._restarting
    )
    lt._load_val_later = None
    # loaded already when Lightning's tuner ended by loading them (batch size finder): kept, as
    # Lightning's validation loop keeps the loaders it holds
    val_loaded = lt.fit_loop.epoch_loop.val_loop._combined_loader is not None
    if sanity and not val_loaded:
        # Lightning requests them inside its sanity check: val_dataloader() reads sanity_checking
        lt.sanity_checking = True
        try:
            with isolate_rng():
                load_val_data(lt, val_dataloaders)
        finally:
            lt.training = True
    if lt._load_train_data is not None:
        lt._load_train_data()
    if not sanity and not val_loaded:
        defer_val_data(lt, val_dataloaders)


def defer_val_data(lt, given) -> None:
    """No validation loaders yet: when validation can run, they are requested at the fit's
    first validation, or once the first epoch's data iterator exists when that epoch validates
    (``lt._load_val_later``, see :func:`~fasttrain.lightning.loops.run_fit`)."""
    lt._val_loaders = []
    lt._load_val_later = None
    if has_source(lt, given, "val_dataloader") and lt._has_val_step and lt.limit_val_batches != 0:
        lt._load_val_later = functools.partial(load_val_data, lt, given)
