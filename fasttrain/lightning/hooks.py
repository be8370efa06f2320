"""Calling the hooks of a LightningModule and its callbacks, in Lightning's order.

A hook is called on the callbacks first (in list order), then on the module, with
``module._current_fx_name`` naming it so that ``self.log`` inside picks the hook's defaults.
Lightning calls whatever callable a hook's name resolves to on the instance, so a hook set on
the instance (``LambdaCallback``, ``model.on_train_epoch_start = f``, ``mock.patch.object``)
runs and one set to ``None`` is skipped. Which hooks do something (anything but the base class's
no-op) is resolved once per run, so a step pays only for the hooks someone wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Dict, List

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    GradientAccumulationScheduler,
    ThroughputMonitor,
)
from lightning.pytorch.utilities import rank_zero_info

# hooks whose module override runs host code inside the optimizer update: the compiled update
# cannot honour them (see Trainer's engine choice)
UPDATE_HOOKS = ("optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping")
# hooks Lightning runs around the backward (the zero-grad ones at a window's first batch, before it)
BACKWARD_HOOKS = ("backward", "on_before_backward", "on_after_backward", "on_before_zero_grad", "optimizer_zero_grad")
# those of them whose overrides (the module's and callbacks') the graphed engine captures, compiled
# (graphed_hooks.py): their self.log calls are recorded and filed again after each replay, what
# they read is checked before each replay, and what they change on the module or their callback
# refuses the capture (graph_logging.py)
OBSERVED_BACKWARD_HOOKS = ("on_before_backward", "on_after_backward")
# those of them that the graphed engine runs eagerly before a window's first step, outside any capture
ZERO_GRAD_HOOKS = ("on_before_zero_grad", "optimizer_zero_grad")
# the callback hooks the graphed engine captures, compiled (with the update, or graphed_hooks.py):
# what they change on their callback refuses the capture, as for the module (graph_logging.py)
CAPTURED_CALLBACK_HOOKS = (*OBSERVED_BACKWARD_HOOKS, "on_before_optimizer_step")


# LightningModule defaults that do something and must run when not overridden
_ACTIVE_DEFAULTS = frozenset({
    "setup", "teardown", "configure_model", "prepare_data", "on_validation_model_eval", "on_test_model_eval",
    "on_predict_model_eval", "on_validation_model_train", "on_test_model_train", "on_predict_model_train",
    "on_validation_model_zero_grad", "transfer_batch_to_device", "optimizer_zero_grad", "backward",
    "configure_gradient_clipping", "lr_scheduler_step", "optimizer_step",
})


def _replaced(obj, name: str, base: type) -> bool:
    """Whether ``obj.<name>`` (looked up on the instance, as Lightning calls it) is a callable
    other than ``base``'s own method: an override in the class, or anything set on the instance.
    ``None`` or another non-callable disables the hook, as in Lightning."""
    attr = getattr(obj, name, None)
    if attr is None or not callable(attr):
        return False
    return getattr(attr, "__func__", None) is not getattr(base, name, None)


def module_overrides(module: LightningModule, name: str) -> bool:
    return _replaced(module, name, LightningModule)


def callback_overrides(callback: Callback, name: str) -> bool:
    return _replaced(callback, name, Callback)


def is_monitoring(callback: Callback) -> bool:
    # Lightning calls these after the module's on_train_epoch_end, so they can monitor a value
    # logged there
    return isinstance(callback, (Checkpoint, EarlyStopping))


# Lightning callbacks that need parts of lightning.Trainer fasttrain does not have: what to use instead
_UNSUPPORTED_CALLBACKS = (
    (GradientAccumulationScheduler,
     "fasttrain keeps one accumulation for the whole fit; set Trainer(accumulate_grad_batches=N), or fit in "
     "stages (one Trainer per accumulation, resuming with fit(ckpt_path=...))"),
    (ThroughputMonitor,
     "it times every batch (synchronising the device each step) through loop internals fasttrain does not "
     "have; time epochs in a Callback of your own (on_train_epoch_start/on_train_epoch_end)"),
)


def check_supported_callbacks(callbacks) -> None:
    """A ``ValueError`` naming the first callback fasttrain cannot run, and what to use instead
    (such a callback would otherwise do nothing or fail deep inside a hook)."""
    for callback in callbacks:
        for kind, instead in _UNSUPPORTED_CALLBACKS:
            if isinstance(callback, kind):
                raise ValueError(
                    f"fasttrain.lightning.Trainer does not support the callback {type(callback).__name__}: {instead}."
                )


def order_callbacks(callbacks) -> list:
    """Checkpoint callbacks last (order otherwise kept), as Lightning runs them: they see what
    the others did."""
    return [cb for cb in callbacks if not isinstance(cb, Checkpoint)] + [
        cb for cb in callbacks if isinstance(cb, Checkpoint)
    ]


def call_module_hook(module: LightningModule, name: str, *args, **kwargs):
    """``module.<name>(...)`` with ``module._current_fx_name`` naming the hook meanwhile (the
    ``__dict__`` directly: ``nn.Module.__setattr__`` costs microseconds per call). A hook set to
    ``None`` (or anything not callable) is skipped and gives ``None``, as in Lightning."""
    method = getattr(module, name)
    if not callable(method):
        return None
    state = module.__dict__
    previous = state.get("_current_fx_name")
    state["_current_fx_name"] = name
    try:
        return method(*args, **kwargs)
    finally:
        state["_current_fx_name"] = previous


def merge_module_callbacks(trainer, module: LightningModule) -> None:
    """Add the callbacks ``module.configure_callbacks()`` returns to ``trainer.callbacks``, as
    Lightning does at the start of every fit, validate, test and predict: a returned callback
    replaces the trainer's callbacks of its class or a parent class (said at INFO level, through
    Lightning's logger), and checkpoint callbacks move to the end."""
    if not module_overrides(module, "configure_callbacks"):
        return
    returned = call_module_hook(module, "configure_callbacks")
    if not returned:
        return
    returned = list(returned) if isinstance(returned, Sequence) else [returned]
    check_supported_callbacks(returned)
    # a trainer callback is replaced when a returned one is of its class or a subclass; a plain
    # Callback() instance is never matched, since every callback is a subclass of Callback
    trainer_types = {type(cb) for cb in trainer.callbacks} - {Callback}
    replaced = {
        next(t for t in trainer_types if issubclass(kind, t))
        for kind in {type(cb) for cb in returned}
        if any(issubclass(kind, t) for t in trainer_types)
    }
    if replaced:
        rank_zero_info(
            "The following callbacks returned in `LightningModule.configure_callbacks` will override existing "
            f"callbacks passed to Trainer: {', '.join(sorted(t.__name__ for t in replaced))}"
        )
    kept = [cb for cb in trainer.callbacks if type(cb) not in replaced]
    trainer.callbacks = order_callbacks(kept + returned)


