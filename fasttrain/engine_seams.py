"""What a trainer hands its step engine besides its public hooks, kept on fasttrain's Trainer.

Each method gives one field of the step context (:func:`fasttrain.prepare.step_context`,
engine/context.py) from the trainer's state: which hooks it overrides, where in its epoch the
step about to run is, the Python side effects a graph replay must redo, the clearing of the
gradients to run before a graphed step, what the compiled functions are kept with. The defaults are the
Trainer's; fasttrain.lightning's runner (lightning/runner.py) overrides them with what a
LightningModule's hooks need.
"""

from __future__ import annotations

from fasttrain.engine.context import NO_HOST_EFFECTS, overridden_hooks


class EngineSeams:
    """Base of :class:`fasttrain.trainer.Trainer`: its side of the step context."""

    def _overridden_step_hooks(self, base) -> frozenset:
        """The step hooks this trainer overrides, as the engines must take them (the graphed
        engine zeroes gradients itself where ``optimizer_zero_grad`` is the default)."""
        return overridden_hooks(self, base)

    def _compile_owner(self):
        """What the engines' compiled functions are kept with (StepContext.compile_owner)."""
        return self

    def _epoch_position(self):
        """``(step_in_epoch, last_batch)`` for the step context: where in its epoch the step about
        to run is (engine/context.py); ``last_batch`` None: from the epoch's batch count."""
        return (lambda: self.progress.step_in_epoch), None

    def _host_effects(self):
        """What a step's Python leaves for the host that a graph replay must redo: nothing here
        (the Lightning runner's ``self.log`` calls)."""
        return NO_HOST_EFFECTS

    def _zero_grad_before_step(self):
        """StepContext.zero_grad_before_step: None, gradients are cleared after each update here
        (the Lightning runner clears them at a window's start, where Lightning does)."""
        return None
