"""Checkpoints in Lightning's format, both ways.

fasttrain writes the keys ``lightning.Trainer`` writes (``epoch``, ``global_step``,
``pytorch-lightning_version``, ``state_dict``, ``loops``, ``callbacks``, ``optimizer_states``,
``lr_schedulers``, ``hyper_parameters``), so ``LightningModule.load_from_checkpoint`` and
``lightning.Trainer.fit(ckpt_path=...)`` read its files, and it reads Lightning's. The ``loops``
counters carry the position in the epoch, so a checkpoint saved mid-epoch (``ModelCheckpoint(
every_n_train_steps=...)``) resumes at the next batch rather than at the epoch start.
"""

from __future__ import annotations

import logging
import pickle
from typing import Optional

import lightning
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fasttrain.checkpoint_files import CheckpointError
from fasttrain.engine.hyperparams import plain_optimizer_state
from fasttrain.lightning import ckpt_files
from fasttrain.lightning.loop_objects import loops_state_dict

log = logging.getLogger(__name__)

_SCALER_KEY = "MixedPrecision"


def dump_checkpoint(lt, weights_only: bool = False) -> dict:
    module = lt.lightning_module
    checkpoint = {
        "epoch": lt.current_epoch,
        "global_step": lt.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": module.state_dict(),
        "loops": loops_state_dict(lt),
    }
    if not weights_only:
        callbacks = {}
        for callback in lt.callbacks:
            state = callback.state_dict()
            if state:
                callbacks[callback.state_key] = state
        checkpoint["callbacks"] = callbacks
        # the compiled engines hold learning rates and betas as device tensors and may switch Adam to
        # capturable: checkpoints keep Lightning's plain numbers and the user's own flags
        checkpoint["optimizer_states"] = [plain_optimizer_state(opt, opt.state_dict()) for opt in lt.optimizers]
        checkpoint["lr_schedulers"] = [config.scheduler.state_dict() for config in lt.lr_scheduler_configs]
        scaler = lt._scaler()
        if scaler is not None:
            checkpoint[_SCALER_KEY] = scaler.state_dict()
    if module.hparams:
        if hasattr(module, "_hparams_name"):
            checkpoint["hparams_name"] = module._hparams_name
        checkpoint["hyper_parameters"] = dict(module.hparams)
    dm = lt.datamodule
    if dm is not None:
        if dm.hparams:
            if hasattr(dm, "_hparams_name"):
                checkpoint["datamodule_hparams_name"] = dm._hparams_name
            checkpoint["datamodule_hyper_parameters"] = dict(dm.hparams)
        dm_state = dm.state_dict()
        if dm_state:
            checkpoint[type(dm).__qualname__] = dm_state
    if not weights_only:
        for callback in lt.callbacks:
            callback.on_save_checkpoint(lt, module, checkpoint)
    # a DataModule contributes its state_dict() only: Lightning 2.x calls no DataModule hook here
    lt._hooks.module_hook("on_save_checkpoint", checkpoint)
    return checkpoint


def save(lt, filepath, weights_only: Optional[bool], storage_options) -> None:
    """``trainer.save_checkpoint``: the checkpoint written by the ``CheckpointIO`` plugin when
    one is given, else atomically by :func:`write` (which, as Lightning's default writer, takes
    no ``storage_options``; a local file, or a URL of another file system), on the first
    process; every process waits for it."""
    if lt.model is None:
        raise AttributeError(
            "Saving a checkpoint is only possible if a model is attached to the Trainer. Did you call"
            " `Trainer.save_checkpoint()` before calling `Trainer.{fit,validate,test,predict}`?"
        )
    with lt.profiler.profile("save_checkpoint"):
        _save(lt, filepath, weights_only, storage_options)


def _save(lt, filepath, weights_only: Optional[bool], storage_options) -> None:
    io = lt._checkpoint_io
    if io is None and storage_options is not None:
        raise TypeError(  # Lightning's default TorchCheckpointIO's words
            "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
            " is not supported for `TorchCheckpointIO`. Please implement your custom `CheckpointIO`"
            " to define how you'd like to use `storage_options`."
        )
    if weights_only is None:
        log.info("`weights_only` was not set, defaulting to `False`.")
    checkpoint = dump_checkpoint(lt, bool(weights_only))
    if lt.is_global_zero:
        if io is None:
            ckpt_files.write(checkpoint, filepath)
        else:
            io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
    lt.strategy.barrier("Trainer.save_checkpoint")


def load(path: str, weights_only: Optional[bool] = None, io=None) -> dict:
    """``torch.load`` of a checkpoint as Lightning loads a local file: ``weights_only`` is passed
    on, and None leaves the choice to torch (safe loading: tensors and plain Python values only,
    unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), so a file carrying other pickled objects
    (whose unpickling can run code) is refused with an error saying how to load it when trusted.
    A ``CheckpointIO`` plugin (``io``) reads the file instead, as under Lightning. ``path`` may be
    a URL of another file system (ckpt_files.py)."""
    if io is not None:
        return io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)
    try:
        return ckpt_files.read(path, weights_only)
    except pickle.UnpicklingError as error:
        if weights_only is False:
            raise
        raise CheckpointError(
            f"Refusing to load {path}: it holds objects other than tensors and plain Python values, and "
            "unpickling them could run arbitrary code. If (and only if) you trust the file, pass "
            f"weights_only=False to fit/validate/test/predict. Details: {error}"
        ) from error


