"""Lightning's progress bars as callbacks, compared under lightning.Trainer and
fasttrain.lightning.Trainer: ``TQDMProgressBar(refresh_rate=...)``, ``RichProgressBar``, a
``ProgressBar`` subclass of one's own and the default bar of ``enable_progress_bar=True``; the
bars' counters through Lightning's hooks; the metrics they show, read from the device at the
flushes only."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from fasttrain.lightning.progress_bars import EpochProgressBar  # noqa: E402
from lightning_modules import QUIET, Classifier, train_loader, val_loader  # noqa: E402


class SGDClassifier(Classifier):
    # torch's Adam reads its host-side step counter with .item(); SGD reads nothing
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

BOTH = (L.Trainer, Trainer)
WITH_BAR = {**QUIET, "enable_progress_bar": True}


class TestsTwoLoaders(Classifier):
    def test_step(self, batch, batch_idx, dataloader_idx=0):
        return super().test_step(batch, batch_idx)


def _run(trainer_cls, bar, module=None, **kwargs):
    """fit (two epochs, validation with its sanity check), validate, test and predict with ``bar``."""
    torch.manual_seed(0)
    module = module or TestsTwoLoaders()
    trainer = trainer_cls(**{**WITH_BAR, "max_epochs": 2, "callbacks": [bar], **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_loader(), val_loader())
        trainer.validate(module, val_loader(), verbose=False)
        trainer.test(module, [val_loader(), val_loader()], verbose=False)
        trainer.predict(module, val_loader())
    return trainer


class RecordingTQDM(TQDMProgressBar):
    """Lightning's TQDM bar, recording after each hook what its bars show."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def _note(self, hook, *bars):
        self.seen.append((hook, *[(b.n, b.total, b.desc.split(":")[0]) if b is not None else None for b in bars]))

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        self._note("train_epoch_start", self.train_progress_bar)
        self.seen.append(("totals", self.total_train_batches, self.total_val_batches))

    def on_train_batch_end(self, trainer, *args):
        super().on_train_batch_end(trainer, *args)
        self._note("train_batch_end", self.train_progress_bar)

    def on_validation_batch_end(self, trainer, *args):
        super().on_validation_batch_end(trainer, *args)
        self._note("validation_batch_end", self.val_progress_bar)

    def on_test_batch_end(self, trainer, *args):
        super().on_test_batch_end(trainer, *args)
        self._note("test_batch_end", self.test_progress_bar)

    def on_predict_batch_end(self, trainer, *args):
        super().on_predict_batch_end(trainer, *args)
        self._note("predict_batch_end", self.predict_progress_bar)


@pytest.mark.parametrize("refresh_rate", [1, 4])
def test_tqdm_progress_bar_moves_as_under_lightning(refresh_rate):
    seen = []
    for trainer_cls in BOTH:
        bar = RecordingTQDM(refresh_rate=refresh_rate)
        trainer = _run(trainer_cls, bar)
        assert trainer.progress_bar_callback is bar
        seen.append(bar.seen)
    assert seen[0] == seen[1]
    assert ("totals", 6, 4) in seen[1]
    assert ("train_batch_end", (6, 6, "Epoch 1")) in seen[1]


class OwnBar(ProgressBar):
    """A bar of one's own: records the base class's counters in each hook."""

    def __init__(self):
        super().__init__()
        self.enabled = True
        self.seen = []

    def disable(self):
        self.enabled = False

    def enable(self):
        self.enabled = True

    def on_sanity_check_start(self, trainer, module):
        self.seen.append(("sanity", trainer.num_sanity_val_batches))

    def on_train_epoch_start(self, trainer, module):
        self.seen.append(("epoch", trainer.current_epoch, self.total_train_batches, self.total_val_batches))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append(("batch", batch_idx, trainer.global_step))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if self.has_dataloader_changed(dataloader_idx):
            self.seen.append(("val", trainer.sanity_checking, self.total_val_batches_current_dataloader))

    def on_validation_end(self, trainer, module):
        self.reset_dataloader_idx_tracker()

    def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if self.has_dataloader_changed(dataloader_idx):
            self.seen.append(("test", dataloader_idx, self.total_test_batches_current_dataloader))

    def on_predict_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if self.has_dataloader_changed(dataloader_idx):
            self.seen.append(("predict", self.total_predict_batches_current_dataloader))


