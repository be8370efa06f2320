"""Step calls and samplers compared with lightning.Trainer: steps written without ``batch_idx``
are called with the batch alone (the signature read once per run), and evaluation samplers get
``set_epoch`` during a fit as Lightning calls it."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, SequentialSampler  # noqa: E402

from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    VAL,
    Classifier,
    assert_same_results,
    assert_same_weights,
    fit_both,
    loader,
    train_loader,
    val_loader,
)


class BatchOnly(Classifier):
    """Every step takes the batch alone."""

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch):
        return self(batch[0]).argmax(-1)


def test_steps_without_batch_idx_are_called_with_the_batch_like_lightning():
    lt, lm, ft, fm = fit_both(BatchOnly, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2))
    assert_same_weights(lm, fm)
    torch.testing.assert_close(ft.callback_metrics["val_loss"], lt.callback_metrics["val_loss"], atol=1e-6, rtol=0)
    assert_same_results(lt.test(lm, val_loader(), verbose=False), ft.test(fm, val_loader(), verbose=False))
    for ours, theirs in zip(ft.predict(fm, val_loader()), lt.predict(lm, val_loader())):
        assert torch.equal(ours, theirs)


class _Recording(SequentialSampler):
    def __init__(self, data, calls):
        super().__init__(data)
        self.calls = calls

    def set_epoch(self, epoch):
        self.calls.append(epoch)


def test_evaluation_samplers_get_set_epoch_like_lightning():
    calls = {}

    def recorded_val_loader(key):
        return DataLoader(VAL, batch_size=5, sampler=_Recording(VAL, calls.setdefault(key, [])))

    from fasttrain.lightning import Trainer

    for key, trainer_cls in (("lightning", L.Trainer), ("fasttrain", Trainer)):
        trainer = trainer_cls(max_epochs=3, **QUIET)
        trainer.fit(Classifier(), loader(DATA), recorded_val_loader(key))
        trainer.validate(trainer.lightning_module, recorded_val_loader(key + "-validate"), verbose=False)
    assert calls["fasttrain"] == calls["lightning"] == [0, 0, 1, 2]  # the sanity check, then each epoch
    # outside a fit: once, when the loader is set up, with the epochs the trainer has fitted
    assert calls["fasttrain-validate"] == calls["lightning-validate"] == [3]
