"""Warmup-Stable-Decay learning rates, with decay phases ending at checkpoints.

The schedule follows "Understanding Warmup-Stable-Decay Learning Rates: A River Valley Loss
Landscape Perspective" (https://arxiv.org/abs/2410.05192), in the form of pytorch-accelerated's
``WSDLrScheduler``, whose values it reproduces.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, List, Optional, Tuple

import torch

from fasttrain.placeholders import TrainerPlaceholderValues
from fasttrain.schedulers.scheduler_base import SchedulerConfigError, StatefulSchedulerBase

__all__ = ["WSDLrScheduler", "estimate_checkpoint_steps"]

# Checkpoints double in distance, so a decay longer than a third of a period could run into
# the previous checkpoint's decay.
_MAX_DECAY_RATIO_WITH_CHECKPOINTS = 1 / 3


def estimate_checkpoint_steps(total_steps: int, num_checkpoints: int = 3) -> List[int]:
    """Return the update counts at which checkpoint periods end.

    One checkpoint ends at ``total_steps``. With several, the first ends at
    ``total_steps // 4`` and each following one at twice the previous, capped at
    ``total_steps``; the list stops early once ``total_steps`` is reached. So 2 checkpoints for
    100 steps give ``[25, 50]`` (the last period does not reach the end), 3 give
    ``[25, 50, 100]``, and 5 give ``[25, 50, 100]`` too.
    """
    if num_checkpoints == 1:
        return [total_steps]
    first = total_steps // 4
    steps = []
    for index in range(num_checkpoints):
        step = min(first * 2**index, total_steps)
        steps.append(step)
        if step == total_steps:
            break
    return steps


class WSDLrScheduler(StatefulSchedulerBase):
    """Warmup, then a constant (stable) learning rate, then a short decay before each checkpoint.

    Counted in optimizer updates ``n``:

    - warmup (``n < num_warmup_steps``, skipped in a continuation run): linear from
      ``warmup_starting_lr`` to each group's learning rate;
    - each checkpoint period (see :func:`estimate_checkpoint_steps`) is stable for its first
      ``1 - decay_phase_ratio`` part and then decays over ``int(length * decay_phase_ratio)``
      updates, with progress ``t`` in [0, 1], to ``lr_min`` times the group's learning rate:
      ``lr_min + (1 - lr_min) * (1 - sqrt(t))`` when ``use_inverse_sqrt_decay`` (the default),
      else the paper's ``1 / (t / lr_min + 1 - t)``, both times the group's learning rate;
    - from the last checkpoint on, the learning rate stays at its minimum.

    ``lr_min`` is a fraction of each group's learning rate, not an absolute value.

    A continuation run (``is_continuation_from_checkpoint=True``) loads a saved state with
    :meth:`load_state_dict` and starts a fresh stable phase over its own ``total_steps``: the
    new length and checkpoints are kept, the rest of the saved state is taken over, and the
    update count is not restored.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_epochs: int = None,
        num_update_steps_per_epoch: int = None,
        total_steps: int = None,
        num_warmup_steps: int = 0,
        decay_phase_ratio: float = 0.1,
        lr_min: float = 1e-6,
        warmup_starting_lr: float = 1e-6,
        use_inverse_sqrt_decay: bool = True,
        num_checkpoints: int = 1,
        is_continuation_from_checkpoint: bool = False,
    ):
        """
        :param optimizer: the optimizer whose groups' learning rates are scheduled
        :param num_epochs: epochs in the run; with ``num_update_steps_per_epoch`` this gives
            ``total_steps``
        :param num_update_steps_per_epoch: optimizer updates per epoch, per process
        :param total_steps: optimizer updates in the run, per process (instead of the two above)
        :param num_warmup_steps: warmup updates; ``None`` means 1% of ``total_steps``
        :param decay_phase_ratio: fraction of each checkpoint period spent decaying
        :param lr_min: the final learning rate as a fraction of each group's learning rate
        :param warmup_starting_lr: the learning rate at the first warmup update
        :param use_inverse_sqrt_decay: use the square-root decay instead of the paper's
            inverse-proportional one
        :param num_checkpoints: how many checkpoint periods to plan
        :param is_continuation_from_checkpoint: this run continues from a saved state
        """
        super().__init__(optimizer)

        if num_epochs is not None and num_update_steps_per_epoch is not None:
            if total_steps is not None:
                raise SchedulerConfigError(
                    "Pass either num_epochs and num_update_steps_per_epoch, or total_steps, "
                    "not all three."
                )
            total_steps = num_epochs * num_update_steps_per_epoch
        if total_steps is None or not total_steps > 0:
            raise SchedulerConfigError(
                "total_steps must be a positive number of updates; pass total_steps, or "
                f"num_epochs and num_update_steps_per_epoch (got total_steps={total_steps!r})."
            )
        if not 0 <= decay_phase_ratio <= 1:
            raise SchedulerConfigError(f"decay_phase_ratio must be between 0 and 1, got {decay_phase_ratio}.")
        if lr_min < 0:
            raise SchedulerConfigError(f"lr_min must be non-negative, got {lr_min}.")
        if num_checkpoints <= 0:
            raise SchedulerConfigError(f"num_checkpoints must be positive, got {num_checkpoints}.")
        if num_warmup_steps is None:
            num_warmup_steps = int(0.01 * total_steps)

        self.total_steps = total_steps
        self.num_warmup_steps = num_warmup_steps
        self.decay_phase_ratio = decay_phase_ratio
        self.lr_min = lr_min
        self.warmup_starting_lr = warmup_starting_lr
        self.use_inverse_sqrt_decay = use_inverse_sqrt_decay
        self.num_checkpoints = num_checkpoints
        self.checkpoint_steps = estimate_checkpoint_steps(total_steps, num_checkpoints)
        self.is_continuation_from_checkpoint = is_continuation_from_checkpoint
        self.previous_checkpoint_step = None

        if warmup_starting_lr > max(self.base_lr_values):
            raise SchedulerConfigError(
                f"warmup_starting_lr ({warmup_starting_lr}) exceeds the largest learning rate "
                f"of the optimizer's groups ({max(self.base_lr_values)}); lower it."
            )
        if num_checkpoints > 1:
            if decay_phase_ratio > _MAX_DECAY_RATIO_WITH_CHECKPOINTS:
                raise SchedulerConfigError(
                    f"decay_phase_ratio {decay_phase_ratio} is too large for {num_checkpoints} "
                    "checkpoints: decay phases could overlap. Use at most "
                    f"{_MAX_DECAY_RATIO_WITH_CHECKPOINTS:.2f}, or num_checkpoints=1."
                )
            self._check_checkpoints_increase()

        self.checkpoint_decay_info = self._calculate_decay_info()

    def _check_checkpoints_increase(self) -> None:
        previous = 0
        for step in self.checkpoint_steps:
            if step <= previous:
                raise SchedulerConfigError(
                    f"total_steps={self.total_steps} is too small for "
                    f"num_checkpoints={self.num_checkpoints}: checkpoints would fall at "
                    f"{self.checkpoint_steps}. Use at least 4 total steps, or num_checkpoints=1."
                )
            previous = step

    # --- checkpoint periods -------------------------------------------------------------

    def get_checkpoint_steps(self) -> List[int]:
        """Return the update counts at which checkpoint periods end."""
        return self.checkpoint_steps

    def _calculate_decay_info(self) -> List[dict]:
        info = []
        start = 0
        for end in self.checkpoint_steps:
            decay_steps = int((end - start) * self.decay_phase_ratio)
            info.append(
                {
                    "period_start": start,
                    "period_end": end,
                    "decay_steps": decay_steps,
                    "pre_decay_step": end - decay_steps,
                }
            )
            start = end
        return info

    def get_decay_info(self) -> List[dict]:
        """Return one dict per checkpoint period with ``period_start``, ``period_end``,
        ``decay_steps`` and ``pre_decay_step`` (the update count at which decay begins)."""
        return self.checkpoint_decay_info

    def get_phase_info(self, num_updates: int) -> dict:
        """Return the :meth:`get_decay_info` entry of the first period whose end is at or
        after ``num_updates`` (the last period past the end)."""
        for info in self.checkpoint_decay_info:
            if info["period_end"] >= num_updates:
                return info
        return self.checkpoint_decay_info[-1]

    def get_current_step(self) -> int:
        """Return the update count of the last :meth:`step` (-1 before the first)."""
        return self._num_updates

    def get_current_phase_info(self) -> dict:
        """Return :meth:`get_phase_info` for the current update count."""
        return self.get_phase_info(self._num_updates)

    def _period_position(self, num_updates: int) -> Tuple[int, int]:
        """Return (period length, updates into the period) for ``num_updates``.

        From the last checkpoint on, the first period is used with the full count, which puts
        the position past that period's decay: the learning rate stays at its minimum.
        """
        checkpoints = self.checkpoint_steps
        index = next((i for i, end in enumerate(checkpoints) if num_updates < end), 0)
        start = 0 if index == 0 else checkpoints[index - 1]
        return checkpoints[index] - start, num_updates - start

    def _get_checkpoint_info(self, num_updates: int) -> Tuple[int, int]:
        """pytorch-accelerated's name for :meth:`_period_position`, which its users' tests call."""
        return self._period_position(num_updates)

    # pytorch-accelerated memoised this method with ``lru_cache`` and its callers clear that
    # cache; fasttrain caches nothing (a loaded state changes the checkpoints), so clearing has
    # nothing to do
    _get_checkpoint_info.cache_clear = lambda: None

    # --- values --------------------------------------------------------------------------

    def get_updated_values(self, num_updates: int) -> List[float]:
        """Return each group's learning rate after ``num_updates`` completed updates."""
        if not self.is_continuation_from_checkpoint and num_updates < self.num_warmup_steps:
            start = self.warmup_starting_lr
            fraction = num_updates / self.num_warmup_steps
            return [start + fraction * (lr - start) for lr in self.base_lr_values]

        period_length, position = self._period_position(num_updates)
        decay_steps = int(period_length * self.decay_phase_ratio)
        decay_start = period_length - decay_steps

        if position < decay_start:
            if not self.is_continuation_from_checkpoint and position == decay_start - 1:
                self.previous_checkpoint_step = num_updates
            return self.base_lr_values

        if decay_steps == 0:
            # Only reachable past the final checkpoint when no decay was planned; the schedule
            # is over, so hold the minimum instead of dividing by zero.
            progress = 1.0
        else:
            progress = min((position - decay_start) / decay_steps, 1.0)
        return [lr * self._decay_factor(progress) for lr in self.base_lr_values]

    def _decay_factor(self, progress: float) -> float:
        if self.use_inverse_sqrt_decay:
            return self.lr_min + (1 - self.lr_min) * (1 - math.sqrt(progress))
        if self.lr_min == 0:
            return 1.0 if progress == 0 else 0.0
        return 1 / (progress * (1.0 / self.lr_min) + (1.0 - progress) * 1.0)

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Return the public attributes (plain Python values) and the update count."""
        state = {
            key: value
            for key, value in self.__dict__.items()
            if key != "optimizer" and not key.startswith("_")
        }
        state["num_updates"] = self._num_updates
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a saved state.

        In a continuation run the new ``total_steps`` is kept, checkpoints are planned anew for
        it and the update count is not restored, so a fresh stable phase begins. Otherwise the
        update count is restored too, so a resumed run continues the schedule where it stopped.
        Note that the saved ``is_continuation_from_checkpoint`` is taken over, as
        pytorch-accelerated does: a state saved by a first run turns warmup back on.
        """
        state = dict(state_dict)
        num_updates: Optional[int] = state.pop("num_updates", None)
        if self.is_continuation_from_checkpoint:
            new_total_steps = self.total_steps
            self.__dict__.update(state)
            self.total_steps = new_total_steps
            self.previous_checkpoint_step = None
            self.checkpoint_steps = estimate_checkpoint_steps(
                self.total_steps, self.num_checkpoints
            )
            self.checkpoint_decay_info = self._calculate_decay_info()
        else:
            self.__dict__.update(state)
            if num_updates is not None:
                self._num_updates = num_updates

    @classmethod
    def create_scheduler_fn(
        cls,
        total_num_epochs: int = TrainerPlaceholderValues.NUM_EPOCHS,
        num_update_steps_per_epoch: int = TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH,
        num_warmup_epochs: int = None,
        decay_phase_ratio: float = 0.1,
        lr_min: float = 1e-6,
        warmup_starting_lr: float = 1e-6,
        use_inverse_sqrt_decay: bool = True,
        num_checkpoints: int = 1,
        is_continuation_from_checkpoint: bool = False,
    ) -> Callable:
        """Return a factory ``fn(optimizer) -> WSDLrScheduler`` for ``Trainer.train``.

        Epochs and per-process updates per epoch default to placeholders the trainer fills in.
        ``num_warmup_epochs`` becomes ``PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH * epochs``
        warmup updates; ``None`` gives 1% of the total.
        """
        if num_warmup_epochs is not None:
            num_warmup_steps = (
                TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH * num_warmup_epochs
            )
        else:
            num_warmup_steps = None
        return partial(
            cls,
            num_epochs=total_num_epochs,
            num_update_steps_per_epoch=num_update_steps_per_epoch,
            num_warmup_steps=num_warmup_steps,
            decay_phase_ratio=decay_phase_ratio,
            lr_min=lr_min,
            warmup_starting_lr=warmup_starting_lr,
            use_inverse_sqrt_decay=use_inverse_sqrt_decay,
            num_checkpoints=num_checkpoints,
            is_continuation_from_checkpoint=is_continuation_from_checkpoint,
        )