def test_a_progress_bar_of_ones_own_gets_lightnings_hooks_and_counters():
    seen = []
    for trainer_cls in BOTH:
        bar = OwnBar()
        trainer = _run(trainer_cls, bar, limit_train_batches=4, check_val_every_n_epoch=2)
        assert trainer.progress_bar_callback is bar and bar.trainer is trainer
        seen.append(bar.seen)
    assert seen[0] == seen[1]
    # no validation in the first epoch (check_val_every_n_epoch=2): no validation batches counted
    assert ("epoch", 0, 4, 0) in seen[1] and ("epoch", 1, 4, 4) in seen[1]
    # the sanity check's count is set when its loop starts, after on_sanity_check_start (empty at the
    # first fit), as in Lightning
    assert ("sanity", []) in seen[1] and ("val", True, 2) in seen[1] and ("test", 1, 4) in seen[1]


def test_enable_progress_bar_gives_a_progress_bar_callback():
    # Lightning's default redraws after every batch; fasttrain's is a ProgressBar too, drawn at
    # tqdm's pace (progress_bars.py says why): the contract is the class and its counters
    for trainer_cls in BOTH:
        assert isinstance(trainer_cls(**WITH_BAR).progress_bar_callback, ProgressBar)
        assert trainer_cls(**QUIET).progress_bar_callback is None
    assert type(Trainer(**WITH_BAR).progress_bar_callback) is EpochProgressBar