def restore_modules_and_callbacks(lt, path: str, weights_only: Optional[bool] = None) -> dict:
    """What every run (fit, validate, test, predict) restores from the checkpoint ``path``
    before its loop, as Lightning does: the module (:func:`_restore_module`), then the
    DataModule's and the callbacks' states (:func:`_restore_datamodule_and_callbacks`). Returns
    the checkpoint. ``weights_only`` as for :func:`load`."""
    checkpoint = _restore_module(lt, path, weights_only)
    _restore_datamodule_and_callbacks(lt, checkpoint)
    return checkpoint


def _restore_module(lt, path: str, weights_only: Optional[bool]) -> dict:
    """Load a Lightning-format checkpoint and restore the module from it: its
    ``on_load_checkpoint`` hook, then its weights (``strict=module.strict_loading``, as
    Lightning loads them). Returns the checkpoint."""
    rank_zero_info(f"Restoring states from the checkpoint path at {path}")
    checkpoint = load(path, weights_only, lt._checkpoint_io)
    for key in ("pytorch-lightning_version", "state_dict"):
        if key not in checkpoint:
            raise KeyError(f"{path} is not a Lightning checkpoint: it lacks {key!r}")
    lt._hooks.module_hook("on_load_checkpoint", checkpoint)
    module = lt.lightning_module
    # strict_loading = False (a checkpoint holding part of the module, as adapter fine-tuning saves)
    module.load_state_dict(checkpoint["state_dict"], strict=module.strict_loading)
    return checkpoint


def _restore_datamodule_and_callbacks(lt, checkpoint: dict) -> None:
    """The rest of what a run restores (a fit before ``configure_optimizers``, an evaluation or
    prediction before its first batch), in Lightning's order: the DataModule's state, then every callback's ``on_load_checkpoint``, then every callback's
    state. A checkpoint without a ``callbacks`` entry (saved with weights only) calls no
    callback."""
    dm = lt.datamodule
    if dm is not None and type(dm).__qualname__ in checkpoint:
        dm.load_state_dict(checkpoint[type(dm).__qualname__])
    states = checkpoint.get("callbacks")
    if states is None:
        return
    missing = states.keys() - {callback.state_key for callback in lt.callbacks}
    if missing:
        rank_zero_warn(
            "Be aware that when using `ckpt_path`,"
            " callbacks used to create the checkpoint need to be provided during `Trainer` instantiation."
            f" Please add the following callbacks: {list(missing)}.",
        )
    module = lt.lightning_module
    for callback in lt.callbacks:
        callback.on_load_checkpoint(lt, module, checkpoint)
    for callback in lt.callbacks:
        state = states.get(callback.state_key)
        if state:
            callback.load_state_dict(state)


def restore_training_state(lt, path: str, checkpoint: dict) -> None:
    """The training state of a fit resumed from ``checkpoint`` (read from ``path``), restored
    after ``on_fit_start`` as Lightning does: the loss scaler's state (loaded once the fit's
    scaler exists), the loop counters, the optimizers and the schedulers."""
    for key in ("optimizer_states", "lr_schedulers"):
        if key not in checkpoint:
            raise KeyError(f"{path} holds weights only (no {key!r}); fit(ckpt_path=...) needs a full checkpoint")
    if len(checkpoint["optimizer_states"]) != len(lt.optimizers):
        raise ValueError(
            f"{path} has {len(checkpoint['optimizer_states'])} optimizer states, configure_optimizers made {len(lt.optimizers)}"
        )
    # Lightning's key for the fp16 scaler (its MixedPrecision plugin), and the one of older versions
    lt._scaler_state = checkpoint.get(_SCALER_KEY, checkpoint.get("native_amp_scaling_state"))
    _restore_counters(lt, checkpoint)
    for optimizer, state in zip(lt.optimizers, checkpoint["optimizer_states"]):
        optimizer.load_state_dict(state)
    for config, state in zip(lt.lr_scheduler_configs, checkpoint["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    rank_zero_info(f"Restored all states from the checkpoint at {path}")


def _restore_counters(lt, checkpoint: dict) -> None:
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if fit is not None:  # without it Lightning restarts at epoch 0 (weights and optimizer kept)
        lt.fit_loop.restore(fit)


class CheckpointConnector:
    """``trainer._checkpoint_connector``: the parts of Lightning's checkpoint connector that code
    written for ``lightning.Trainer`` calls, Lightning's tuner first (it saves a checkpoint before
    its trial steps and restores it after them)."""

    def __init__(self, lt):
        self._lt = lt

    def restore(self, checkpoint_path: Optional[str] = None, weights_only: Optional[bool] = None) -> None:
        """Everything a checkpoint holds, restored inside a run as Lightning restores it: the
        module, the DataModule's and the callbacks' states; in a fit the loop counters, the
        optimizers, the schedulers and the loss scaler's state; in an evaluation or a prediction
        that run's loop counters. Without a path, nothing (Lightning's restore of no file).
        ``weights_only`` as for :func:`load`."""
        if checkpoint_path is None:
            return
        lt = self._lt
        checkpoint = restore_modules_and_callbacks(lt, checkpoint_path, weights_only)
        fn = lt.state.fn
        if fn == TrainerFn.FITTING:
            restore_training_state(lt, checkpoint_path, checkpoint)
            return
        loops = checkpoint.get("loops")
        name = {TrainerFn.VALIDATING: "validate_loop", TrainerFn.TESTING: "test_loop",
                TrainerFn.PREDICTING: "predict_loop"}.get(fn)
        if loops is not None and name in loops:
            getattr(lt, name).load_state_dict(loops[name])
        rank_zero_info(f"Restored all states from the checkpoint at {checkpoint_path}")

    def dump_checkpoint(self, weights_only: bool = False) -> dict:
        """The checkpoint ``trainer.save_checkpoint`` would write, as a dict."""
        return dump_checkpoint(self._lt, weights_only)
