"""The autograd modes a Lightning run sets around its loops: ``Trainer(inference_mode=...)``
for evaluation and prediction, ``Trainer(detect_anomaly=...)`` for the fit.

As in Lightning, ``validate()``, ``test()`` and ``predict()`` run (hooks included) under
``torch.inference_mode`` when ``inference_mode=True`` (the default) and under ``torch.no_grad``
otherwise, while the validation inside a fit (and its sanity check) always runs under
``torch.no_grad``. ``torch.inference_mode`` is not used over gloo (its collectives do not
accept inference tensors) nor with FSDP, as Lightning avoids it there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn


def evaluation_context(lt) -> contextlib.AbstractContextManager:
    """The grad mode of an evaluation or prediction loop of ``lt``'s current run: the running
    loop's ``inference_mode`` (``Trainer(inference_mode=...)`` for validate, test and predict,
    False for a fit's validation), as Lightning's loops choose it."""
    loop = lt.predict_loop if lt.state.fn == TrainerFn.PREDICTING else lt._evaluation_loop
    gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    if gloo or isinstance(lt.strategy, FSDPStrategy) or not loop.inference_mode:
        return torch.no_grad()
    return torch.inference_mode()


def anomaly_context(lt) -> contextlib.AbstractContextManager:
    """Autograd's anomaly detection on (``detect_anomaly=True``) or off (the default, which also
    turns off one the user enabled, as Lightning's fit does) while the fit loop runs."""
    return torch.autograd.set_detect_anomaly(bool(lt._args.detect_anomaly))
