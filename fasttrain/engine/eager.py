"""The eager step engine: the trainer's hooks run as plain PyTorch, in hook order."""

from __future__ import annotations

import torch

from fasttrain.engine.base import StepEngine


class EagerEngine(StepEngine):
    """Runs each micro-step eagerly. No host synchronisation happens here: the loss stays a
    device tensor and clipping runs on the device."""

    name = "eager"

    def train_step(self, batch, update: bool) -> dict:
        trainer, ctx = self.trainer, self.ctx
        if update or self.one_process:
            # nothing to suppress (an updating micro-step all-reduces, one process never does):
            # no context to enter, which is a measurable share of a launch-bound step
            batch_output = trainer.calculate_train_batch_loss(batch)
            trainer.backward_step(ctx.loss_for_backward(batch_output))
        else:
            with ctx.no_sync(update):
                batch_output = trainer.calculate_train_batch_loss(batch)
                trainer.backward_step(ctx.loss_for_backward(batch_output))
        if update:
            self.update_step()
        return batch_output

    def update_step(self) -> None:
        """The update part of a micro-step, after its backward: clip, step, schedule, zero."""
        trainer, ctx = self.trainer, self.ctx
        clip = ctx.clip
        if getattr(clip, "active", True):  # an UpdateClip with nothing to do is not called
            norm = clip()
            if norm is not None:
                self.last_grad_norm = norm
        trainer.optimizer_step()
        if trainer.scheduler is not None and not ctx.step_was_skipped():
            trainer.scheduler_step()
        trainer.optimizer_zero_grad()

    def eval_step(self, batch) -> dict:
        with torch.no_grad():
            return self.trainer.calculate_eval_batch_loss(batch)