class HookCaller:
    """Calls hooks by name on the callbacks and the module of one run."""

    def __init__(self, trainer, module: LightningModule, callbacks: List[Callback]):
        self.trainer = trainer
        self.module = module
        self.callbacks = callbacks
        #: per hook name, ``(callback, method)`` for the callbacks whose hook does something
        self._callback_methods: Dict[str, list] = {}
        self._module_overrides: Dict[str, bool] = {}
        # decided now for the hooks a compiled step or update calls: a cache filled while dynamo
        # traces them would fail the compiled function's guards at its next call
        for name in UPDATE_HOOKS + BACKWARD_HOOKS:
            self.callback_methods(name)
            self._decide_module_hook(name)

    def callback_methods(self, name: str) -> list:
        methods = self._callback_methods.get(name)
        if methods is None:
            methods = [(cb, getattr(cb, name)) for cb in self.callbacks if callback_overrides(cb, name)]
            self._callback_methods[name] = methods
        return methods

    def callbacks_only(self, name: str, *args, monitoring=None, **kwargs) -> None:
        module = self.module
        state = module.__dict__  # nn.Module.__setattr__ costs microseconds per call on the hot path
        previous = state.get("_current_fx_name")
        for callback, method in self.callback_methods(name):
            if monitoring is not None and is_monitoring(callback) != monitoring:
                continue
            state["_current_fx_name"] = name
            method(self.trainer, module, *args, **kwargs)
        state["_current_fx_name"] = previous

    def module_hook(self, name: str, *args, **kwargs):
        return call_module_hook(self.module, name, *args, **kwargs)

    def __call__(self, name: str, *args, **kwargs):
        """Callbacks, then the module; returns the module's result. A module hook that is not
        overridden is LightningModule's no-op and is skipped, as is one set to ``None``."""
        if self.callback_methods(name):
            self.callbacks_only(name, *args, **kwargs)
        overridden = self._module_overrides.get(name)
        if overridden is None:
            overridden = self._decide_module_hook(name)
        if overridden:
            return self.module_hook(name, *args, **kwargs)
        return None

    def _decide_module_hook(self, name: str) -> bool:
        """Whether ``self(name)`` calls the module's hook (kept per name)."""
        overridden = self._module_overrides[name] = module_overrides(self.module, name) or (
            name in _ACTIVE_DEFAULTS and callable(getattr(self.module, name, None))
        )
        return overridden

    def sole_callback(self, name: str):
        """The one callback whose ``name`` hook runs, when no other does and the module's own
        ``name`` hook is LightningModule's no-op; else None."""
        methods = self.callback_methods(name)
        if len(methods) != 1 or module_overrides(self.module, name):
            return None
        return methods[0][0]

    def overridden(self, name: str) -> bool:
        """Whether the module or a callback overrides ``name`` (a hook with no effect otherwise
        can be skipped on the hot path)."""
        return module_overrides(self.module, name) or bool(self.callback_methods(name))
