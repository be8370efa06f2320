"""Which checkpoint ``fit``/``validate``/``test``/``predict`` load: Lightning's reading of
``ckpt_path`` (``None``, ``"best"``, ``"last"`` or a path), its warnings and errors included.

Called before the run attaches the module, as Lightning calls it: ``model_connected`` says
whether the trainer already holds a module (from an earlier ``fit``), which makes a
``validate()``/``test()``/``predict()`` without a model load the best checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fasttrain.lightning import ckpt_files


def select(lt, fn: str, ckpt_path, model_provided: bool, model_connected: bool) -> Optional[str]:
    """The checkpoint path a run of ``fn`` ("fit", "validate", ...) loads, or None for none;
    a path the user set with ``trainer.ckpt_path = ...`` is used unless ``ckpt_path`` is given."""
    if lt._ckpt_path_user_managed:
        if not ckpt_path:
            return lt._ckpt_path
        rank_zero_warn(
            f"`trainer.ckpt_path = {lt._ckpt_path!r}` was called but then you"
            f" passed `trainer.fit(ckpt_path={ckpt_path!r})`. The latter will be loaded."
        )
        lt._ckpt_path, lt._ckpt_path_user_managed = None, False
    return _parse(lt, fn, ckpt_path, model_provided, model_connected)


def _parse(lt, fn: str, ckpt_path, model_provided: bool, model_connected: bool) -> Optional[str]:
    on_exception = [cb for cb in lt.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    if ckpt_path is None and on_exception and lt.state.fn == "fit":
        ckpt_path = "last"
        rank_zero_warn(
            f"`.{fn}(ckpt_path=None)` was called without a model."
            " The last model of the previous `fit` call will be used."
            f" You can pass `{fn}(ckpt_path='best')` to use the best model or"
            f" `{fn}(ckpt_path='last')` to use the last model."
            " If you pass a value, this warning will be silenced."
        )
    if model_provided and ckpt_path is None:
        return None  # the given module's own weights
    if model_connected and ckpt_path is None:
        ckpt_path = "best"
        tip = (
            " There is also an on-exception checkpoint available, however it is used by default only when fitting."
            if on_exception
            else ""
        )
        rank_zero_warn(
            f"`.{fn}(ckpt_path=None)` was called without a model."
            " The best model of the previous `fit` call will be used."
            + tip
            + f" You can pass `.{fn}(ckpt_path='best')` to use the best model or"
            f" `.{fn}(ckpt_path='last')` to use the last model."
            " If you pass a value, this warning will be silenced."
        )
    if ckpt_path == "best":
        ckpt_path = _best(lt, fn)
    elif ckpt_path == "last":
        ckpt_path = _last(lt, fn)
        if ckpt_path is None:
            return None
    if not ckpt_path:
        raise ValueError(
            f"`.{fn}()` found no path for the best weights: {ckpt_path!r}. Please"
            f" specify a path for a checkpoint `.{fn}(ckpt_path=PATH)`"
        )
    path = os.fspath(ckpt_path)
    if not ckpt_files.is_file(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return path


def _best(lt, fn: str) -> str:
    if len(lt.checkpoint_callbacks) > 1:
        rank_zero_warn(
            f'`.{fn}(ckpt_path="best")` is called with Trainer configured with multiple `ModelCheckpoint`'
            " callbacks. It will use the best checkpoint path from first checkpoint callback."
        )
    callback = lt.checkpoint_callback
    if not callback:
        raise ValueError(f'`.{fn}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured.')
    if hasattr(callback, "best_model_path") and not callback.best_model_path:
        if lt.fast_dev_run:
            raise ValueError(
                f'You cannot execute `.{fn}(ckpt_path="best")` with `fast_dev_run=True`.'
                f" Please pass an exact checkpoint path to `.{fn}(ckpt_path=...)`"
            )
        raise ValueError(
            f'`.{fn}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save the best model.'
        )
    return getattr(callback, "best_model_path", None)


def _last(lt, fn: str) -> Optional[str]:
    """The newest last checkpoint: an on-exception checkpoint, or a ``last*.ckpt`` file in a
    ModelCheckpoint's folder (also one this trainer's callbacks did not write)."""
    candidates = {getattr(cb, "ckpt_path", None) for cb in lt.callbacks if isinstance(cb, OnExceptionCheckpoint)}
    for callback in lt.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(lt)
    modified = {path: ckpt_files.modified(path) for path in candidates if path and ckpt_files.exists(path)}
    if not modified:
        # not an error, so that it can be set before the first fit
        rank_zero_warn(
            f'.{fn}(ckpt_path="last") is set, but there is no last checkpoint available.'
            " No checkpoint will be loaded. HINT: Set `ModelCheckpoint(..., save_last=True)`."
        )
        return None
    return max(modified, key=modified.get)
