"""Trainer features that shape the fit loop, each run under lightning.Trainer and
fasttrain.lightning.Trainer from the same seed and compared: fast_dev_run, max_epochs=-1,
max_time, min_epochs/min_steps, overfit_batches, loaders without a length,
reload_dataloaders_every_n_epochs, a time-based val_check_interval, barebones."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    Classifier,
    assert_same_weights,
    fit_both,
    loader,
    train_loader,
    val_loader,
)


class _Count(L.Callback):
    def __init__(self):
        self.validations = 0
        self.train_batches = 0

    def on_validation_start(self, trainer, module):
        self.validations += 0 if trainer.sanity_checking else 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_batches += 1


def _both_with(counter_kwargs=None, **trainer_kwargs):
    """fit_both with a fresh _Count per trainer; returns (lt, lm, ft, fm, lightning_count, fasttrain_count)."""
    counts = []

    class Counted(Classifier):
        def configure_callbacks(self):
            counts.append(_Count())
            return [counts[-1]]

    lt, lm, ft, fm = fit_both(Counted, train_loader, val_loader, trainer_kwargs=trainer_kwargs)
    return lt, lm, ft, fm, counts[0], counts[1]


@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_fast_dev_run_matches_lightning(tmp_path, fast_dev_run):
    lt, lm, ft, fm, lc, fc = _both_with(
        fast_dev_run=fast_dev_run, default_root_dir=tmp_path, logger=True, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")],
    )
    assert ft.fast_dev_run == lt.fast_dev_run == fast_dev_run
    assert ft.global_step == lt.global_step == int(fast_dev_run)
    assert (fc.train_batches, fc.validations) == (lc.train_batches, lc.validations) == (int(fast_dev_run), 1)
    assert ft.num_sanity_val_steps == lt.num_sanity_val_steps == 0
    assert [type(x).__name__ for x in ft.loggers] == [type(x).__name__ for x in lt.loggers] == ["DummyLogger"]
    assert not (tmp_path / "ckpt").exists()  # ModelCheckpoint saves nothing in a development run
    assert_same_weights(lm, fm)


def test_max_epochs_none_stays_none_until_fit_then_like_lightning():
    lightning_trainer, ours = L.Trainer(**QUIET), Trainer(**QUIET)
    assert ours.max_epochs is lightning_trainer.max_epochs is None
    module = Classifier()
    with pytest.warns(UserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs"):
        ours.fit(module, train_loader(), max_steps_guard(ours))
    assert ours.max_epochs == 1000


def max_steps_guard(trainer):
    """Stops the 1000-epoch default fit after its first epoch (a callback setting should_stop)."""

    class Stop(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = True

    trainer.callbacks.insert(0, Stop())
    return None


def test_max_epochs_minus_one_trains_to_max_steps_like_lightning():
    lt, lm, ft, fm = fit_both(Classifier, train_loader, trainer_kwargs=dict(max_epochs=-1, max_steps=15))
    assert ft.global_step == lt.global_step == 15
    assert ft.current_epoch == lt.current_epoch == 3  # the stopped epoch counts
    assert ft.max_epochs == lt.max_epochs == -1
    assert_same_weights(lm, fm)


class _StopAfterThreeEpochs(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = trainer.current_epoch == 2


def test_max_epochs_minus_one_alone_trains_until_stopped_like_lightning():
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader, trainer_kwargs=dict(max_epochs=-1, callbacks=[_StopAfterThreeEpochs()])
    )
    assert ft.current_epoch == lt.current_epoch == 3
    assert_same_weights(lm, fm)


def test_max_steps_alone_sets_max_epochs_minus_one_like_lightning():
    lt, lm, ft, fm = fit_both(Classifier, train_loader, trainer_kwargs=dict(max_steps=9))
    assert ft.max_epochs == lt.max_epochs == -1
    assert ft.global_step == lt.global_step == 9
    assert_same_weights(lm, fm)


def test_max_time_stops_and_min_steps_holds_the_stop_like_lightning():
    # a zero max_time asks to stop at once; min_steps keeps both trainers going until step 10,
    # mid-epoch
    lt, lm, ft, fm = fit_both(Classifier, train_loader, trainer_kwargs=dict(max_time={"seconds": 0}, min_steps=10))
    assert [type(cb).__name__ for cb in ft.callbacks] == [type(cb).__name__ for cb in lt.callbacks] == ["Timer"]
    assert ft.global_step == lt.global_step == 10
    assert ft.max_epochs == lt.max_epochs == -1
    assert_same_weights(lm, fm)


class _StopAtStart(L.Callback):
    def on_train_start(self, trainer, module):
        trainer.should_stop = True


def test_min_epochs_keeps_training_after_should_stop_like_lightning(caplog):
    caplog.set_level("INFO")
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader, val_loader,
        trainer_kwargs=dict(max_epochs=5, min_epochs=2, callbacks=[_StopAtStart()]),
    )
    assert ft.current_epoch == lt.current_epoch == 2
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm, fm)
    said = [r.getMessage() for r in caplog.records if "min_epochs=2" in r.getMessage()]
    assert len(said) == 2 and said[0] == said[1]  # once per trainer, the same words


def test_overfit_batches_matches_lightning():
    with pytest.warns(UserWarning, match="We are turning off the train dataloader shuffling"):
        trainer = Trainer(max_epochs=1, overfit_batches=2, **QUIET)
        trainer.fit(Classifier(), train_loader(), val_loader())
    assert trainer.num_training_batches == 2 and trainer.num_val_batches == [2]
    lt, lm, ft, fm, lc, fc = _both_with(max_epochs=3, overfit_batches=2)
    assert ft.num_training_batches == lt.num_training_batches == 2
    assert ft.limit_val_batches == lt.limit_val_batches == 2
    assert ft.global_step == lt.global_step == 6
    assert_same_weights(lm, fm)


class _Stream(IterableDataset):
    """DATA as a stream without a length, in batches of 8."""

    def __iter__(self):
        return iter(DATA)


def _stream():
    return DataLoader(_Stream(), batch_size=8)


@pytest.mark.parametrize("kwargs", [dict(max_epochs=2), dict(max_steps=9), dict(max_epochs=3, limit_train_batches=4)])
def test_loaders_without_a_length_match_lightning(kwargs):
    lt, lm, ft, fm = fit_both(Classifier, _stream, _stream, trainer_kwargs=dict(num_sanity_val_steps=0, **kwargs))
    assert ft.global_step == lt.global_step
    assert ft.current_epoch == lt.current_epoch
    assert ft.num_training_batches == lt.num_training_batches
    assert_same_weights(lm, fm)
    torch.testing.assert_close(ft.callback_metrics["val_loss"], lt.callback_metrics["val_loss"], atol=1e-6, rtol=0)
    assert ft.validate(fm, _stream(), verbose=False)[0].keys() == lt.validate(lm, _stream(), verbose=False)[0].keys()


def test_a_fractional_limit_on_a_loader_without_length_is_lightnings_error():
    for trainer_cls in (L.Trainer, Trainer):
        with pytest.raises(MisconfigurationException, match=r"limit_train_batches\)` must be `1.0` or an int"):
            trainer_cls(max_epochs=1, limit_train_batches=0.5, **QUIET).fit(Classifier(), _stream())


def test_reload_dataloaders_every_n_epochs_matches_lightning():
    calls = {}

    class Reloading(Classifier):
        def train_dataloader(self):
            # in order, but a different window of the data at each request: the weights show
            # when the loader was requested
            epoch = self.trainer.current_epoch
            calls.setdefault(id(self.trainer), []).append(("train", epoch))
            return loader(torch.utils.data.Subset(DATA, range(4 * epoch, 4 * epoch + 32)), batch_size=8)

        def val_dataloader(self):
            calls.setdefault(id(self.trainer), []).append(("val", self.trainer.current_epoch))
            return val_loader()

    results = []
    for trainer_cls in (L.Trainer, Trainer):
        torch.manual_seed(0)
        module = Reloading()
        torch.manual_seed(1)
        trainer = trainer_cls(max_epochs=4, reload_dataloaders_every_n_epochs=2, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module)
        results.append((trainer, module))
    (lt, lm), (ft, fm) = results
    assert calls[id(ft)] == calls[id(lt)]
    assert ("train", 2) in calls[id(ft)] and ("val", 2) in calls[id(ft)]
    assert_same_weights(lm, fm)


def test_time_based_val_check_interval_matches_lightning():
    # a zero interval is due after every batch
    lt, lm, ft, fm, lc, fc = _both_with(max_epochs=2, val_check_interval={"seconds": 0})
    assert fc.validations == lc.validations == 12
    assert ft.val_check_batch is lt.val_check_batch is None
    assert_same_weights(lm, fm)
    for trainer_cls in (L.Trainer, Trainer):
        with pytest.raises(MisconfigurationException, match="Expected 'DD:HH:MM:SS'"):
            trainer_cls(val_check_interval="10:00")


def test_barebones_matches_lightning(tmp_path, caplog):
    caplog.set_level("INFO")
    for trainer_cls in (L.Trainer, Trainer):
        trainer_cls(barebones=True)
    said = [r.getMessage() for r in caplog.records if "barebones=True)` mode" in r.getMessage()]
    assert len(said) == 2 and said[0] == said[1]
    for trainer_cls in (L.Trainer, Trainer):
        with pytest.raises(ValueError, match=r"barebones=True, enable_checkpointing=True\)` was passed"):
            trainer_cls(barebones=True, enable_checkpointing=True)
        with pytest.raises(ValueError, match=r"barebones=True, num_sanity_val_steps=2\)` was passed"):
            trainer_cls(barebones=True, num_sanity_val_steps=2)
    trainers = []
    for trainer_cls in (L.Trainer, Trainer):
        torch.manual_seed(0)
        module = Classifier()
        trainer = trainer_cls(barebones=True, max_epochs=1, default_root_dir=tmp_path / trainer_cls.__module__)
        with pytest.warns(UserWarning, match=r"`self.log\(\)` but `Trainer\(barebones=True\)` is configured"):
            trainer.fit(module, train_loader(), val_loader())
        trainers.append((trainer, module))
    (lt, lm), (ft, fm) = trainers
    assert ft.barebones and lt.barebones
    assert ft.loggers == lt.loggers == []
    assert ft.checkpoint_callback is lt.checkpoint_callback is None
    assert ft.log_every_n_steps == lt.log_every_n_steps == 0
    assert dict(ft.callback_metrics) == dict(lt.callback_metrics) == {}
    assert not (tmp_path / "fasttrain.lightning.trainer").exists()
