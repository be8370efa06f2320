"""Lightning's ``LearningRateMonitor`` over the compiled engines' tensor learning rates.

The compiled and graphed engines hold ``param_group["lr"]`` as a device tensor written in place
(fasttrain/engine/hyperparams.py). ``LearningRateMonitor`` appends ``param_group["lr"]`` itself to
its ``lrs`` lists, so every entry would be that one tensor, showing the latest rate. During a fit
each appended tensor is replaced by a copy of its value at that step (a device copy, no host read),
and when the fit ends the copies become floats, as Lightning's lists hold, in one read.
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.callbacks import LearningRateMonitor


def _extract_lr_keeping_values(original):
    def extract(self, param_group, name):
        stats = original(self, param_group, name)
        kept = self.lrs.get(name)
        if kept and isinstance(kept[-1], torch.Tensor):
            kept[-1] = kept[-1].detach().clone()  # the group's tensor changes at the next step
        return stats

    extract.fasttrain_original = original
    return extract


@contextlib.contextmanager
def monitors_keep_values(lt):
    """For the duration of a fit of ``lt`` (fasttrain.lightning's Trainer)."""
    original = LearningRateMonitor._extract_lr
    if getattr(original, "fasttrain_original", None) is not None:  # a fit inside a fit
        yield
        return
    LearningRateMonitor._extract_lr = _extract_lr_keeping_values(original)
    try:
        yield
    finally:
        LearningRateMonitor._extract_lr = original
        for callback in lt.callbacks:
            if isinstance(callback, LearningRateMonitor):
                _as_floats(callback)


def _as_floats(monitor: LearningRateMonitor) -> None:
    copies = [value for values in monitor.lrs.values() for value in values if isinstance(value, torch.Tensor)]
    if not copies:
        return
    device = copies[0].device
    # SYNC(stop): once, as a fit ends: the monitor's lists hold floats, as under Lightning
    floats = iter(torch.stack([value.float().reshape(()).to(device) for value in copies]).tolist())
    for name, values in monitor.lrs.items():
        monitor.lrs[name] = [next(floats) if isinstance(value, torch.Tensor) else value for value in values]