class SeesTheBar(L.Callback):
    """After each training batch: the default bar's position, its postfix and the counters."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = trainer.progress_bar_callback
        self.seen.append((bar.train_progress_bar.n, bar.train_progress_bar.postfix, bar.total_train_batches,
                          trainer.fit_loop.epoch_loop.batch_progress.current.completed))


def test_the_default_bar_counts_every_batch_and_shows_the_flushed_values():
    seen = SeesTheBar()
    trainer = Trainer(**{**WITH_BAR, "max_epochs": 1, "log_every_n_steps": 2, "callbacks": [seen]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SGDClassifier(), train_loader())
    # the bar callback runs after this one (callbacks first, the default bar appended last)
    assert [n for n, _, _, _ in seen.seen] == [0, 1, 2, 3, 4, 5]
    assert [total for _, _, total, _ in seen.seen] == [6] * 6
    assert [done for _, _, _, done in seen.seen] == [0, 1, 2, 3, 4, 5]
    postfixes = [postfix for _, postfix, _, _ in seen.seen]
    # the logged prog_bar value appears once the first flush (the second stepping batch) ran
    assert not any(postfixes[:2]) and all("train_loss_step=" in p for p in postfixes[2:])
    assert postfixes[2] == postfixes[3] and postfixes[3] != postfixes[4]  # new values at flushes only


class SeesTheBarAtBatchStart(SGDClassifier):
    """Records the default bar's position and postfix as each training batch starts, so the
    bar stays the only listener of on_train_batch_end."""

    def on_train_batch_start(self, batch, batch_idx):
        bar = self.trainer.progress_bar_callback.train_progress_bar
        self.seen.append((bar.n, bar.postfix))


@pytest.mark.parametrize("another_listener", [False, True])
def test_the_default_bar_alone_counts_every_batch_without_the_hooks_dispatch(monkeypatch, another_listener):
    from fasttrain.lightning import hooks

    dispatched = []
    call = hooks.HookCaller.__call__

    def recording(self, name, *args, **kwargs):
        dispatched.append(name)
        return call(self, name, *args, **kwargs)

    monkeypatch.setattr(hooks.HookCaller, "__call__", recording)
    module = SeesTheBarAtBatchStart()
    module.seen = []
    callbacks = [SeesTheBar()] if another_listener else []
    trainer = Trainer(**{**WITH_BAR, "max_epochs": 1, "log_every_n_steps": 2, "callbacks": callbacks})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_loader())
    assert [n for n, _ in module.seen] == [0, 1, 2, 3, 4, 5]
    postfixes = [postfix for _, postfix in module.seen]
    # what the bar shows at the third batch's start: the flush after the second stepping batch
    assert not any(postfixes[:2]) and all("train_loss_step=" in p for p in postfixes[2:])
    assert postfixes[2] == postfixes[3] and postfixes[3] != postfixes[4]  # new values at flushes only
    assert dispatched.count("on_train_batch_end") == (6 if another_listener else 0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(callbacks=[TQDMProgressBar(), OwnBar()]), dict(callbacks=[TQDMProgressBar()], enable_progress_bar=False)],
    ids=["two-bars", "bar-but-disabled"],
)
def test_bar_settings_lightning_refuses_are_its_error(kwargs):
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(MisconfigurationException) as info:
            trainer_cls(**{**WITH_BAR, **kwargs})
        seen.append(str(info.value))
    assert seen[0] == seen[1]


class MetricsAtFlushes(TQDMProgressBar):
    """Records what the bar shows (get_metrics) at the flush batches and at the epoch ends."""

    def __init__(self, every):
        super().__init__()
        self.every = every
        self.shown = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % self.every == 0:
            self.shown.append((trainer.global_step, self.get_metrics(trainer, module)))

    def on_train_epoch_end(self, trainer, module):
        super().on_train_epoch_end(trainer, module)
        self.shown.append(("epoch", self.get_metrics(trainer, module)))


def test_the_bars_metrics_at_the_flushes_are_lightnings():
    shown = []
    for trainer_cls in BOTH:
        bar = MetricsAtFlushes(every=2)
        _run(trainer_cls, bar, log_every_n_steps=2)
        shown.append(bar.shown)
    theirs, ours = shown
    assert [at for at, _ in ours] == [at for at, _ in theirs] and len(ours) == 3 * 2 + 2
    for (_, their_values), (_, our_values) in zip(theirs, ours):
        assert sorted(our_values) == sorted(their_values)
        for key, value in their_values.items():
            assert our_values[key] == pytest.approx(value, abs=1e-5), key


def _host_reads_per_extra_epoch(sync_counter, bar_factory):
    counts = []
    for epochs in (1, 3):
        trainer = Trainer(**{**WITH_BAR, "max_epochs": epochs, "log_every_n_steps": 3, "callbacks": [bar_factory()]})
        sync_counter["n"] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(SGDClassifier(), train_loader())
        counts.append(sync_counter["n"])
    return (counts[1] - counts[0]) / 2


def test_a_bar_refreshed_every_batch_reads_the_device_at_the_flushes_only(sync_counter):
    """refresh_rate=1 asks for the metrics after each of the 6 batches of an epoch; the device
    is read at the 2 flushes (log_every_n_steps=3) and the epoch end only, as without a bar."""
    with_bar = _host_reads_per_extra_epoch(sync_counter, lambda: TQDMProgressBar(refresh_rate=1))
    # the shuffling DataLoader's own reads, plus one packed copy per flush and the epoch end
    assert with_bar <= 4 + 3


class LogsAtTheEpochEnd(SGDClassifier):
    """An epoch value logged in training_step and one logged in on_train_epoch_end, both shown
    on the bar."""

    def training_step(self, batch, batch_idx):
        self.log("in_step", torch.tensor(float(self.current_epoch)), on_step=False, on_epoch=True, prog_bar=True)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.log("at_epoch_end", torch.tensor(10.0 + self.current_epoch), prog_bar=True, reduce_fx="sum")


class ReadsTheBarsMetrics(L.Callback):
    """progress_bar_metrics at the epochs' edges (between flushes a bar shows the last flush's
    values, docs/lightning.md)."""

    def __init__(self):
        self.seen = []

    def _note(self, hook, trainer):
        self.seen.append((hook, trainer.current_epoch, dict(trainer.progress_bar_metrics)))

    def on_train_epoch_start(self, trainer, module):
        self._note("epoch_start", trainer)

    def on_train_epoch_end(self, trainer, module):
        self._note("epoch_end", trainer)

    def on_train_end(self, trainer, module):
        self._note("train_end", trainer)


@pytest.mark.parametrize("with_bar", [True, False])
def test_values_logged_in_the_epoch_end_hooks_reach_the_bars_metrics_after_them(with_bar, sync_counter):
    """A value logged in on_train_epoch_end is in progress_bar_metrics from the end of that
    epoch's hooks on (the next epoch's reads, on_train_end, after the fit), as under Lightning,
    and with a bar, an epoch whose end hooks log nothing reads the device no more often."""
    seen, after = [], []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        reader = ReadsTheBarsMetrics()
        trainer = trainer_cls(**{**QUIET, "enable_progress_bar": with_bar, "max_epochs": 2, "callbacks": [reader],
                                 "limit_train_batches": 2})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(LogsAtTheEpochEnd(), train_loader())
        seen.append(reader.seen)
        after.append(dict(trainer.progress_bar_metrics))
    theirs, ours = seen
    assert [(hook, epoch, sorted(values)) for hook, epoch, values in ours] == [
        (hook, epoch, sorted(values)) for hook, epoch, values in theirs
    ]
    for (_, _, their_values), (_, _, our_values) in zip(theirs, ours):
        assert our_values == pytest.approx(their_values, abs=1e-5)
    assert {k: after[0][k] for k in ("in_step", "at_epoch_end")} == {"in_step": 1.0, "at_epoch_end": 11.0}
    assert after[1] == pytest.approx(after[0], abs=1e-5)
    if with_bar:
        # no value logged at the epoch end: the bar's copy is read at the flush and epoch end only
        assert _host_reads_per_extra_epoch(sync_counter, lambda: TQDMProgressBar(refresh_rate=1)) <= 4 + 3


class LogsEvaluationSteps(SGDClassifier):
    """Values logged per evaluation step for the bar: one per step only, one per step and epoch."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("val_step_only", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("val_both", loss, on_step=True, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.cross_entropy(self(x), y), on_step=True, prog_bar=True)


