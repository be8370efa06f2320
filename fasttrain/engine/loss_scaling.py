"""The loss that backward sees.

Divided by the accumulation steps, so that the accumulated gradients are those of the mean
loss over the window; and multiplied by the number of processes for token-normalised losses
(a ``num_items_in_batch`` in the batch output), whose normaliser already spans all processes
while DDP averages the gradients over them. The batch output keeps the unscaled loss: callbacks
and the step metrics see what ``calculate_train_batch_loss`` returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fasttrain import validation


@dataclass(frozen=True)
class LossScaling:
    """``batch_output -> loss for backward``; ints only, so a compiled forward that calls it
    guards on constants that stay equal across ``train()`` calls with the same settings."""

    accumulation_steps: int = 1
    num_processes: int = 1
    distributed: bool = False

    @classmethod
    def from_run_config(cls, config) -> "LossScaling":
        return cls(config.gradient_accumulation_steps, config.num_processes, bool(config.is_distributed))

    def __call__(self, batch_output: dict):
        # validation.train_loss's checks (host-only: a clear error before backward), made here
        # for the usual output, a dict with a plain tensor loss; it runs every micro-step
        loss = batch_output.get("loss") if type(batch_output) is dict else None
        # ndim, an attribute, spares numel()'s call through torch's argument parser for a scalar
        if type(loss) is not torch.Tensor or (loss.ndim and loss.numel() != 1) or not loss.requires_grad:
            loss = validation.train_loss(batch_output)  # raises, or accepts a subclass or Mapping
        if self.accumulation_steps == 1 and not self.distributed:
            return loss  # nothing to scale
        return self.scale(loss, batch_output)

    def scale(self, loss, batch_output: dict):
        if self.distributed and "num_items_in_batch" in batch_output:
            loss = loss * self.num_processes
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        return loss
