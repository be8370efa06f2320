"""A Python number that ``self.log`` gets inside a compiled step is kept as it is until the step
has run.

``LightningModule.log`` turns a number into a tensor (``torch.tensor(value, device=...)``) before
it reaches the trainer's result store. Traced by dynamo, that turns a number that changes at every
step (a learning rate read from ``self.lr_schedulers().get_last_lr()``, a float computed from the
step) into a constant of the compiled code: dynamo specializes a symbolic float that is given to
``torch.tensor``, so the step compiled once per value and, at the recompile limit, ran eagerly.

Inside a step that a fasttrain trainer compiles, the conversion is left out: the number goes to
the result store as it is (the store only records the call while the step is traced, results.py),
dynamo hands it back as a Python number after the graph, and the store makes Lightning's tensor
of it when it files the call (``ResultStore.drain``), eagerly. Everywhere else (an eager step,
Lightning's own Trainer, a tensor value) ``LightningModule``'s conversion runs unchanged.
"""

from __future__ import annotations

import numbers

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.connectors.logger_connector.result import _get_default_dtype

__all__ = ["install", "as_logged_tensor"]

_ORIGINAL = None


def _to_tensor(self, value, name):
    if torch.compiler.is_compiling() and isinstance(value, numbers.Number) and _fasttrain_step(self):
        return value
    return _ORIGINAL(self, value, name)


def _fasttrain_step(module) -> bool:
    from fasttrain.lightning.trainer import Trainer

    return isinstance(module.__dict__.get("_trainer"), Trainer)


#: LightningModule's private conversion that :func:`install` replaces (Lightning 2.6's name)
_CONVERSION = "_LightningModule__to_tensor"


def install() -> bool:
    """Put the conversion above in ``LightningModule``'s place (once per process). Returns
    whether it is in place: a Lightning without that private method keeps its own conversion,
    and a number logged in a compiled step is then a constant of the step (the step compiles
    again when it changes; the values logged are right either way)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        original = LightningModule.__dict__.get(_CONVERSION)
        if not callable(original):
            return False
        _ORIGINAL = original
        setattr(LightningModule, _CONVERSION, _to_tensor)
    return True


def as_logged_tensor(value, device):
    """The tensor ``LightningModule.log`` makes of ``value`` on ``device``."""
    return torch.tensor(value, device=device, dtype=_get_default_dtype())