@pytest.mark.parametrize("with_bar", [True, False])
def test_the_evaluation_steps_values_reach_the_bars_metrics(with_bar):
    """The last evaluation step's values logged with prog_bar=True (and on_step=True) are in
    progress_bar_metrics after the evaluation, beside its epoch values, as under Lightning (its
    evaluation loop takes each step's values in); callback_metrics keep the epoch values only."""
    after = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        trainer = trainer_cls(**{**QUIET, "enable_progress_bar": with_bar, "max_epochs": 1,
                                 "limit_train_batches": 2, "limit_val_batches": 3, "num_sanity_val_steps": 2})
        module = LogsEvaluationSteps()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader(), val_loader())
            fitted = (dict(trainer.progress_bar_metrics), sorted(trainer.callback_metrics))
            trainer.test(module, val_loader(), verbose=False)
        after.append((fitted, dict(trainer.progress_bar_metrics)))
    (their_fit, theirs), (our_fit, ours) = after
    assert {"val_step_only", "val_both_step", "val_both_epoch"} <= set(their_fit[0])
    assert sorted(our_fit[0]) == sorted(their_fit[0]) and our_fit[1] == their_fit[1]
    assert our_fit[0] == pytest.approx(their_fit[0], abs=1e-5)
    assert {"test_loss_step", "test_loss_epoch"} <= set(theirs)
    assert sorted(ours) == sorted(theirs) and ours == pytest.approx(theirs, abs=1e-5)


class ShowsWhatItGets(TQDMProgressBar):
    """Records every get_metrics the bar makes (each refresh of what it shows), with the stage."""

    def __init__(self):
        super().__init__()
        self.shown = []

    def get_metrics(self, trainer, module):
        items = super().get_metrics(trainer, module)
        items.pop("v_num", None)
        self.shown.append((trainer.state.stage.value, trainer.current_epoch, trainer.global_step,
                           {k: round(float(v), 4) for k, v in items.items()}))
        return items


class LogsEpochMaxima(SGDClassifier):
    def training_step(self, batch, batch_idx):
        self.log("a", float(self.global_step), prog_bar=True, on_step=False, on_epoch=True, reduce_fx="max")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("b", float(self.global_step), prog_bar=True, on_step=False, on_epoch=True, reduce_fx="max")


def test_the_bar_shows_the_sanity_checks_values_at_its_end_and_nothing_of_them_after():
    """What a bar shows when it reads the metrics at each flush (every batch here) and at each
    end, as under Lightning: the sanity check's epoch values at its end, then none of them once
    training starts."""
    shown = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        bar = ShowsWhatItGets()
        trainer = trainer_cls(**{**WITH_BAR, "callbacks": [bar], "max_epochs": 2, "limit_train_batches": 2,
                                 "limit_val_batches": 2, "num_sanity_val_steps": 2, "log_every_n_steps": 1})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(LogsEpochMaxima(), train_loader(), val_loader())
        shown.append([(stage, epoch, step, {k: v for k, v in values.items() if k in "ab"})
                      for stage, epoch, step, values in bar.shown])
    theirs, ours = shown
    assert theirs[0] == ("sanity_check", 0, 0, {"b": 0.0}) and theirs[1][3] == {}
    assert ours == theirs


def test_rich_progress_bar_runs_as_under_lightning():
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar

    class RecordingRich(RichProgressBar):
        def __init__(self):
            super().__init__(leave=True)
            self.seen = []

        def on_train_epoch_end(self, trainer, module):
            super().on_train_epoch_end(trainer, module)
            self.seen.append(sorted((t.description, t.completed, t.total) for t in self.progress.tasks))

        def on_test_end(self, trainer, module):
            self.seen.append(sorted((t.description, t.completed, t.total) for t in self.progress.tasks))
            super().on_test_end(trainer, module)

    seen = []
    for trainer_cls in BOTH:
        bar = RecordingRich()
        trainer = _run(trainer_cls, bar)
        assert trainer.progress_bar_callback is bar
        seen.append(bar.seen)
    assert seen[0] == seen[1] and len(seen[1]) == 3
    assert [(d.strip(), done, total) for d, done, total in seen[1][1]] == [("Epoch 1/1", 6, 6), ("Validation", 4, 4)]
