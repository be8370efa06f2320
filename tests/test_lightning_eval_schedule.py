"""When validation runs and what it reports, side by side with lightning.Trainer: reloaded
validation loaders with ``check_val_every_n_epoch`` > 1, a ``val_check_interval`` longer than an
epoch with ``check_val_every_n_epoch=None``, the epoch metrics already there in
``on_validation_end``, values logged without a ``dataloader_idx`` over several loaders,
``self.log`` from a Callback, the per-step values of several loaders at the loggers, and the
``PL_TRAINER_*`` environment defaults."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402

from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    VAL,
    Classifier,
    assert_same_results,
    assert_same_weights,
    classification_data,
    loader,
    train_loader,
)
from side_by_side import trainers  # noqa: E402


class RecordingLogger(Logger):
    """Every ``log_metrics`` call, values as floats, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append(({k: round(float(v), 5) for k, v in metrics.items()}, step))


def _floats(metrics: dict) -> dict:
    return {k: round(float(v), 5) for k, v in metrics.items()}


def _each(make, **trainer_kwargs):
    """``make(trainer_cls)`` -> (trainer kwargs, action) run under each trainer from the same
    seed; ``{name: action's result}``."""
    out = {}
    for name, trainer_cls in trainers():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs, action = make()
            trainer = trainer_cls(**{**QUIET, **trainer_kwargs, **kwargs})
            out[name] = action(trainer)
    return out


# ---------------------------------------------------------------------------------- cadence
class Validations(Classifier):
    """Records the loader requests and the validations: (what, epoch, sanity check, batch)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def train_dataloader(self):
        self.events.append(("train_dataloader", self.trainer.current_epoch))
        return train_loader()

    def val_dataloader(self):
        epoch = self.trainer.current_epoch
        self.events.append(("val_dataloader", epoch, self.trainer.sanity_checking))
        # a different window of the data at each request: the logged values show which was used
        return loader(torch.utils.data.Subset(VAL, range(epoch % 3, 12 + epoch % 3)), batch_size=4)

    def on_validation_start(self):
        trainer = self.trainer
        batch_idx = None if trainer.sanity_checking else trainer.fit_loop.epoch_loop.batch_idx
        self.events.append(("validation", trainer.current_epoch, trainer.sanity_checking, batch_idx,
                            trainer.global_step))

    def on_validation_epoch_end(self):
        self.events.append(("val_loss", _floats({k: v for k, v in self.trainer.callback_metrics.items()
                                                 if k.startswith("val")})))


def _validations(module_cls=None, **trainer_kwargs):
    """The events of ``module_cls`` (default :class:`Validations`) fitted under each trainer,
    compared; Lightning's."""
    modules = {}

    def make():
        def action(trainer):
            module = modules[type(trainer).__module__.split(".")[0]] = (module_cls or Validations)()
            trainer.fit(module)
            return module.events, trainer.global_step

        return {}, action

    out = _each(make, **trainer_kwargs)
    # the first request of the training loader comes before the sanity check under fasttrain,
    # after it under Lightning (docs/lightning.md): compared apart from the rest
    for events, _ in out.values():
        events.remove(("train_dataloader", 0))
    assert out["fasttrain"] == out["lightning"]
    assert_same_weights(modules["lightning"], modules["fasttrain"])
    return out["lightning"][0]


@pytest.mark.parametrize("reload", [1, 2, 3])
@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("sanity", [0, 2])
def test_reloaded_validation_loaders_with_check_val_every_n_epoch_like_lightning(reload, every, sanity):
    events = _validations(max_epochs=6, reload_dataloaders_every_n_epochs=reload, check_val_every_n_epoch=every,
                          num_sanity_val_steps=sanity)
    assert [e[1] for e in events if e[0] == "validation" and not e[2]] == [e - 1 for e in range(every, 7, every)]


@pytest.mark.parametrize("interval", [8, 10, 13])
@pytest.mark.parametrize("reload", [0, 1])
def test_val_check_interval_past_the_epoch_without_epoch_cadence_like_lightning(interval, reload):
    events = _validations(max_epochs=4, val_check_interval=interval, check_val_every_n_epoch=None,
                          reload_dataloaders_every_n_epochs=reload)
    steps = [e[4] for e in events if e[0] == "validation" and not e[2]]
    assert steps == list(range(interval, 25, interval))


class Stream(torch.utils.data.IterableDataset):
    """The training data as a stream: a loader over it has no length."""

    def __iter__(self):
        return iter([DATA[i] for i in range(len(DATA))])


class StreamValidations(Validations):
    def train_dataloader(self):
        self.events.append(("train_dataloader", self.trainer.current_epoch))
        return loader(Stream(), batch_size=4)


