"""The read-only description of a training run that the trainer exposes as ``run_config``."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from numbers import Number
from typing import Union

import torch

__all__ = ["TrainerRunConfig"]

# Dataloader arguments returned by to_dict() as the same objects: a sampler may reference the
# whole dataset, and a copied generator would no longer advance with the one the run uses.
_SHARED_DATALOADER_KEYS = ("sampler", "batch_sampler", "generator")


def _copy_dataloader_kwargs(kwargs):
    if not isinstance(kwargs, dict):
        return copy.deepcopy(kwargs)
    return {
        key: value
        if key in _SHARED_DATALOADER_KEYS or isinstance(value, torch.Generator)
        else copy.deepcopy(value)
        for key, value in kwargs.items()
    }


@dataclass(frozen=True)
class TrainerRunConfig:
    """The settings of the current training run, fixed when ``Trainer.train`` starts.

    :param num_epochs: epochs in the run
    :param train_per_device_batch_size: training batch size on each device
    :param train_dl_kwargs: the arguments the training dataloader was created with
    :param eval_per_device_batch_size: evaluation batch size on each device
    :param eval_dl_kwargs: the arguments the evaluation dataloader was created with
    :param gradient_accumulation_steps: micro-batches per optimizer update
    :param gradient_clip_value: the gradient clipping threshold, or ``None``
    :param train_total_batch_size: training samples per update step over all processes
    :param eval_total_batch_size: evaluation samples per step over all processes
    :param num_update_steps_per_epoch: optimizer updates per epoch
    :param num_local_update_steps_per_epoch: optimizer updates per epoch on each process
    :param max_num_train_steps: the update limit that overrides ``num_epochs``, or ``None``
    :param is_local_process_zero: this is the first process on its node
    :param is_world_process_zero: this is the first process of all
    :param is_distributed: more than one process takes part
    :param mixed_precision: the mixed precision mode (``"no"``, ``"fp16"``, ``"bf16"``, ...)
    :param num_processes: the number of processes
    """

    num_epochs: int
    train_per_device_batch_size: int
    train_dl_kwargs: dict
    eval_per_device_batch_size: int
    eval_dl_kwargs: dict
    gradient_accumulation_steps: int
    gradient_clip_value: Union[Number, None]
    train_total_batch_size: int
    eval_total_batch_size: int
    num_update_steps_per_epoch: int
    num_local_update_steps_per_epoch: int
    max_num_train_steps: Union[int, None]
    is_local_process_zero: bool
    is_world_process_zero: bool
    is_distributed: bool
    mixed_precision: str
    num_processes: int

    def to_dict(self) -> dict:
        """Return the fields as a dict, in declaration order.

        Values are deep copies, except samplers, batch samplers and generators in the
        dataloader arguments, which are returned as the same objects. The config itself is
        left unchanged.
        """
        result = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in ("train_dl_kwargs", "eval_dl_kwargs"):
                result[field.name] = _copy_dataloader_kwargs(value)
            else:
                result[field.name] = copy.deepcopy(value)
        return result
