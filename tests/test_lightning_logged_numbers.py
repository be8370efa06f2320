"""Python numbers given to ``self.log`` inside a compiled step reach the result store as numbers
and become Lightning's tensors after the step (fasttrain/lightning/logged_numbers.py): a number
that changes at every step (the learning rate read from the scheduler) no longer compiles the step
once per value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402

from lightning_modules import Classifier, assert_same_metrics, assert_same_weights, fit_both, train_loader, val_loader  # noqa: E402

AOT = {"backend": "aot_eager"}


class LogsTheLearningRate(Classifier):
    """Logs the scheduler's learning rate (a Python float that changes at every step) in
    training_step, and numbers of each kind in training and validation."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        self.log("progress", float(self.global_step) / 100, on_step=False, on_epoch=True)
        self.log("even", batch_idx % 2 == 0, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_index", batch_idx, reduce_fx="max")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_numbers_logged_in_a_compiled_step_keep_it_compiled_and_are_logged_as_under_lightning(dynamos_own_limits):
    torch._dynamo.reset()
    lt, lm, ft, fm = fit_both(
        LogsTheLearningRate, train_loader, val_loader, trainer_kwargs=dict(max_epochs=4),
        fasttrain_kwargs=dict(engine="compiled", compile_options=AOT),
    )
    assert ft.engine == "compiled"  # before: the recompile limit, then eager
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    for key, value in lt.callback_metrics.items():
        assert ft.callback_metrics[key].dtype == value.dtype, key
    # the rate of the last step: 0.05 / (1 + its index), logged before the scheduler steps
    steps = 4 * len(train_loader())
    assert float(ft.logged_metrics["lr"]) == float(lt.logged_metrics["lr"]) == pytest.approx(0.05 / steps)


def test_lightnings_own_trainer_converts_numbers_as_before():
    from lightning.pytorch import LightningModule

    from fasttrain.lightning import Trainer, logged_numbers

    Trainer(max_epochs=1)  # installs the conversion
    module = Classifier()
    converted = LightningModule._LightningModule__to_tensor(module, 0.25, "x")
    assert isinstance(converted, torch.Tensor) and converted.dtype == torch.float32 and float(converted) == 0.25
    assert logged_numbers.as_logged_tensor(True, "cpu").dtype == torch.float32
    # inside a compile that is not a fasttrain step, Lightning's conversion runs too
    traced = torch.compile(lambda v: LightningModule._LightningModule__to_tensor(module, v, "x") * 2,
                           backend="aot_eager", fullgraph=True)
    assert float(traced(0.5)) == 1.0


def test_a_lightning_without_the_private_conversion_is_left_as_it_is(monkeypatch):
    # the conversion replaced is a private method of LightningModule: where a Lightning release
    # has none of that name, fasttrain.lightning still builds its Trainer and changes nothing
    from lightning.pytorch import LightningModule

    from fasttrain.lightning import Trainer, logged_numbers

    monkeypatch.setattr(logged_numbers, "_ORIGINAL", None)
    monkeypatch.delattr(LightningModule, logged_numbers._CONVERSION)
    Trainer(max_epochs=1)
    assert logged_numbers.install() is False
    assert logged_numbers._ORIGINAL is None
    assert logged_numbers._CONVERSION not in LightningModule.__dict__
