"""Base classes for schedulers that set an optimizer field once per optimizer update.

Values are written with :func:`set_param_group_value`: when a parameter group holds its learning
rate as a tensor (what compiled and CUDA-graphed optimizer steps need, so that a new value does not
trigger a recompile or a re-capture), the tensor is overwritten in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Number
from typing import Iterable, Union

import torch

__all__ = ["SchedulerBase", "StatefulSchedulerBase", "SchedulerConfigError", "set_param_group_value"]


class SchedulerConfigError(ValueError, AssertionError):
    """A scheduler's arguments do not describe a valid schedule.

    A ``ValueError`` (what the problem is), and also an ``AssertionError``: pytorch-accelerated
    checks these arguments with ``assert``, so code written for it catches ``AssertionError``.
    """


def set_param_group_value(group: dict, field: str, value) -> None:
    """Store ``value`` under ``field`` in an optimizer parameter group.

    A tensor already stored there is filled in place, so that compiled code and captured CUDA
    graphs holding that tensor see the new value. The tensor is only written, never read: this
    does not synchronise the host with the device.
    """
    current = group.get(field)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        group[field] = value


def _as_float(value) -> float:
    if isinstance(value, torch.Tensor):
        # SYNC(setup): once per scheduler; the schedule's arithmetic is done on the host
        return float(value.detach().cpu())
    return value


class SchedulerBase(ABC):
    """Sets a field of every optimizer parameter group (``"lr"`` by default) from the number of
    optimizer updates completed, which the caller passes to :meth:`step_update`.

    Call it after each optimizer update, not per epoch::

        num_updates = 0
        for batch in dataloader:
            loss_func(model(batch[0]), batch[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            scheduler.step_update(num_updates)

    On construction, each group's starting value is kept as ``initial_<field>`` in the group
    (an existing entry is kept, so a second scheduler on the same optimizer starts from the
    original values) and written back to the field.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_group_field: str = "lr"):
        """
        :param optimizer: the optimizer whose parameter groups are scheduled
        :param param_group_field: the parameter-group key to schedule
        """
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        for index, group in enumerate(optimizer.param_groups):
            if param_group_field not in group:
                raise KeyError(
                    f"param_groups[{index}] has no {param_group_field!r} entry; pass the name "
                    "of an existing field as param_group_field."
                )
            if self._initial_param_group_field not in group:
                group[self._initial_param_group_field] = _as_float(group[param_group_field])
        self.base_lr_values = [
            _as_float(group[self._initial_param_group_field]) for group in optimizer.param_groups
        ]
        self._update_param_groups(self.base_lr_values)

    @abstractmethod
    def get_updated_values(self, num_updates: int) -> Union[None, Number, Iterable[Number]]:
        """Return the value(s) for the given number of completed updates.

        Return one number to give every parameter group the same value, a list or tuple with
        one value per group, or ``None`` to leave the groups unchanged.
        """

    def step_update(self, num_updates: int) -> None:
        """Write the values for ``num_updates`` into the optimizer's parameter groups."""
        values = self.get_updated_values(num_updates)
        if values is not None:
            self._update_param_groups(values)

    def _update_param_groups(self, values) -> None:
        groups = self.optimizer.param_groups
        if not isinstance(values, (list, tuple)):
            values = [values] * len(groups)
        for group, value in zip(groups, values):
            set_param_group_value(group, self.param_group_field, value)

    def state_dict(self) -> dict:
        """Return every attribute except the optimizer, which is saved on its own."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore attributes saved by :meth:`state_dict`."""
        self.__dict__.update(state_dict)


class StatefulSchedulerBase(SchedulerBase, ABC):
    """A scheduler that counts updates itself: call :meth:`step` once after each optimizer update.

    The count starts at -1, so the first ``step()`` applies the values for 0 completed updates,
    the second those for 1, and so on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_group_field: str = "lr"):
        super().__init__(optimizer=optimizer, param_group_field=param_group_field)
        self._num_updates = -1

    def step(self) -> None:
        """Advance the update count by one and write the values for the new count."""
        self._num_updates += 1
        self.step_update(self._num_updates)

    @abstractmethod
    def state_dict(self) -> dict:
        raise NotImplementedError

    @abstractmethod
    def load_state_dict(self, scheduler_state_dict: dict) -> None:
        # the parameter's name is part of the API: callers may pass it by keyword
        raise NotImplementedError
