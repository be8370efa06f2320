"""Argument and input checks whose errors say what to change.

Everything here runs once per ``Trainer`` or ``train()`` call, except :func:`train_loss`, which
runs every micro-step and therefore only reads host attributes of the loss tensor (type, element
count, ``requires_grad``): O(1), no device synchronisation, nothing for ``torch.compile`` to guard
on beyond what it already specialises on.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import torch

RESUME_DATA_SKIP = ("sampler", "replay")


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number (or None to disable), got {value!r}")


def one_of(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def engine_name(value) -> None:
    from fasttrain.engine import ENGINES  # the engines' owner; imported when a Trainer is built

    one_of("engine", value, ("auto", *ENGINES))


def compile_options(options, engine: str) -> None:
    """``Trainer(compile_options=...)`` for ``engine``: unknown keys, bad values and modes the
    engine cannot run with fail at construction, not when ``train()`` sets the engine up."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"compile_options must be a dict of torch.compile arguments; got {type(options).__name__}")
    from fasttrain.engine.compiled_functions import CompileSettings, settings_for_engine

    settings_for_engine(CompileSettings.from_options(options), engine)


def trainer_options(*, nonfinite, interrupt_save_dir, handle_signals, resume_data_skip) -> None:
    """The reliability options of ``Trainer.__init__``."""
    from fasttrain.nonfinite import POLICIES  # the policies' owner

    one_of("nonfinite", nonfinite, POLICIES)
    one_of("resume_data_skip", resume_data_skip, RESUME_DATA_SKIP)
    if interrupt_save_dir is not None and not isinstance(interrupt_save_dir, (str, os.PathLike)):
        raise TypeError(
            "interrupt_save_dir must be a directory path (str or pathlib.Path) or None, got "
            f"{type(interrupt_save_dir).__name__}"
        )
    if not isinstance(handle_signals, bool):
        raise TypeError(f"handle_signals must be True or False, got {handle_signals!r}")


def accelerator_kwargs(kwargs, mixed_precision) -> dict:
    """``Trainer(accelerator_kwargs=...)``: a dict of keyword arguments for ``Accelerator``."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TypeError(
            "accelerator_kwargs must be a dict of keyword arguments for accelerate's Accelerator, "
            f"e.g. {{'fsdp_plugin': FullyShardedDataParallelPlugin(fsdp_version=2)}}, not {type(kwargs).__name__}"
        )
    if "mixed_precision" in kwargs:
        raise ValueError(
            "pass mixed precision as Trainer(mixed_precision=...), not inside accelerator_kwargs"
            + (f" (mixed_precision={mixed_precision!r} is also given)" if mixed_precision is not None else "")
        )
    return dict(kwargs)


def ready_accelerator(accelerator, kwargs, mixed_precision):
    """``Trainer(accelerator=...)``: an ``Accelerator`` that replaces the ones fasttrain would
    build, so it cannot come with settings for those."""
    if accelerator is None:
        return None
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator (or None), not {type(accelerator).__name__}"
        )
    given = [name for name, value in (("accelerator_kwargs", kwargs), ("mixed_precision", mixed_precision)) if value]
    if given:
        raise ValueError(
            f"Trainer(accelerator=...) is used as it is, so {' and '.join(given)} would be ignored: "
            "build the Accelerator with those settings (Accelerator(mixed_precision=..., fsdp_plugin=...)), "
            "or drop accelerator= and let the Trainer build one from them."
        )
    return accelerator


def ddp_options(model, gradient_accumulation_steps: int) -> None:
    """DDP options that cannot train with the run's settings, refused before the first step."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    if getattr(model, "static_graph", False) and gradient_accumulation_steps > 1:
        raise ValueError(
            "DistributedDataParallelKwargs(static_graph=True) cannot train with "
            f"gradient_accumulation_steps={gradient_accumulation_steps}: DDP records its static graph "
            "in the first iteration, which then runs under no_sync, and its reducer fails an internal "
            "assertion in that iteration's backward. Drop static_graph=True, or use "
            "gradient_accumulation_steps=1 with a larger per_device_batch_size."
        )


def _dataset_length(dataset):
    try:
        return len(dataset)
    except TypeError:  # an iterable dataset without a length
        return None


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
    eval_dataset=None,
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
    if _dataset_length(train_dataset) == 0:
        raise ValueError("The train dataset is empty; give it at least one sample.")
    if eval_dataset is not None and _dataset_length(eval_dataset) == 0:
        raise ValueError("The eval dataset is empty; give it at least one sample or pass eval_dataset=None.")
    scheduler_factory(create_scheduler_fn)


