"""Errors during a fit: KeyboardInterrupt, an exception in on_fit_end, the DataModule's
on_exception. fasttrain.lightning.Trainer calls the hooks lightning.Trainer calls and ends the
same way."""

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_modules import DATA, VAL, Classifier, loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


def _recorder(calls):
    class Record(L.Callback):
        def on_exception(self, trainer, module, exception):
            calls.append(("callback.on_exception", type(exception).__name__))

        def teardown(self, trainer, module, stage):
            calls.append(("callback.teardown", stage))

        def on_fit_end(self, trainer, module):
            calls.append(("callback.on_fit_end",))

    return Record()


class DataModule(L.LightningDataModule):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def train_dataloader(self):
        return loader(DATA, batch_size=8)

    def val_dataloader(self):
        return loader(VAL, batch_size=10)

    def on_exception(self, exception):
        self.calls.append(("datamodule.on_exception", type(exception).__name__))

    def teardown(self, stage):
        self.calls.append(("datamodule.teardown", stage))


class Recorded(Classifier):
    def __init__(self, calls, fail_in=None, error=RuntimeError):
        super().__init__()
        self.calls, self.fail_in, self.error = calls, fail_in, error

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.fail_in == "batch" and batch_idx == 2:
            raise self.error("stop")

    def on_fit_end(self):
        self.calls.append(("module.on_fit_end",))
        if self.fail_in == "on_fit_end":
            raise self.error("stop")

    def on_exception(self, exception):  # not a LightningModule hook: Lightning never calls it
        self.calls.append(("module.on_exception", type(exception).__name__))

    def teardown(self, stage):
        self.calls.append(("module.teardown", stage))


def _watched(trainer, records, tmp_path):
    """Adds a recording callback and a ModelCheckpoint(save_on_exception=True) that saves only on
    an exception; returns the trainer's name (its checkpoint folder) and its list of calls."""
    name = type(trainer).__module__.split(".")[0]
    calls = records.setdefault(name, [])
    trainer.callbacks.insert(0, _recorder(calls))
    trainer.callbacks.append(ModelCheckpoint(dirpath=tmp_path / name, save_on_exception=True, every_n_epochs=0))
    return name, calls


@pytest.fixture
def sigint_restored():
    # Lightning ignores SIGINT after a KeyboardInterrupt (so a second Ctrl-C cannot cut the shutdown short)
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_in_fit_ends_like_lightning(sigint_restored, tmp_path):
    records = {}

    def action(trainer):
        calls = records.setdefault(type(trainer).__module__.split(".")[0], [])
        logger = trainer.loggers[0]
        try:
            trainer.fit(Recorded(calls, fail_in="batch", error=KeyboardInterrupt), datamodule=DataModule(calls))
        except SystemExit as exit_:
            calls.append(("exit", exit_.code))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        status = trainer.state.status.value
        return status, trainer.interrupted, trainer.global_step, sorted(os.listdir(logger.log_dir))

    out = run_both(action, max_epochs=2, logger=CSVLogger(tmp_path / "logs"))
    reference = records["lightning"]
    assert reference == [("datamodule.on_exception", "KeyboardInterrupt"), ("exit", 1)]
    assert records["fasttrain"] == reference
    assert out["lightning"][:3] == ("interrupted", True, 3)
    assert out["fasttrain"][:3] == out["lightning"][:3]


def test_keyboard_interrupt_reaches_callbacks_and_the_checkpoint_like_lightning(sigint_restored, tmp_path):
    records = {}

    def action(trainer):
        name, calls = _watched(trainer, records, tmp_path)
        with pytest.raises(SystemExit):
            trainer.fit(Recorded(calls, fail_in="batch", error=KeyboardInterrupt), loader(DATA, batch_size=8))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return sorted(os.listdir(tmp_path / name))

    out = run_both(action, max_epochs=1)
    assert records["lightning"] == [("callback.on_exception", "KeyboardInterrupt")]
    assert records["fasttrain"] == records["lightning"]
    assert out["lightning"] == ["epoch=0-step=3.ckpt"]
    assert out["fasttrain"] == out["lightning"]


@pytest.mark.parametrize("fail_in", ["batch", "on_fit_end"])
def test_an_error_reaches_on_exception_and_the_checkpoint_like_lightning(fail_in, tmp_path):
    records = {}

    def action(trainer):
        name, calls = _watched(trainer, records, tmp_path)
        try:
            trainer.fit(Recorded(calls, fail_in=fail_in), datamodule=DataModule(calls))
        except RuntimeError as error:
            calls.append(("raised", str(error)))
        return trainer.state.status.value, sorted(os.listdir(tmp_path / name))

    out = run_both(action, max_epochs=2)
    reference = records["lightning"]
    assert ("callback.on_exception", "RuntimeError") in reference
    assert ("datamodule.on_exception", "RuntimeError") in reference
    assert records["fasttrain"] == reference
    assert out["lightning"][1] == (["epoch=0-step=3.ckpt"] if fail_in == "batch" else ["epoch=2-step=12.ckpt"])
    assert out["fasttrain"] == out["lightning"]
