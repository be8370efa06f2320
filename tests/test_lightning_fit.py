"""fit() with automatic optimization: fasttrain.lightning.Trainer against lightning.Trainer on the
same module, seed and data order (final weights to 1e-6, global_step, callback and logged metrics
to 1e-5)."""

import collections.abc
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    VAL,
    Classifier,
    EpochScheduled,
    MetricsModule,
    PlateauScheduled,
    ScheduledClassifier,
    TinyGPT,
    assert_same_metrics,
    assert_same_weights,
    classification_data,
    fit_both,
    loader,
    token_data,
    train_loader,
)


def val_loader():
    return loader(VAL, batch_size=6)


def check_same(lt, lm, ft, fm):
    assert ft.global_step == lt.global_step
    assert ft.current_epoch == lt.current_epoch
    assert_same_weights(lm, fm)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics)


def test_classifier_with_validation_matches_lightning():
    lt, lm, ft, fm = fit_both(Classifier, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2))
    check_same(lt, lm, ft, fm)
    assert ft.global_step == 12
    assert {"train_loss_step", "train_loss_epoch", "val_loss", "val_acc"} <= set(ft.callback_metrics)
    # values stay on the device; the host sees them only when someone reads them
    assert all(isinstance(v, torch.Tensor) for v in ft.callback_metrics.values())


def test_tiny_gpt_per_step_scheduler_dict_with_frequency_and_max_steps():
    def tokens():
        return loader(token_data(), batch_size=4, shuffle=True)

    lt, lm, ft, fm = fit_both(TinyGPT, tokens, trainer_kwargs=dict(max_steps=11, max_epochs=5))
    check_same(lt, lm, ft, fm)
    assert ft.global_step == 11
    torch.testing.assert_close(
        torch.tensor(ft.optimizers[0].param_groups[0]["lr"]), torch.tensor(lt.optimizers[0].param_groups[0]["lr"])
    )


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_accumulation_and_clipping(algorithm):
    kwargs = dict(max_epochs=2, accumulate_grad_batches=4, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    # 6 batches per epoch: a full window of 4, then a last window of 2 that steps at the epoch end
    lt, lm, ft, fm = fit_both(ScheduledClassifier, train_loader, trainer_kwargs=kwargs)
    check_same(lt, lm, ft, fm)
    assert ft.global_step == 4


def test_limits_and_validation_cadence():
    kwargs = dict(max_epochs=3, limit_train_batches=5, limit_val_batches=2, val_check_interval=2,
                  check_val_every_n_epoch=1, num_sanity_val_steps=1)
    lt, lm, ft, fm = fit_both(Classifier, train_loader, val_loader, trainer_kwargs=kwargs)
    check_same(lt, lm, ft, fm)
    assert ft.global_step == 15


def test_every_second_epoch_validation_and_epoch_scheduler():
    kwargs = dict(max_epochs=4, check_val_every_n_epoch=2, limit_train_batches=0.5)
    lt, lm, ft, fm = fit_both(EpochScheduled, train_loader, val_loader, trainer_kwargs=kwargs)
    check_same(lt, lm, ft, fm)
    assert ft.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


def test_plateau_scheduler_monitors_validation_metric():
    lt, lm, ft, fm = fit_both(PlateauScheduled, train_loader, val_loader, trainer_kwargs=dict(max_epochs=4))
    check_same(lt, lm, ft, fm)
    assert ft.optimizers[0].param_groups[0]["lr"] == lt.optimizers[0].param_groups[0]["lr"]


def test_torchmetrics_sum_reduction_and_explicit_batch_size():
    lt, lm, ft, fm = fit_both(MetricsModule, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2))
    check_same(lt, lm, ft, fm)
    assert {"train_acc_step", "train_acc_epoch", "loss_sum", "explicit", "val_acc"} <= set(ft.callback_metrics)


class SGDClassifier(Classifier):
    # torch's Adam reads its host-side step counter with .item(); SGD reads nothing
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _syncs_per_extra_epoch(sync_counter, **kwargs) -> float:
    counts = []
    for epochs in (1, 3):
        trainer = Trainer(max_epochs=epochs, enable_model_summary=False, enable_checkpointing=False, **kwargs)
        sync_counter["n"] = 0
        trainer.fit(SGDClassifier(), loader(classification_data(n=96), batch_size=8, shuffle=True))
        counts.append(sync_counter["n"])
    return (counts[1] - counts[0]) / 2


def test_no_host_sync_per_step(sync_counter):
    """Logging on step and epoch (with prog_bar=True) costs no device-to-host read per step.
    With no logger and no progress bar, an epoch of 12 steps costs only the DataLoader's own
    few reads (its seed and shuffle)."""
    assert _syncs_per_extra_epoch(sync_counter, logger=False, enable_progress_bar=False) <= 4


def test_loggers_and_progress_bar_read_at_flushes_only(sync_counter, tmp_path):
    """With a logger and the progress bar, the host reads the logged values once per flush
    (every log_every_n_steps=4 stepping batches: 3 per epoch of 12) and at the epoch end, each
    read one packed copy for all values."""
    per_epoch = _syncs_per_extra_epoch(
        sync_counter, logger=CSVLogger(tmp_path), log_every_n_steps=4, enable_progress_bar=True
    )
    # DataLoader reads + (3 flushes + the epoch end) x (logger copy + progress-bar copy)
    assert per_epoch <= 4 + 4 * 2 + 2


