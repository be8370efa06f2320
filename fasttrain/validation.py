"""Argument checks whose errors say what to change."""

from __future__ import annotations

import numbers

ENGINE_NAMES = ("auto", "eager", "compiled", "cudagraph")


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number (or None to disable), got {value!r}")


def engine_name(value) -> None:
    if value not in ENGINE_NAMES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINE_NAMES))}; got {value!r}")


def train_arguments(
    *,
    train_dataset,
    num_epochs,
    per_device_batch_size,
    max_num_train_steps,
    gradient_accumulation_steps,
    gradient_clip_value,
    gradient_clip_norm,
    create_scheduler_fn,
) -> None:
    if train_dataset is None:
        raise ValueError("train() needs a train_dataset")
    if max_num_train_steps is None:
        positive_int("num_epochs", num_epochs)
    else:
        positive_int("max_num_train_steps", max_num_train_steps)
    positive_int("per_device_batch_size", per_device_batch_size)
    positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    if gradient_clip_value is not None:
        positive_number("gradient_clip_value", gradient_clip_value)
    if gradient_clip_norm is not None:
        positive_number("gradient_clip_norm", gradient_clip_norm)
    if create_scheduler_fn is not None and not callable(create_scheduler_fn):
        raise TypeError(
            "create_scheduler_fn must be a callable that takes the optimizer and returns a "
            f"scheduler (e.g. functools.partial(OneCycleLR, max_lr=...)); got "
            f"{type(create_scheduler_fn).__name__}. Pass a factory, not a scheduler instance."
        )


def dataloader_not_empty(dataloader, kind: str, batch_size: int) -> None:
    try:
        length = len(dataloader)
    except TypeError:  # an iterable dataset without a length
        return
    if length == 0:
        dataset = getattr(dataloader, "dataset", None)
        size = None
        try:
            size = len(dataset) if dataset is not None else None
        except TypeError:
            pass
        if size == 0:
            raise ValueError(f"The {kind} dataset is empty; give it at least one sample.")
        raise ValueError(
            f"The {kind} dataloader yields no batches (dataset of {size} samples, batch size "
            f"{batch_size}, drop_last=True?); lower the batch size or set drop_last=False."
        )
