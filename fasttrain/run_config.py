"""The read-only description of a training run that the trainer exposes as ``run_config``."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from numbers import Number
from typing import Union

import torch
from accelerate.utils import DistributedType

__all__ = ["TrainerRunConfig", "build_run_config", "uneven_eval_batches_message"]

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


def build_run_config(
    accelerator,
    *,
    train_dataloader,
    train_dl_kwargs,
    eval_dl_kwargs,
    per_device_batch_size,
    num_epochs,
    gradient_accumulation_steps,
    max_num_train_steps,
    gradient_clip_value,
) -> TrainerRunConfig:
    """The run config of a run prepared by ``accelerator`` (pytorch-accelerated's formulas;
    ``max_num_train_steps`` counts the optimizer updates of any one process)."""
    train_bs = (train_dl_kwargs or {}).get("batch_size", per_device_batch_size)
    eval_bs = (eval_dl_kwargs or {}).get("batch_size", train_bs) if eval_dl_kwargs else train_bs
    processes = accelerator.num_processes
    try:
        local_batches = len(train_dataloader) if train_dataloader is not None else 0
    except TypeError:  # an iterable without a length: the updates of an epoch are unknown
        if max_num_train_steps is None:
            raise TypeError(
                "the training dataloader has no length (an IterableDataset?), so the run's length is unknown; "
                "give the dataset a __len__, or bound the run with max_num_train_steps"
            ) from None
        local_batches = 0
    updates_per_epoch = math.ceil(local_batches * processes / gradient_accumulation_steps)
    local_updates_per_epoch = math.ceil(local_batches / gradient_accumulation_steps)
    if max_num_train_steps is None:
        # one more than the run can reach, so the limit never ends an epoch early
        max_num_train_steps = num_epochs * updates_per_epoch + 1
    elif local_updates_per_epoch > 0:
        # every process performs the same optimizer updates, so max_num_train_steps counts
        # updates of any one process
        num_epochs = math.ceil(max_num_train_steps / local_updates_per_epoch)
    return TrainerRunConfig(
        num_epochs=num_epochs,
        train_per_device_batch_size=train_bs,
        train_dl_kwargs=train_dl_kwargs,
        eval_per_device_batch_size=eval_bs,
        eval_dl_kwargs=eval_dl_kwargs,
        gradient_accumulation_steps=gradient_accumulation_steps,
        gradient_clip_value=gradient_clip_value,
        train_total_batch_size=train_bs * processes * gradient_accumulation_steps,
        eval_total_batch_size=eval_bs * processes,
        num_update_steps_per_epoch=updates_per_epoch,
        num_local_update_steps_per_epoch=local_updates_per_epoch,
        max_num_train_steps=max_num_train_steps,
        is_local_process_zero=accelerator.is_local_main_process,
        is_world_process_zero=accelerator.is_main_process,
        is_distributed=accelerator.distributed_type != DistributedType.NO,
        mixed_precision=accelerator.mixed_precision,
        num_processes=processes,
    )


def uneven_eval_batches_message(dataset_size: int, per_device_batch_size: int, num_processes: int):
    """Why a per-step ``Trainer.gather`` could wait forever in a distributed evaluation whose
    last batches are not padded, or None when every process gets an equal last batch.

    Evaluation batches go to the processes in turn. When the dataset does not fill the last
    round, either some process gets no batch in it (and a ``gather`` the others call in that
    step waits for it forever), or one process gets a smaller batch than the others (and a
    ``gather`` of per-sample tensors needs ``padding_value``).
    """
    total = per_device_batch_size * num_processes
    left_over = dataset_size % total
    if left_over == 0:
        return None
    # the fewest samples in the last round for which every process still gets a batch
    all_processes_served = per_device_batch_size * (num_processes - 1) + 1
    where = (
        f"per_device_batch_size={per_device_batch_size} with an evaluation dataset of "
        f"{dataset_size} samples on {num_processes} processes"
    )
    if left_over < all_processes_served:
        return (
            f"{where} leaves at least one process without a batch in the last evaluation step: "
            "a Trainer.gather called in that step (an on_eval_step_end callback) waits forever "
            "for it. Choose a batch size that divides the dataset size by the number of "
            "processes, or gather only at the end of the epoch."
        )
    return (
        f"{where} gives one process a smaller last evaluation batch than the others: a "
        "Trainer.gather of per-sample tensors in that step fails or waits forever unless it is passed "
        "a padding_value (trainer.gather(tensor, padding_value=...)), which pads and then "
        "removes the padding."
    )