def test_unknown_and_unsupported_arguments_are_named():
    with pytest.raises(TypeError, match="max_epoch"):
        Trainer(max_epoch=3)
    with pytest.raises(TypeError, match="benchmark.*cudnn"):
        Trainer(benchmark=True)
    with pytest.raises(ValueError, match="precision"):
        Trainer(precision="64-true")
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        Trainer(gradient_clip_algorithm="l1")


class ReturnsOutput(Classifier):
    """A training_step returning what it is given to return."""

    def __init__(self, make_output):
        super().__init__()
        self.make_output = make_output

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.make_output(torch.nn.functional.cross_entropy(self(x), y))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_end_outputs = self.__dict__.get("batch_end_outputs", []) + [sorted(outputs)]


class LossMapping(collections.abc.Mapping):
    """A read-only mapping (not a dict) holding the loss, as some libraries' step outputs are."""

    def __init__(self, **items):
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


@pytest.mark.parametrize("make_output, words", [
    (lambda loss: {"logits": loss}, "when `training_step` returns a dict, the 'loss' key needs to be present"),
    (lambda loss: {"loss": None}, "when `training_step` returns a dict, the 'loss' key needs to be present"),
    (lambda loss: LossMapping(other=loss), "when `training_step` returns a dict, the 'loss' key needs to be present"),
    (lambda loss: loss.item(), "must return a Tensor, a dict, or None"),
])
def test_a_training_step_without_a_loss_is_lightnings_error(make_output, words):
    """Lightning's MisconfigurationException and words (also a ValueError), under both."""
    for trainer_cls in (L.Trainer, Trainer):
        trainer = trainer_cls(max_epochs=1, enable_progress_bar=False, enable_model_summary=False, logger=False,
                              enable_checkpointing=False)
        with pytest.raises(MisconfigurationException, match=re.escape(words)) as raised:
            trainer.fit(ReturnsOutput(make_output), train_loader())
        if trainer_cls is Trainer:
            assert isinstance(raised.value, ValueError)


def test_a_training_step_returning_a_mapping_with_a_loss_trains_as_under_lightning():
    """Any Mapping with a 'loss' is a step's output under automatic optimization, not only a dict."""
    lt, lm, ft, fm = fit_both(lambda: ReturnsOutput(lambda loss: LossMapping(loss=loss, extra=loss.detach())),
                              train_loader, trainer_kwargs=dict(max_epochs=2))
    check_same(lt, lm, ft, fm)
    # on_train_batch_end gets the mapping's other entries beside the loss, as from a dict
    assert fm.batch_end_outputs == lm.batch_end_outputs and lm.batch_end_outputs[0] == ["extra", "loss"]


def test_val_check_interval_longer_than_an_epoch_is_an_error_naming_it():
    trainer = Trainer(max_epochs=1, val_check_interval=50, enable_progress_bar=False, enable_model_summary=False,
                      logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"`val_check_interval` \(50\) must be less than or equal to the number of"):
        trainer.fit(Classifier(), train_loader(), val_loader())


def test_module_print_and_trainer_attributes_modules_read(capsys):
    class Printing(Classifier):
        def on_train_epoch_end(self):
            self.print(f"epoch {self.trainer.current_epoch} of {self.trainer.max_epochs} "
                       f"on {self.trainer.world_size} process, precision {self.trainer.precision}")

    trainer = Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False, logger=False,
                      enable_checkpointing=False)
    trainer.fit(Printing(), train_loader())
    assert "epoch 0 of 1 on 1 process, precision 32-true" in capsys.readouterr().out
    assert trainer.estimated_stepping_batches == 6 and trainer.num_training_batches == 6


def test_configure_optimizers_returning_none_trains_nothing_like_lightning():
    class NoOptimizer(Classifier):
        def configure_optimizers(self):
            return None

    lt, lm, ft, fm = fit_both(NoOptimizer, train_loader, trainer_kwargs=dict(max_epochs=1))
    assert ft.global_step == lt.global_step == 6  # Lightning counts the mock optimizer's steps
    assert_same_weights(lm, fm)
    torch.manual_seed(0)
    assert_same_weights(NoOptimizer(), fm)  # the initial weights: nothing was stepped


def test_an_error_in_training_step_reaches_on_exception_hooks_and_is_raised():
    seen = []

    class Failing(Classifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("bad batch")
            return super().training_step(batch, batch_idx)

        def on_exception(self, exception):
            seen.append(("module", str(exception)))

    class Watch(L.Callback):
        def on_exception(self, trainer, module, exception):
            seen.append(("callback", str(exception)))

    trainer = Trainer(max_epochs=1, callbacks=[Watch()], enable_progress_bar=False, enable_model_summary=False,
                      logger=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(Failing(), train_loader())
    # LightningModule has no on_exception hook: Lightning calls only the callbacks' (and a DataModule's)
    assert seen == [("callback", "bad batch")]
    assert trainer.global_step == 2


def test_on_train_batch_start_returning_minus_one_ends_the_epoch_like_lightning():
    class SkipRest(EpochScheduled):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 3 else None

    lt, lm, ft, fm = fit_both(SkipRest, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2))
    check_same(lt, lm, ft, fm)
    assert ft.global_step == 6
    assert ft.optimizers[0].param_groups[0]["lr"] == lt.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
