"""``self.log`` inside an eager training or evaluation step, without the per-call re-checks.

``LightningModule.log`` re-derives, on every call, facts that cannot change during a fit: it
inspects ``training_step``'s signature for a ``dataloader_iter`` argument (``inspect`` builds a
signature object each time), walks the value twice with ``apply_to_collection`` to reject nested
dicts and wrong types, and looks up the hook's logging defaults. On a small model that is most of
a step's Python time beside the model itself.

:func:`step_logger` builds, once per fit, a ``log`` with the same arguments that does the same
work with those facts decided once: for the common call (a plain tensor value in a step that may
log, a known ``on_step``/``on_epoch``) it checks, converts (``clone().detach().squeeze()``) and
files the value as ``LightningModule.log`` does; every other call (numbers, torchmetrics
objects, a missing trainer or hook name, values that Lightning rejects, a warning to emit) goes to
``LightningModule.log`` itself, so errors and warnings are Lightning's own.

The runner puts it in the module's ``__dict__`` only while a step runs (instance attributes come
before class attributes, so ``self.log`` finds it) and removes it afterwards; the module is left
as it was outside the step. On the eager engine that is the step method's call; the compiled
engines trace it with the step, so it is in place around the engine's call instead (outside the
traced function: dynamo would guard on the dict's changes), and what dynamo guards before every
call of the compiled step (and before every replay of its CUDA graph) is this function's few
checks rather than ``LightningModule.log``'s signature inspection and collection walks. Traced, it
reads the hook's name from the module (``module._current_fx_name``: dynamo sees the runner's write
of it inside the traced call there) and leaves its cache of logging levels as it found it (a
cache filled while tracing would fail the compiled step's guards at its next call).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature


#: the step methods whose logging levels step_logger decides before any step runs
_STEPS = ("training_step", "validation_step", "test_step")
_FLAGS = (None, True, False)


def _step_levels() -> dict:
    levels = {}
    for fx in _STEPS:
        for on_step in _FLAGS:
            for on_epoch in _FLAGS:
                try:
                    levels[fx, on_step, on_epoch] = _FxValidator.check_logging_and_get_default_levels(
                        fx, on_step=on_step, on_epoch=on_epoch
                    )
                except MisconfigurationException:
                    pass  # a call with these raises Lightning's error, as LightningModule.log does
    return levels


def step_logger(module: LightningModule, trainer) -> Optional[Callable]:
    """A ``log`` for ``module``'s steps under ``trainer``, or ``None`` when the module's class
    defines its own ``log`` (which then runs as written)."""
    if type(module).log is not LightningModule.log:
        return None
    original = LightningModule.log
    state = module.__dict__
    # (hook, on_step, on_epoch) -> Lightning's validated (on_step, on_epoch); filled for the step
    # methods here, so that a traced step reads the dict instead of tracing Lightning's validator
    levels = _step_levels()
    # a training_step that takes ``dataloader_iter`` must log with a batch_size: Lightning's
    # error, which its own log raises (decided once: the signature does not change in a fit)
    dataloader_iter_step = is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)

    def log(name, value, prog_bar=False, logger=None, on_step=None, on_epoch=None, reduce_fx="mean",
            enable_graph=False, sync_dist=False, sync_dist_group=None, add_dataloader_idx=True, batch_size=None,
            metric_attribute=None, rank_zero_only=False):
        fx = module._current_fx_name
        results = trainer._results
        if (
            value.__class__ is not torch.Tensor
            or fx is None
            or results is None
            or state.get("_trainer") is not trainer
            or state.get("_fabric") is not None
            or trainer.barebones
            # an explicit bool or None (a default): other values (1, a numpy bool) take Lightning's path
            or not (on_step is None or on_step is True or on_step is False)
            or not (on_epoch is None or on_epoch is True or on_epoch is False)
            or (add_dataloader_idx and "/dataloader_idx_" in name)
            or (logger and trainer.logger is None)
            or (dataloader_iter_step and batch_size is None and trainer.training)  # Lightning's error
        ):
            return original(module, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph,
                            sync_dist, sync_dist_group, add_dataloader_idx, batch_size, metric_attribute,
                            rank_zero_only)
        key = (fx, on_step, on_epoch)
        resolved = levels.get(key)
        if resolved is None:
            resolved = _FxValidator.check_logging_and_get_default_levels(fx, on_step=on_step, on_epoch=on_epoch)
            if not torch.compiler.is_compiling():
                levels[key] = resolved
        # Lightning's clone().detach().squeeze(): the same fresh, detached one-element tensor;
        # detaching first records no clone in the autograd graph, and a 0-dim value is final
        value = value.detach().clone()
        if value.ndim:
            if value.numel() != 1:
                return original(module, name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, enable_graph,
                                sync_dist, sync_dist_group, add_dataloader_idx, batch_size, metric_attribute,
                                rank_zero_only)  # Lightning's error
            value = value.squeeze()
        connector = trainer._logger_connector
        if connector.should_reset_tensors(fx):
            results.reset(metrics=False, fx=fx)
        sync_dist = sync_dist and trainer._accelerator_connector.is_distributed
        # the store files the value (results.py); its public log() adds only what a step traced by
        # dynamo needs (the call recorded), so an eager step calls the filing itself
        file = results.log if torch.compiler.is_compiling() or results.recording else results._log
        file(fx, name, value, prog_bar, True if logger is None else logger, resolved[0], resolved[1], reduce_fx,
             enable_graph, add_dataloader_idx, batch_size, sync_dist, trainer.strategy.reduce if sync_dist else None,
             sync_dist_group, metric_attribute, rank_zero_only)
        connector._current_fx = fx

    return log
