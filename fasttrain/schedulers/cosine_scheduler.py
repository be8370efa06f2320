"""Cosine annealing without restarts, with optional linear warmup, cooldown and k-decay."""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, List

import torch

from fasttrain.placeholders import TrainerPlaceholderValues
from fasttrain.schedulers.scheduler_base import SchedulerConfigError, StatefulSchedulerBase

__all__ = ["CosineLrScheduler"]


class CosineLrScheduler(StatefulSchedulerBase):
    """Cosine learning-rate annealing (SGDR, https://arxiv.org/abs/1608.03983, without restarts).

    Counted in optimizer updates ``n`` (epochs times ``num_update_steps_per_epoch``), with
    ``W`` warmup updates, ``C`` cooldown updates and ``L = total - W - C`` cosine updates:

    - ``n < W``: linear warmup from the starting learning rate towards the group's learning rate;
    - ``W <= n < W + L``: ``lr_min + (lr_max - lr_min) * (1 + cos(pi * t**k / L**k)) / 2``
      with ``t = n - W``, so the cosine ends exactly at the start of the cooldown;
    - afterwards (cooldown, and any step past the end): ``lr_min``.

    ``k_decay`` > 1 keeps the learning rate high for longer (https://arxiv.org/abs/2004.05909).
    ``min_lr_ratio`` and ``warmup_starting_lr_ratio``, when given, express ``lr_min`` and the
    warmup start as fractions of each group's learning rate and take precedence.

    Compatibility notes (kept from pytorch-accelerated 0.1.61 so that runs migrate unchanged):
    the warmup slope is always ``(lr_max - warmup_starting_lr) / W``, also when
    ``warmup_starting_lr_ratio`` sets the start; and while warmup is configured, the value
    written on construction is ``warmup_starting_lr`` itself.
    One deliberate difference: pytorch-accelerated ends the cosine phase ``W`` updates early and
    jumps to ``lr_min``; here the cosine phase lasts its full ``L`` updates.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_epochs: int,
        num_update_steps_per_epoch: int,
        k_decay=1.0,
        lr_min: float = 1e-6,
        min_lr_ratio=None,
        num_warmup_epochs: int = 0,
        warmup_starting_lr=1e-6,
        warmup_starting_lr_ratio=None,
        num_cooldown_epochs=0,
    ):
        """
        :param optimizer: the optimizer whose groups' learning rates are scheduled
        :param total_num_epochs: epochs in the whole schedule, warmup and cooldown included
        :param num_update_steps_per_epoch: optimizer updates per epoch
        :param k_decay: exponent applied to the cosine's progress; above 1 decays later
        :param lr_min: the learning rate reached at the end of the cosine and held in cooldown
        :param min_lr_ratio: if set, each group's minimum is this fraction of its learning rate
        :param num_warmup_epochs: epochs of linear warmup at the start
        :param warmup_starting_lr: the learning rate at the first warmup update
        :param warmup_starting_lr_ratio: if set, the warmup start is this fraction of each
            group's learning rate
        :param num_cooldown_epochs: epochs held at the minimum at the end
        """
        super().__init__(optimizer)
        if not (total_num_epochs > 0 and num_update_steps_per_epoch > 0):
            raise SchedulerConfigError(
                "total_num_epochs and num_update_steps_per_epoch must both be positive, got "
                f"{total_num_epochs} and {num_update_steps_per_epoch}."
            )
        if lr_min < 0:
            raise SchedulerConfigError(f"lr_min must be non-negative, got {lr_min}.")
        self.total_iterations = total_num_epochs * num_update_steps_per_epoch
        self.lr_min_ratio = min_lr_ratio
        self.lr_min = lr_min
        self.warmup_iterations = num_warmup_epochs * num_update_steps_per_epoch
        self.warmup_lr_init = warmup_starting_lr
        self.warmup_lr_ratio = warmup_starting_lr_ratio
        self.k_decay = k_decay
        self.num_cooldown_iterations = num_cooldown_epochs * num_update_steps_per_epoch
        if self.warmup_iterations:
            self._update_param_groups(self.warmup_lr_init)

    def _minimum(self, lr_max: float) -> float:
        return self.lr_min_ratio * lr_max if self.lr_min_ratio is not None else self.lr_min

    def _warmup_start(self, lr_max: float) -> float:
        if self.warmup_lr_ratio is not None:
            return self.warmup_lr_ratio * lr_max
        return self.warmup_lr_init

    def get_updated_values(self, num_updates: int) -> List[float]:
        """Return each group's learning rate after ``num_updates`` completed updates."""
        warmup = self.warmup_iterations
        cosine_length = self.total_iterations - warmup - self.num_cooldown_iterations

        if num_updates < warmup:
            return [
                self._warmup_start(lr_max)
                + num_updates * ((lr_max - self.warmup_lr_init) / warmup)
                for lr_max in self.base_lr_values
            ]

        progress = num_updates - warmup
        if progress < cosine_length:
            fraction = progress**self.k_decay / cosine_length**self.k_decay
            cosine = 1 + math.cos(math.pi * fraction)
            return [
                self._minimum(lr_max) + 0.5 * (lr_max - self._minimum(lr_max)) * cosine
                for lr_max in self.base_lr_values
            ]

        return [self._minimum(lr_max) for lr_max in self.base_lr_values]

    @classmethod
    def create_scheduler_fn(
        cls,
        total_num_epochs: int = TrainerPlaceholderValues.NUM_EPOCHS,
        num_update_steps_per_epoch: int = TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
        k_decay=1.0,
        lr_min: float = 1e-6,
        min_lr_ratio=None,
        num_warmup_epochs: int = 0,
        warmup_starting_lr=1e-6,
        warmup_starting_lr_ratio=None,
        num_cooldown_epochs=0,
    ) -> Callable:
        """Return a factory ``fn(optimizer) -> CosineLrScheduler`` for ``Trainer.train``.

        The number of epochs and of updates per epoch default to placeholders that the trainer
        fills in once its dataloaders exist::

            trainer.train(
                train_dataset=train_dataset,
                num_epochs=10,
                create_scheduler_fn=CosineLrScheduler.create_scheduler_fn(num_warmup_epochs=1),
            )

        The other arguments are those of the constructor.
        """
        return partial(
            cls,
            total_num_epochs=total_num_epochs,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            lr_min=lr_min,
            min_lr_ratio=min_lr_ratio,
            k_decay=k_decay,
            num_warmup_epochs=num_warmup_epochs,
            warmup_starting_lr=warmup_starting_lr,
            warmup_starting_lr_ratio=warmup_starting_lr_ratio,
            num_cooldown_epochs=num_cooldown_epochs,
        )

    def state_dict(self) -> dict:
        """Return the schedule's settings and update count (plain Python values)."""
        return {
            "total_iterations": self.total_iterations,
            "lr_min_ratio": self.lr_min_ratio,
            "lr_min": self.lr_min,
            "warmup_iterations": self.warmup_iterations,
            "warmup_lr_init": self.warmup_lr_init,
            "warmup_lr_ratio": self.warmup_lr_ratio,
            "k_decay": self.k_decay,
            "num_cooldown_iterations": self.num_cooldown_iterations,
            "num_updates": self._num_updates,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved; the optimizer's values are not rewritten
        until the next :meth:`step`."""
        for key in (
            "total_iterations",
            "lr_min_ratio",
            "lr_min",
            "warmup_iterations",
            "warmup_lr_init",
            "warmup_lr_ratio",
            "k_decay",
            "num_cooldown_iterations",
        ):
            setattr(self, key, state_dict[key])
        self._num_updates = state_dict["num_updates"]
