"""self.log where Lightning allows it: in callbacks, in on_train_start, with several evaluation
loaders, in on_test_epoch_end; what test() returns and what callback_metrics hold after it.
fasttrain.lightning.Trainer gives lightning.Trainer's keys and values."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_modules import VAL, Classifier, assert_same_metrics, classification_data, loader, train_loader  # noqa: E402,E501
from side_by_side import run_both  # noqa: E402


def _host(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


class CallbackLogs(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.log("cb_batch", outputs["loss"] * 2, on_step=True, on_epoch=True)

    def on_train_epoch_end(self, trainer, module):
        module.log_dict({"cb_epoch": torch.tensor(float(trainer.current_epoch)), "cb_const": 3.0})

    def on_validation_epoch_end(self, trainer, module):
        module.log("cb_val", torch.tensor(5.0))


class LogsAtStart(Classifier):
    def on_train_start(self):
        self.log("start_value", torch.tensor(4.0))
        self.log("start_number", 2.5, prog_bar=True)


def _fit_metrics(factory, callbacks=(), **kwargs):
    def action(trainer):
        trainer.callbacks[:0] = list(callbacks)
        trainer.fit(factory(), train_loader(), loader(VAL, batch_size=10))
        return _host(trainer.callback_metrics), _host(trainer.logged_metrics)

    return run_both(action, **kwargs)


def test_a_callback_logs_through_the_module_like_lightning():
    out = _fit_metrics(Classifier, callbacks=[CallbackLogs()], max_epochs=2)
    (callback_ref, logged_ref), (callback, logged) = out["lightning"], out["fasttrain"]
    assert {"cb_batch_epoch", "cb_epoch", "cb_const", "cb_val"} <= set(callback_ref)
    assert_same_metrics(callback_ref, callback)
    assert_same_metrics(logged_ref, logged)


def test_values_logged_in_on_train_start_are_kept_like_lightning():
    out = _fit_metrics(LogsAtStart, max_epochs=2)
    (callback_ref, logged_ref), (callback, logged) = out["lightning"], out["fasttrain"]
    assert callback_ref["start_value"] == 4.0 and callback_ref["start_number"] == 2.5
    assert_same_metrics(callback_ref, callback)
    assert_same_metrics(logged_ref, logged)


class TwoEvalLoaders(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("eval_loss", loss, on_step=True, on_epoch=True)
        self.log("eval_plain", loss)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("test_loss", loss, on_step=True, on_epoch=True)
        self.log("test_plain", loss * 3)

    def on_test_epoch_end(self):
        self.log("test_end", torch.tensor(7.0))


def _two_loaders():
    return [loader(VAL, batch_size=10), loader(classification_data(n=12, seed=3), batch_size=4)]


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_several_evaluation_loaders_give_lightnings_keys_and_results(stage):
    def action(trainer):
        module = TwoEvalLoaders()
        results = getattr(trainer, stage)(module, _two_loaders(), verbose=False)
        return [_host(r) for r in results], _host(trainer.callback_metrics), _host(trainer.logged_metrics)

    out = run_both(action)
    (results_ref, callback_ref, logged_ref), (results, callback, logged) = out["lightning"], out["fasttrain"]
    prefix = "eval" if stage == "validate" else "test"
    assert f"{prefix}_loss_epoch/dataloader_idx_0" in results_ref[0]
    assert f"{prefix}_loss_epoch/dataloader_idx_1" in results_ref[1]
    if stage == "test":
        assert results_ref[0]["test_end"] == results_ref[1]["test_end"] == 7.0
    assert len(results) == len(results_ref) == 2
    for mine, theirs in zip(results, results_ref):
        assert_same_metrics(theirs, mine)
    assert_same_metrics(callback_ref, callback)
    assert_same_metrics(logged_ref, logged)


def test_callback_metrics_hold_the_test_values_after_test_like_lightning():
    def action(trainer):
        module = TwoEvalLoaders()
        trainer.fit(module, train_loader(), loader(VAL, batch_size=10))
        results = trainer.test(module, loader(VAL, batch_size=10), verbose=False)
        return [_host(r) for r in results], _host(trainer.callback_metrics)

    out = run_both(action, max_epochs=1)
    (results_ref, callback_ref), (results, callback) = out["lightning"], out["fasttrain"]
    assert "test_loss_epoch" in results_ref[0] and "test_loss" in callback_ref
    assert_same_metrics(results_ref[0], results[0])
    assert_same_metrics(callback_ref, callback)
