"""The contract between the trainer and a step engine.

An engine runs one micro-step: the trainer's hooks ``calculate_train_batch_loss`` ->
``backward_step`` and, on update steps, gradient clipping -> ``optimizer_step`` ->
``scheduler_step`` -> ``optimizer_zero_grad``. It returns the batch output dict of
``calculate_train_batch_loss`` (with the loss NOT divided by the accumulation steps) and keeps
per-step values on the device. Engines differ in how they run that (eagerly, compiled, replayed
from a CUDA graph); the trainer picks one at setup and never branches on it in the loop.
Everything an engine knows of the trainer comes through the :class:`StepContext` it is built
with (engine/context.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from fasttrain.engine.context import StepContext, in_one_process
from fasttrain.engine.trainable import notice_trainable_change


class StepEngine:
    """Base class of step engines."""

    #: the name users pass as ``Trainer(engine=...)``
    name = "base"

    def __init__(self, ctx: StepContext):
        if not isinstance(ctx, StepContext):
            raise TypeError(
                f"{type(self).__name__} needs a StepContext (fasttrain.engine.context), got "
                f"{type(ctx).__name__}; a Trainer builds one with fasttrain.prepare.step_context"
            )
        self.ctx = ctx
        #: the object whose public hooks the step runs (engines use no private name of it)
        self.trainer = ctx.trainer
        #: global gradient norm of the last update (device tensor), when clipping by norm
        self.last_grad_norm: Optional[torch.Tensor] = None
        #: no micro-step has an all-reduce to suppress (one process): ``no_sync`` is a null context
        self.one_process = ctx.no_sync is in_one_process

    # called once per train()/evaluate(), after accelerate has prepared model and optimizer
    def setup(self) -> None:
        pass

    def start_train_epoch(self) -> None:
        """At each training epoch's start, after the ``on_train_epoch_start`` callbacks (where
        finetuning unfreezes layers): code dynamo compiled with other parameters trainable is
        traced again where dynamo would not notice (engine/trainable.py). Every engine: a model
        the user compiled runs under the eager engine too."""
        notice_trainable_change(self.trainer.model)

    def train_step(self, batch, update: bool) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def eval_step(self, batch) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def compiled_graphs(self) -> dict:
        """For each hook this engine runs compiled: a ``HookGraphs`` (engine/graph_report.py)
        saying how many graphs it became. Nothing for an engine that compiles nothing."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ------------------------------------------------------------------ shared helpers
    def no_sync_context(self, update: bool):
        """``no_sync`` of the DDP-wrapped model on micro-steps that do not update, so that
        gradients are all-reduced once per optimizer update."""
        return self.ctx.no_sync(update)
