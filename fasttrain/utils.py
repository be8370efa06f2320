"""Small utilities: batch limiting, per-process decorators, model EMA, padding removal."""

from __future__ import annotations

import itertools
import os
from copy import deepcopy
from functools import wraps

import torch
from accelerate.state import PartialState
from accelerate.utils import wait_for_everyone
from torch import Tensor, nn

__all__ = [
    "LIMIT_BATCHES_ENV_VAR",
    "LimitBatches",
    "DataLoaderSlice",
    "local_process_zero_only",
    "local_process_zero_first",
    "world_process_zero_only",
    "ModelEma",
    "worker_init_fn",
    "remove_padding",
]

LIMIT_BATCHES_ENV_VAR = "PT_ACC_LIMIT_BATCHES"


class LimitBatches:
    """Context manager under which newly created trainers use only ``num_batches`` batches
    per epoch (they add ``LimitBatchesCallback``), for quick end-to-end checks.

    It sets the environment variable ``PT_ACC_LIMIT_BATCHES``, which the trainer also honours
    when set from outside, and restores the variable's previous state on exit.
    """

    def __init__(self, num_batches: int):
        self.num_batches = num_batches
        self._previous = None

    def __enter__(self):
        self._previous = os.environ.get(LIMIT_BATCHES_ENV_VAR)
        os.environ[LIMIT_BATCHES_ENV_VAR] = str(self.num_batches)
        return self

    def __exit__(self, exc_type, exc_value, exc_traceback):
        if self._previous is None:
            os.environ.pop(LIMIT_BATCHES_ENV_VAR, None)
        else:
            os.environ[LIMIT_BATCHES_ENV_VAR] = self._previous


class DataLoaderSlice:
    """Iterates over the first ``slice_size`` batches of a dataloader.

    ``len()`` is ``slice_size``, as in pytorch-accelerated, even when the dataloader is shorter.
    """

    def __init__(self, dl, slice_size: int):
        self.dl = dl
        self.slice_size = slice_size

    def __iter__(self):
        return itertools.islice(self.dl, self.slice_size)

    def __len__(self):
        return self.slice_size

    def __getattr__(self, name):
        # the sliced loader's other attributes (device, batch_size, dataset), so that code
        # reading them works while a batch limit is in place
        return getattr(self.__dict__["dl"], name)


def _process_zero_only(func, index: str):
    """``func`` run only on the process whose ``PartialState().<index>`` is 0, the others
    returning ``None``; every process then waits at a barrier."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        result = None
        if getattr(PartialState(), index) == 0:
            result = func(*args, **kwargs)
        wait_for_everyone()
        return result

    return wrapper


def local_process_zero_only(func):
    """Run ``func`` only on the first process of each node; the others return ``None``.

    All processes wait for each other afterwards, so every process must call the function.
    """
    return _process_zero_only(func, "local_process_index")


def local_process_zero_first(func):
    """Run ``func`` on the first process of each node, then on the others (for example to
    download a dataset once per node before the other processes read it)."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        is_first = PartialState().local_process_index == 0
        result = func(*args, **kwargs) if is_first else None
        wait_for_everyone()
        if not is_first:
            result = func(*args, **kwargs)
        return result

    return wrapper


def world_process_zero_only(func):
    """Run ``func`` only on the first process of all; the others return ``None``.

    All processes wait for each other afterwards, so every process must call the function.
    """
    return _process_zero_only(func, "process_index")


class ModelEma(nn.Module):
    """An exponential moving average of a model's state (parameters and buffers).

    After each :meth:`update`, every entry ``e`` of the copy's state dict becomes
    ``decay * e + (1 - decay) * m`` for the model's matching entry ``m`` (entries are matched
    by position, so a model wrapped by DDP or ``torch.compile`` works). Integer buffers, such
    as batch norm's ``num_batches_tracked``, get the same formula truncated to an integer.

    The averaged model is :attr:`module`, kept in eval mode without gradients. Create it before
    converting batch norms to ``SyncBatchNorm`` and before wrapping the model for distribution.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999):
        """
        :param model: the model being trained; it is deep-copied
        :param decay: the weight kept by the average at each update, typically 0.999 to 0.9999
        """
        super().__init__()
        self.module = deepcopy(model)
        for param in self.module.parameters():
            param.requires_grad_(False)
        self.module.eval()
        self.decay = decay

    def update_fn(self, ema_model_weights, updated_model_weights):
        """Return the averaged value of one state entry."""
        return self.decay * ema_model_weights + (1.0 - self.decay) * updated_model_weights

    def _pairs(self, model: nn.Module):
        ema_values = list(self.module.state_dict().values())
        model_values = list(model.state_dict().values())
        if len(ema_values) != len(model_values):
            raise ValueError(
                f"The model has {len(model_values)} state entries but the average has "
                f"{len(ema_values)}; update ModelEma with the model it was created from."
            )
        return zip(ema_values, model_values)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s current state."""
        if type(self).update_fn is not ModelEma.update_fn:
            # A subclass changed the formula: apply it entry by entry.
            for ema_value, model_value in self._pairs(model):
                ema_value.copy_(self.update_fn(ema_value, model_value))
            return
        floats, float_sources = [], []
        for ema_value, model_value in self._pairs(model):
            if ema_value.is_floating_point() and ema_value.dtype == model_value.dtype:
                floats.append(ema_value)
                float_sources.append(model_value.to(ema_value.device, non_blocking=True))
            else:
                ema_value.copy_(self.update_fn(ema_value, model_value))
        if floats:
            # One fused pass over all floating-point entries instead of three kernels each.
            torch._foreach_mul_(floats, self.decay)
            torch._foreach_add_(floats, float_sources, alpha=1.0 - self.decay)

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Copy ``model``'s current state into the average."""
        for ema_value, model_value in self._pairs(model):
            ema_value.copy_(model_value)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def worker_init_fn(worker_id: int) -> int:
    """Dataloader worker initialiser that reseeds torch from fresh entropy in each worker,
    rather than from the run's initial seed, and returns that seed plus ``worker_id``."""
    return torch.seed() + worker_id


def remove_padding(padded_tensor: Tensor, pad_value) -> Tensor:
    """Drop the entries along the first dimension that consist only of ``pad_value``.

    For a 1-d tensor these are the padding elements; for more dimensions, the rows (or
    sub-tensors) in which every value equals ``pad_value``. Useful after gathering padded
    tensors from several processes.
    """
    is_padding = padded_tensor == pad_value
    while is_padding.ndim > 1:
        is_padding = is_padding.all(dim=-1)
    return padded_tensor[~is_padding, ...]
