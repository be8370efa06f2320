"""Side by side with lightning.Trainer: configure_gradient_clipping set to None, a
val_check_interval longer than an epoch, when the validation loaders are requested without a
sanity check, and time-based validation and max_time with a real interval on a clock the test
moves."""

import sys
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402

from lightning_modules import DATA, VAL, Classifier, assert_same_weights, fit_both, loader, train_loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class SGDClassifier(Classifier):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_configure_gradient_clipping_none_disables_clipping():
    def unclipped():
        module = SGDClassifier()
        module.configure_gradient_clipping = None  # Lightning calls nothing, so nothing clips
        return module

    _, reference, _, ours = fit_both(unclipped, train_loader, trainer_kwargs=dict(max_epochs=2, gradient_clip_val=0.01))
    assert_same_weights(reference, ours)
    # and it is not the clipped fit
    _, clipped, _, _ = fit_both(SGDClassifier, train_loader, trainer_kwargs=dict(max_epochs=2, gradient_clip_val=0.01))
    assert not torch.allclose(clipped.net[0].weight, ours.net[0].weight)


@pytest.mark.parametrize("sanity", [0, 2])
def test_val_check_interval_longer_than_epoch_is_lightnings_error(sanity):
    modules = {}

    def fit(trainer):
        module = modules[type(trainer).__module__] = LoaderOrder()
        trainer.fit(module)

    out = run_both(fit, max_epochs=1, val_check_interval=100, num_sanity_val_steps=sanity)
    assert type(out["fasttrain"]) is type(out["lightning"]) is ValueError
    assert str(out["fasttrain"]) == str(out["lightning"])
    assert "must be less than or equal to the number of the training batches (6)" in str(out["lightning"])
    # raised after the sanity check, before on_train_start (train_dataloader() is requested
    # before the sanity check: a documented difference, docs/lightning.md)
    reference, ours = ([e for e in m.events if e != "train_dataloader"] for m in modules.values())
    assert ours == reference
    assert ("on_validation_start 0" in reference) == bool(sanity)


class LoaderOrder(Classifier):
    """Records val_dataloader() requests among the training and validation hooks."""

    def __init__(self):
        super().__init__()
        self.events = []

    def train_dataloader(self):
        self.events.append("train_dataloader")
        return loader(DATA, batch_size=8)

    def val_dataloader(self):
        self.events.append("val_dataloader")
        return loader(VAL, batch_size=8)

    def on_train_start(self):
        self.events.append("on_train_start")

    def on_train_epoch_start(self):
        self.events.append(f"on_train_epoch_start {self.current_epoch}")

    def on_validation_start(self):
        self.events.append(f"on_validation_start {self.current_epoch}")


@pytest.mark.parametrize("every", [1, 2, 3])
def test_val_dataloader_requested_when_lightning_requests_it(every):
    modules = {}

    def fit(trainer):
        module = modules[type(trainer).__module__] = LoaderOrder()
        trainer.fit(module)

    out = run_both(fit, max_epochs=3, check_val_every_n_epoch=every, num_sanity_val_steps=0)
    assert out == {"lightning": None, "fasttrain": None}
    reference, ours = (m.events for m in modules.values())
    assert ours == reference
    if every == 2:
        assert reference.index("val_dataloader") == reference.index("on_train_epoch_start 1") + 1


class Clocked(Classifier):
    """Moves the test's clock one second per training step and half a second per validation
    step, and records the validations."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.validations = []

    def training_step(self, batch, batch_idx):
        self.clock[0] += 1.0
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock[0] += 0.5
        return super().validation_step(batch, batch_idx)

    def on_validation_start(self):
        self.validations.append((self.current_epoch, self.trainer.global_step, self.trainer.sanity_checking))


@pytest.mark.parametrize("interval", [timedelta(seconds=4), {"seconds": 5}, "00:00:00:07"])
@pytest.mark.parametrize("sanity", [0, 2])
@pytest.mark.parametrize("reload", [0, 1])
def test_time_based_validation_and_max_time_on_a_moved_clock(interval, sanity, reload):
    results = {}

    def fit(trainer):
        clock = [1000.0]
        module = Clocked(clock)
        with mock.patch.object(time, "monotonic", lambda: clock[0]):
            trainer.fit(module, train_loader(), loader(VAL))
        results[type(trainer).__module__] = (module, trainer.global_step, trainer.current_epoch)

    out = run_both(
        fit, max_epochs=5, val_check_interval=interval, max_time={"seconds": 18}, num_sanity_val_steps=sanity,
        reload_dataloaders_every_n_epochs=reload,
    )
    assert out == {"lightning": None, "fasttrain": None}
    (reference, ref_step, ref_epoch), (ours, step, epoch) = results.values()
    assert 0 < ref_step < 30  # max_time ended the fit before max_epochs
    assert any(not sanity_checking for *_, sanity_checking in reference.validations)
    assert ours.validations == reference.validations
    assert (step, epoch) == (ref_step, ref_epoch)
    assert_same_weights(reference, ours)


@pytest.mark.parametrize("sanity", [0, 2])
def test_reloaded_shuffled_loader_gives_lightnings_batches(sanity):
    # Lightning creates (and drops) an iterator of a reloaded training loader before each
    # epoch's own: the shuffles of the epochs after a reload depend on it
    kwargs = dict(max_epochs=3, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=sanity)
    _, reference, _, ours = fit_both(Classifier, train_loader, lambda: loader(VAL), trainer_kwargs=kwargs)
    assert_same_weights(reference, ours)