def scheduler_factory(create_scheduler_fn) -> None:
    if create_scheduler_fn is None:
        return
    from fasttrain.placeholders import is_placeholder

    if is_placeholder(create_scheduler_fn):
        raise ValueError(
            f"create_scheduler_fn is the placeholder {create_scheduler_fn!r}, not a factory. Pass "
            "placeholders as keyword arguments of functools.partial, e.g. partial(MyScheduler, "
            "total_num_epochs=TrainerPlaceholderValues.NUM_EPOCHS)."
        )
    if not callable(create_scheduler_fn):
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
        size = _dataset_length(dataset) if dataset is not None else None
        if size == 0:
            raise ValueError(f"The {kind} dataset is empty; give it at least one sample.")
        raise ValueError(
            f"The {kind} dataloader yields no batches (dataset of {size} samples, batch size "
            f"{batch_size}, drop_last=True?); lower the batch size or set drop_last=False."
        )


# ------------------------------------------------------------------------------- per step
def train_loss(batch_output):
    """The ``loss`` of ``calculate_train_batch_loss``'s output, checked so that a mistake gets
    an error naming the fix before ``backward`` fails with a less helpful one."""
    if not isinstance(batch_output, (dict, Mapping)):  # dict first: the common case, fastest
        raise _missing_loss(batch_output)
    try:
        loss = batch_output["loss"]
    except KeyError:
        raise _missing_loss(batch_output) from None
    # the exact type first: isinstance against torch.Tensor goes through its metaclass, which
    # costs more than the rest of this check
    is_tensor = type(loss) is torch.Tensor or isinstance(loss, torch.Tensor)
    if not is_tensor or loss.numel() != 1 or not loss.requires_grad:
        _bad_loss(loss)
    return loss


def _missing_loss(batch_output) -> ValueError:
    keys = f" with keys {sorted(map(str, batch_output))}" if isinstance(batch_output, dict) else ""
    return ValueError(
        "calculate_train_batch_loss must return a dict with a 'loss' entry (a scalar tensor), "
        "plus 'model_outputs' and 'batch_size'; got "
        f"{type(batch_output).__name__}{keys}. Return e.g. {{'loss': loss, 'model_outputs': "
        "outputs, 'batch_size': targets.size(0)}."
    )


def _bad_loss(loss):
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "The 'loss' returned by calculate_train_batch_loss must be a tensor connected to the "
            f"model's parameters, got {type(loss).__name__} ({loss!r}). Return the loss tensor "
            "itself, not loss.item() or a number."
        )
    if loss.numel() != 1:
        raise ValueError(
            "The 'loss' returned by calculate_train_batch_loss must be a scalar, got a tensor of "
            f"shape {tuple(loss.shape)}. Reduce it first, e.g. loss.mean() (or use a loss function "
            "with reduction='mean'), so that backward has one value to differentiate."
        )
    raise ValueError(
        "The 'loss' returned by calculate_train_batch_loss does not require grad, so backward "
        "cannot compute gradients: the model's parameters are frozen (requires_grad=False) or the "
        "loss was detached from them (.detach(), .item(), a new tensor, or computed under "
        "torch.no_grad()/inference_mode). Unfreeze at least one parameter and compute the loss "
        "from the model's outputs."
    )


def apply_model_transforms(model, activation_checkpointing, compile_regions, compile_options):
    """``model`` with the Trainer's activation checkpointing and regional compilation applied,
    in place and in that order (a compiled block then contains the recomputation)."""
    if activation_checkpointing is not None:
        from fasttrain.checkpoint_activations import apply_activation_checkpointing

        apply_activation_checkpointing(model, activation_checkpointing)
    if compile_regions is None or compile_regions is False:
        return model
    # the blocks run compiled one by one, under engine="eager" and as graph breaks inside the
    # compiled engines' trace of the whole step
    from fasttrain.engine.compiled_functions import CompileSettings
    from fasttrain.regional import compile_regions as compile_blocks

    kwargs = CompileSettings.from_options(compile_options).kwargs()
    compile_blocks(model, None if compile_regions is True else compile_regions, **kwargs)
    return model
