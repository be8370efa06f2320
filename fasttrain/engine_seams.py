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

    def _unchecked_step_python(self, base) -> tuple:
        """Why a training step could not be captured in a CUDA graph, for Python of the user's
        that the step runs uncompiled inside the capture (StepContext.capture_blockers). A graph
        replays the kernels its capture recorded; the compiled hooks' Python is checked before
        each replay with dynamo's guards, but an overridden ``backward_step`` runs eagerly around
        ``loss.backward()``, which dynamo does not trace: a number or a branch it reads (the epoch,
        a scale a callback sets) would be replayed as the capture saw it, with no error."""
        if "backward_step" in overridden_hooks(self, base):
            return (
                "the trainer's own backward_step runs Python inside the captured step that no replay "
                "would run again (a number or branch it reads would stay as at the capture); scale the "
                "loss in calculate_train_batch_loss instead, whose Python is compiled and checked before "
                "each replay",
            )
        return ()

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
