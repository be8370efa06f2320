"""Calling the hooks of a LightningModule and its callbacks, in Lightning's order.

A hook is called on the callbacks first (in list order), then on the module, with
``module._current_fx_name`` naming it so that ``self.log`` inside picks the hook's defaults.
Which callbacks override a per-step hook is resolved once per run, so a step pays only for the
hooks someone wrote.
"""

from __future__ import annotations

from typing import Dict, List

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping

# hooks whose module override runs host code inside the optimizer update: the compiled update
# cannot honour them (see Trainer's engine choice)
UPDATE_HOOKS = ("optimizer_step", "on_before_optimizer_step", "configure_gradient_clipping")
# hooks captured with the backward in a CUDA graph
BACKWARD_HOOKS = ("backward", "on_before_backward", "on_after_backward", "on_before_zero_grad", "optimizer_zero_grad")


# LightningModule defaults that do something and must run when not overridden
_ACTIVE_DEFAULTS = frozenset({
    "setup", "teardown", "configure_model", "prepare_data", "on_validation_model_eval", "on_test_model_eval",
    "on_predict_model_eval", "on_validation_model_train", "on_test_model_train", "on_predict_model_train",
    "on_validation_model_zero_grad", "transfer_batch_to_device", "optimizer_zero_grad", "backward",
    "configure_gradient_clipping", "lr_scheduler_step", "optimizer_step",
})


def module_overrides(module: LightningModule, name: str) -> bool:
    return getattr(type(module), name, None) is not getattr(LightningModule, name, None)


def callback_overrides(callback: Callback, name: str) -> bool:
    return getattr(type(callback), name, None) is not getattr(Callback, name, None)


def is_monitoring(callback: Callback) -> bool:
    # Lightning calls these after the module's on_train_epoch_end, so they can monitor a value
    # logged there
    return isinstance(callback, (Checkpoint, EarlyStopping))


class HookCaller:
    """Calls hooks by name on the callbacks and the module of one run."""

    def __init__(self, trainer, module: LightningModule, callbacks: List[Callback]):
        self.trainer = trainer
        self.module = module
        self.callbacks = callbacks
        self._callback_methods: Dict[str, list] = {}
        self._module_overrides: Dict[str, bool] = {}

    def callback_methods(self, name: str) -> list:
        methods = self._callback_methods.get(name)
        if methods is None:
            methods = [getattr(cb, name) for cb in self.callbacks if callback_overrides(cb, name)]
            self._callback_methods[name] = methods
        return methods

    def callbacks_only(self, name: str, *args, monitoring=None, **kwargs) -> None:
        module = self.module
        state = module.__dict__  # nn.Module.__setattr__ costs microseconds per call on the hot path
        previous = state.get("_current_fx_name")
        for method in self.callback_methods(name):
            if monitoring is not None and is_monitoring(method.__self__) != monitoring:
                continue
            state["_current_fx_name"] = name
            method(self.trainer, module, *args, **kwargs)
        state["_current_fx_name"] = previous

    def module_hook(self, name: str, *args, **kwargs):
        module = self.module
        state = module.__dict__
        previous = state.get("_current_fx_name")
        state["_current_fx_name"] = name
        try:
            return getattr(module, name)(*args, **kwargs)
        finally:
            state["_current_fx_name"] = previous

    def __call__(self, name: str, *args, **kwargs):
        """Callbacks, then the module; returns the module's result. A module hook that is not
        overridden is LightningModule's no-op and is skipped."""
        if self.callback_methods(name):
            self.callbacks_only(name, *args, **kwargs)
        overridden = self._module_overrides.get(name)
        if overridden is None:
            overridden = self._module_overrides[name] = module_overrides(self.module, name) or name in _ACTIVE_DEFAULTS
        if overridden:
            return self.module_hook(name, *args, **kwargs)
        return None

    def overridden(self, name: str) -> bool:
        """Whether the module or a callback overrides ``name`` (a hook with no effect otherwise
        can be skipped on the hot path)."""
        return module_overrides(self.module, name) or bool(self.callback_methods(name))
