"""pytorch-accelerated's per-step NaN check, kept for subclasses that customise it.

pytorch-accelerated's ``TerminateOnNaNCallback`` checked every step's loss in
``check_for_nan_after_batch(batch_output, step)``, called from ``on_train_step_end`` and
``on_eval_step_end``. fasttrain's callback checks batched host values at flushes instead. A
subclass that overrides ``check_for_nan_after_batch`` still has it called after every training
and evaluation step, as before; reading the loss there makes the host wait for the device on
every step, which that subclass asked for, so a warning says so once, when the class is defined.
"""

from __future__ import annotations

import warnings

import torch

from fasttrain.callbacks.events import StopTrainingError, TrainerCallback


class PerStepNaNCheck:
    """Mixin giving ``TerminateOnNaNCallback`` pytorch-accelerated's ``check_for_nan_after_batch``
    and calling a subclass's override of it after every step."""

    triggered: bool

    def check_for_nan_after_batch(self, batch_output, step=None):
        """Raise :class:`StopTrainingError` when ``batch_output["loss"]`` is not finite.

        ``step`` names the phase (``"training"`` or ``"validation"``). This reads the loss on the
        host, a device synchronisation: fasttrain calls it only for subclasses that override it.
        """
        loss = batch_output["loss"]
        # SYNC(step): the user's per-step check reads the loss on the host (opt-in callback)
        if not bool(torch.isfinite(torch.as_tensor(loss)).all()):
            self.triggered = True
            raise StopTrainingError(f"Stopping training due to a non-finite loss in a {step} step")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.check_for_nan_after_batch is PerStepNaNCheck.check_for_nan_after_batch:
            return
        installed = []
        if getattr(cls, "on_train_step_end") is TrainerCallback.on_train_step_end:
            cls.on_train_step_end = _check_after_train_step
            installed.append("training")
        if getattr(cls, "on_eval_step_end") is TrainerCallback.on_eval_step_end:
            cls.on_eval_step_end = _check_after_eval_step
            installed.append("evaluation")
        if installed:
            warnings.warn(
                f"{cls.__qualname__} overrides check_for_nan_after_batch, which is called after "
                f"every {' and '.join(installed)} step; the loss it reads makes the host wait for "
                "the device on each step. To check without that wait, override "
                "on_metrics_flush(trainer, metrics) and read metrics.losses (host values, "
                "delivered every log_every_n_steps updates).",
                UserWarning,
                stacklevel=2,
            )


def _check_after_train_step(self, trainer, batch_output, **kwargs):
    self.check_for_nan_after_batch(batch_output, step="training")


def _check_after_eval_step(self, trainer, batch_output, **kwargs):
    self.check_for_nan_after_batch(batch_output, step="validation")