@pytest.mark.parametrize("interval, accumulate, every", [
    (3, 1, None), (3, 1, 1), (3, 2, None), (3, 2, 1), (5, 1, None), (5, 1, 1), (1.0, 1, 1),
])
def test_a_training_stream_validates_on_lightnings_cadence(interval, accumulate, every):
    """A training loader of unknown length: a batch-count val_check_interval validates every
    that many batches (counted over the fit with check_val_every_n_epoch=None, in the epoch
    otherwise), 1.0 at the end of the data, as under Lightning."""
    events = _validations(StreamValidations, max_epochs=2, val_check_interval=interval, check_val_every_n_epoch=every,
                          accumulate_grad_batches=accumulate)
    assert sum(e[0] == "validation" and not e[2] for e in events) >= 2


def test_a_fractional_val_check_interval_over_a_training_stream_is_lightnings_error():
    def make():
        return {}, lambda trainer: trainer.fit(StreamValidations())

    for name, trainer_cls in trainers():
        with pytest.raises(Exception, match="must be time based, `1.0` or an int") as raised:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer_cls(**{**QUIET, "max_epochs": 1, "val_check_interval": 0.5}).fit(StreamValidations())
        assert type(raised.value).__name__ == "MisconfigurationException", name


# ---------------------------------------------------------------------------------- what is reported
class EndReader(Classifier):
    """Reads the metrics in ``on_validation_end`` (the module's and a callback's)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        self.log("val_step", loss, on_step=True, on_epoch=True)

    def on_validation_epoch_end(self):
        self.log("from_epoch_end", self.current_epoch * 1.0)

    def on_validation_end(self):
        trainer = self.trainer
        self.seen.append(("module", trainer.sanity_checking, _floats(trainer.callback_metrics),
                          _floats(trainer.logged_metrics), len(trainer.logger.calls)))


class EndReaderCallback(L.Callback):
    def __init__(self, seen):
        self.seen = seen

    def on_validation_end(self, trainer, module):
        self.seen.append(("callback", trainer.sanity_checking, _floats(trainer.callback_metrics),
                          _floats(trainer.logged_metrics), len(trainer.logger.calls)))


def test_epoch_metrics_are_logged_before_on_validation_end_like_lightning():
    def make():
        logger = RecordingLogger()
        module = EndReader()

        def action(trainer):
            trainer.fit(module, train_loader(), loader(VAL, batch_size=5))
            return module.seen, logger.calls

        return dict(logger=logger, callbacks=[EndReaderCallback(module.seen)]), action

    out = _each(make, max_epochs=2, log_every_n_steps=2)
    assert out["fasttrain"] == out["lightning"]
    seen = out["lightning"][0]
    assert "val_loss" in seen[-1][2] and "val_loss" in seen[-1][3]


class NoIndex(Classifier):
    """Logs over two loaders with and without the loader index in the name."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("per_loader", loss)
        self.log(f"only_{dataloader_idx}", loss + dataloader_idx, add_dataloader_idx=False)

    test_step = validation_step

    def on_validation_epoch_end(self):
        self.log("epoch_end", 1.5)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_values_logged_without_a_dataloader_idx_over_several_loaders_like_lightning(stage):
    def make():
        def action(trainer):
            results = getattr(trainer, stage)(NoIndex(), [loader(VAL, batch_size=5), loader(DATA, batch_size=8)],
                                              verbose=False)
            return results, _floats(trainer.callback_metrics), _floats(trainer.logged_metrics)

        return {}, action

    out = _each(make)
    reference, ours = out["lightning"], out["fasttrain"]
    assert_same_results(reference[0], ours[0], atol=1e-5)
    assert ours[1] == reference[1] and ours[2] == reference[2]


