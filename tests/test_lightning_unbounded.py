"""``max_epochs=-1`` without ``max_steps``: the fit trains until something stops it (a
callback's ``should_stop``, ``EarlyStopping``, ``max_time``, a KeyboardInterrupt), as under
lightning.Trainer, with its estimate, counters, warnings and weights."""

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping  # noqa: E402

from lightning_modules import QUIET, Classifier, assert_same_weights, train_loader, val_loader  # noqa: E402
from side_by_side import run_both, trainers  # noqa: E402


class Recorder(Classifier):
    def __init__(self):
        super().__init__()
        self.events = []

    def configure_optimizers(self):
        self.events.append(("estimate", self.trainer.estimated_stepping_batches, self.trainer.max_epochs))
        return super().configure_optimizers()

    def on_train_epoch_end(self):
        self.events.append(("epoch_end", self.current_epoch, self.global_step))

    def on_train_end(self):
        self.events.append(("train_end", self.current_epoch, self.global_step, self.trainer.should_stop))


class StopAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit_both(callbacks, val=False, **trainer_kwargs):
    """Each trainer gets callbacks of its own (``callbacks()``): Lightning adds its Timer to the
    list it is given, and EarlyStopping keeps its counts."""
    modules, out = {}, {}
    for name, trainer_cls in trainers():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(max_epochs=-1, callbacks=callbacks(), **QUIET, **trainer_kwargs)
            module = modules[name] = Recorder()
            trainer.fit(module, train_loader(), val_loader() if val else None)
        out[name] = module.events, trainer.global_step, trainer.current_epoch, trainer.max_epochs
    assert out["fasttrain"] == out["lightning"]
    assert_same_weights(modules["lightning"], modules["fasttrain"])
    return out["lightning"]


@pytest.mark.parametrize("step", [17, 24])
def test_should_stop_ends_an_unbounded_fit_like_lightning(step):
    events, global_step, epoch, max_epochs = _fit_both(lambda: [StopAt(step)])
    assert global_step == step and max_epochs == -1
    assert events[0] == ("estimate", float("inf"), -1)


def test_early_stopping_ends_an_unbounded_fit_like_lightning():
    events, global_step, epoch, _ = _fit_both(
        lambda: [EarlyStopping("val_loss", patience=1, min_delta=0.05)], val=True
    )
    assert 0 < epoch < 50


def test_min_epochs_hold_an_unbounded_fit_that_is_told_to_stop_like_lightning():
    _, global_step, epoch, _ = _fit_both(lambda: [StopAt(3)], min_epochs=4)
    assert epoch == 4 and global_step == 24


class _StepClock:
    """Timer's clock, read from a trainer's step count: one second per optimizer step, the same
    under both trainers whatever their speed."""

    def __init__(self):
        self.trainer = None

    def monotonic(self):
        return float(self.trainer.global_step) if self.trainer is not None else 0.0


def test_max_time_ends_an_unbounded_fit_like_lightning(monkeypatch):
    import lightning.pytorch.callbacks.timer as timer_module

    clock = _StepClock()
    monkeypatch.setattr(timer_module, "time", SimpleNamespace(monotonic=clock.monotonic))

    class Clocked(L.Callback):
        def on_fit_start(self, trainer, module):
            clock.trainer = trainer

    events, global_step, epoch, _ = _fit_both(lambda: [Clocked()], max_time={"seconds": 15})
    assert global_step == 15 and epoch == 3  # stopped in the third epoch, which still ends


def test_an_unbounded_fit_gives_lightnings_warnings():
    said = {}
    for name, trainer_cls in trainers():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = trainer_cls(max_epochs=-1, callbacks=[StopAt(7)], **QUIET)
            trainer.fit(Recorder(), train_loader())
        said[name] = sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)
                             and "max_epochs" in str(w.message)})
    assert said["fasttrain"] == said["lightning"] == []


class Interrupt(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 15:
            raise KeyboardInterrupt

    def on_exception(self, trainer, module, exception):
        self.seen.append((type(exception).__name__, trainer.global_step, trainer.interrupted))


def test_a_keyboard_interrupt_ends_an_unbounded_fit_like_lightning():
    def action(trainer):
        callback = Interrupt()
        trainer.callbacks.append(callback)
        module = Recorder()
        try:
            trainer.fit(module, train_loader())
        except SystemExit as stop:
            return stop.code, callback.seen, module.events, trainer.global_step, trainer.interrupted
        return "not stopped"

    out = run_both(action, max_epochs=-1)
    assert out["fasttrain"] == out["lightning"]
    assert out["lightning"][0] == 1 and out["lightning"][1] == [("KeyboardInterrupt", 15, True)]
