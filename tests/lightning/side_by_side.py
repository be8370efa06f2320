"""Running one module under lightning.Trainer and fasttrain.lightning.Trainer from the same seed,
for the tests that compare what each trainer does (hooks called, logged values, errors)."""

from __future__ import annotations

import warnings

import lightning as L
import torch

from lightning_modules import QUIET


def trainers():
    """``(name, Trainer class)`` for Lightning and fasttrain, in that order."""
    from fasttrain.lightning import Trainer as FastTrainer

    return (("lightning", L.Trainer), ("fasttrain", FastTrainer))


def run_both(action, seed=0, **trainer_kwargs):
    """``action(trainer)`` under each trainer, built with the quiet defaults plus
    ``trainer_kwargs`` and the global seed set to ``seed`` first; returns
    ``{"lightning": result, "fasttrain": result}``, where an exception raised is the result."""
    kwargs = dict(QUIET)
    kwargs.update(trainer_kwargs)
    out = {}
    for name, trainer_cls in trainers():
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(**kwargs)
            try:
                out[name] = action(trainer)
            except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the error is what the test compares
                out[name] = error
    return out