class CallbackLogs(L.Callback):
    """``self.log`` from a Callback, in the hooks Lightning allows it in."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.log("cb_batch", outputs["loss"] * 2, on_step=True, on_epoch=True, prog_bar=True)

    def on_train_epoch_end(self, trainer, module):
        module.log("cb_epoch", trainer.current_epoch + 0.5)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        module.log("cb_val_batch", float(batch_idx))

    def on_validation_epoch_end(self, trainer, module):
        module.log_dict({"cb_val_epoch": 2.0, "cb_val_other": trainer.current_epoch * 1.0})


def test_self_log_in_a_callback_like_lightning():
    def make():
        logger = RecordingLogger()

        def action(trainer):
            trainer.fit(Classifier(), train_loader(), loader(VAL, batch_size=5))
            return (_floats(trainer.callback_metrics), _floats(trainer.logged_metrics),
                    _floats(trainer.progress_bar_metrics), logger.calls)

        return dict(logger=logger, callbacks=[CallbackLogs()]), action

    out = _each(make, max_epochs=2, log_every_n_steps=2)
    assert out["fasttrain"] == out["lightning"]
    assert "cb_val_epoch" in out["lightning"][0] and "cb_batch_epoch" in out["lightning"][0]


class StepValues(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("v_step_only", loss, on_step=True, on_epoch=False)
        self.log("v_both", loss, on_step=True, on_epoch=True)
        self.log("v_epoch", loss)


@pytest.mark.parametrize("during", ["fit", "validate"])
def test_step_values_of_several_val_loaders_reach_the_logger_grouped_like_lightning(during):
    def make():
        logger = RecordingLogger()

        def action(trainer):
            loaders = [loader(VAL, batch_size=5), loader(classification_data(n=12, seed=4), batch_size=4)]
            if during == "fit":
                trainer.fit(StepValues(), train_loader(), loaders)
            else:
                trainer.validate(StepValues(), loaders, verbose=False)
            return logger.calls

        return dict(logger=logger), action

    out = _each(make, max_epochs=2, log_every_n_steps=3)
    assert out["fasttrain"] == out["lightning"]
    assert any("v_step_only/dataloader_idx_1" in metrics for metrics, _ in out["lightning"])


class LogsItsOwnStep(Classifier):
    """Logs a metric named "step" (Lightning's way to set the loggers' step) beside its values,
    per training step and at the epoch ends."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("step", 1000.0 + self.global_step)
        return loss

    def on_train_epoch_end(self):
        self.log_dict({"step": 10.0 * (self.current_epoch + 1), "train_mark": float(self.current_epoch)})

    def on_validation_epoch_end(self):
        self.log_dict({"step": 100.0 * (self.current_epoch + 1), "val_mark": float(self.current_epoch)})


def test_a_logged_step_metric_is_the_loggers_step_like_lightning():
    """A value logged as "step" is the step the loggers get for that call (not a metric of it),
    where Lightning takes it: the training flushes and the epoch ends."""
    def make():
        logger = RecordingLogger()

        def action(trainer):
            trainer.fit(LogsItsOwnStep(), train_loader(), loader(VAL, batch_size=5))
            return logger.calls, sorted(trainer.logged_metrics)

        return dict(logger=logger), action

    out = _each(make, max_epochs=2, log_every_n_steps=2, limit_val_batches=2)
    assert out["fasttrain"] == out["lightning"]
    calls, _ = out["lightning"]
    steps = [step for metrics, step in calls if "val_mark" in metrics or "train_mark" in metrics]
    assert steps == [100, 10, 200, 20] and not any("step" in metrics for metrics, _ in calls)


# ---------------------------------------------------------------------------------- environment
ENVIRONMENT = {
    "PL_TRAINER_MAX_EPOCHS": "2",
    "PL_TRAINER_ACCELERATOR": "cpu",
    "PL_TRAINER_LOG_EVERY_N_STEPS": "3",
    "PL_TRAINER_VAL_CHECK_INTERVAL": "0.5",
    "PL_TRAINER_GRADIENT_CLIP_VAL": "0.25",
    "PL_TRAINER_ACCUMULATE_GRAD_BATCHES": "2",
    "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
    "PL_TRAINER_ENABLE_CHECKPOINTING": "False",
    "PL_TRAINER_ENABLE_PROGRESS_BAR": "0",
    "PL_TRAINER_NUM_SANITY_VAL_STEPS": "1",
    "PL_TRAINER_PRECISION": "bf16-mixed",
}


def test_pl_trainer_environment_defaults_configure_a_fit_like_lightning(monkeypatch, tmp_path):
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PL_TRAINER_DEFAULT_ROOT_DIR", str(tmp_path))
    modules = {}

    def make():
        logger = RecordingLogger()

        def action(trainer):
            module = modules[type(trainer).__module__.split(".")[0]] = Classifier()
            trainer.fit(module, train_loader(), loader(VAL, batch_size=5))
            settings = (trainer.max_epochs, trainer.log_every_n_steps, trainer.val_check_interval,
                        trainer.gradient_clip_val, trainer.accumulate_grad_batches, trainer.limit_val_batches,
                        trainer.num_sanity_val_steps, trainer.precision, trainer.default_root_dir,
                        trainer.checkpoint_callback is None)
            return settings, trainer.global_step, logger.calls

        # enable_model_summary given: a given argument wins over the environment
        return dict(enable_progress_bar=None, enable_checkpointing=None, logger=logger), action

    out = _each(make)
    assert out["fasttrain"] == out["lightning"]
    assert out["lightning"][0][:6] == (2, 3, 0.5, 0.25, 2, 2)
    assert_same_weights(modules["lightning"], modules["fasttrain"], atol=1e-4)
