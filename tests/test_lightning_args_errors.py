"""Lightning's errors and warnings for bad settings and bad module code, each compared under
lightning.Trainer and fasttrain.lightning.Trainer (the same exception type and words): loop
limits, batch limits and ``val_check_interval``, ``self.log`` where it may not log or with changed
options, manual optimization with clipping or accumulation, a strict ``ReduceLROnPlateau``
monitor that was never logged, ``dataloader_idx`` in evaluation and prediction hooks, a manual
``training_step``'s output, ``logger=`` objects that are no loggers; the warnings for
``predict_step`` returning None, an ``IterableDataset`` with ``__len__`` and ``max_epochs``
left unset."""

import sys
import threading
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
from lightning_modules import DATA, QUIET, Classifier, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)


def _raised(run) -> list:
    """For each trainer class, the exception ``run(cls)`` raises."""
    seen = []
    for trainer_cls in BOTH:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(BaseException) as info:
                run(trainer_cls)
        seen.append(info.value)
    return seen


def _same_error(run, kind=MisconfigurationException):
    theirs, ours = _raised(run)
    assert isinstance(theirs, kind) and isinstance(ours, kind), (theirs, ours)
    assert str(ours) == str(theirs)
    return ours


def _fit(module_cls, **kwargs):
    def run(trainer_cls):
        trainer_cls(**{**QUIET, "max_epochs": 1, **kwargs}).fit(module_cls(), train_loader(), val_loader())

    return run


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_epochs=-2),
        dict(max_steps=-5),
        dict(limit_val_batches=-1),
        dict(val_check_interval=-1),
        dict(val_check_interval=1.5),
        dict(gradient_clip_algorithm="l2"),
    ],
)
def test_bad_loop_settings_are_lightnings_misconfiguration(kwargs):
    _same_error(lambda cls: cls(**{**QUIET, **kwargs}))


@pytest.mark.parametrize("limit", ["limit_train_batches", "limit_val_batches"])
def test_a_float_limit_of_1e50_is_accepted_as_in_lightning(limit):
    trainers = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1, limit: 1e50})
        trainer.fit(Classifier(), train_loader(), val_loader())
        trainers.append(trainer)
    theirs, ours = trainers
    assert ours.global_step == theirs.global_step == 6
    assert ours.num_val_batches == theirs.num_val_batches == [4]


def test_a_val_check_interval_of_1e50_batches_is_lightnings_error_after_the_sanity_check():
    ours = _same_error(_fit(Classifier, val_check_interval=1e50), ValueError)
    assert "must be less than or equal to the number of the training batches (6)" in str(ours)


class LogsInOnTrainEnd(Classifier):
    def on_train_end(self):
        self.log("x", 1.0)


class LogsInCheckpointHook(Classifier):
    def on_save_checkpoint(self, checkpoint):
        self.log("x", 1.0)


def test_self_log_in_hooks_that_forbid_it_is_lightnings_error(tmp_path):
    _same_error(_fit(LogsInOnTrainEnd))
    _same_error(_fit(LogsInCheckpointHook, enable_checkpointing=True, callbacks=[ModelCheckpoint(tmp_path)]))


class ChangesProgBar(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("changing", loss, prog_bar=batch_idx == 1)
        return loss


class ChangesOnStep(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("changing", loss, on_step=batch_idx == 0)
        return loss


class ChangesBetweenLoaders(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("v", batch[0].sum(), reduce_fx="max" if batch_idx else "sum", add_dataloader_idx=True)


def test_one_key_logged_with_different_options_is_lightnings_error():
    ours = _same_error(_fit(ChangesProgBar))
    assert "twice in `training_step` with different arguments" in str(ours)
    # on_step=False in training_step leaves neither on_step nor on_epoch: Lightning's error first
    ours = _same_error(_fit(ChangesOnStep))
    assert "is not useful" in str(ours)
    ours = _same_error(lambda cls: cls(**QUIET).validate(ChangesBetweenLoaders(), [val_loader(), val_loader()]))
    assert "twice in `validation_step.0`" in str(ours)


class Manual(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class ManualReturnsText(Manual):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return "done"


class ManualReturnsList(Manual):
    def training_step(self, batch, batch_idx):
        return [super().training_step(batch, batch_idx)]


def test_manual_optimization_with_clipping_or_accumulation_is_lightnings_error():
    ours = _same_error(_fit(Manual, gradient_clip_val=0.5))
    assert "Automatic gradient clipping is not supported" in str(ours)
    ours = _same_error(_fit(Manual, accumulate_grad_batches=2))
    assert "Automatic gradient accumulation is not supported" in str(ours)


@pytest.mark.parametrize("module_cls", [ManualReturnsText, ManualReturnsList])
def test_an_invalid_manual_training_step_output_is_lightnings_error(module_cls):
    ours = _same_error(_fit(module_cls))
    assert "In manual optimization, `training_step` must either return a Tensor" in str(ours)


class ManualReturnsDict(Manual):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "extra": batch_idx}


class SeesOutputs(L.Callback):
    def __init__(self):
        self.outputs = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.outputs.append((outputs["extra"], outputs["loss"].requires_grad))


def test_a_manual_training_step_returning_a_dict_reaches_the_callbacks_as_in_lightning():
    seen = []
    for trainer_cls in BOTH:
        callback = SeesOutputs()
        trainer_cls(**{**QUIET, "max_epochs": 1, "callbacks": [callback]}).fit(ManualReturnsDict(), train_loader())
        seen.append(callback.outputs)
    assert seen[0] == seen[1] == [(i, False) for i in range(6)]


class MissingPlateauMonitor(Classifier):
    strict = True

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "missing", "strict": self.strict}}


class LaxPlateauMonitor(MissingPlateauMonitor):
    strict = False


def test_a_strict_plateau_monitor_never_logged_is_lightnings_error_and_lax_its_warning():
    ours = _same_error(_fit(MissingPlateauMonitor))
    assert "ReduceLROnPlateau conditioned on metric missing" in str(ours)
    said = []
    for trainer_cls in BOTH:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer_cls(**{**QUIET, "max_epochs": 2}).fit(LaxPlateauMonitor(), train_loader(), val_loader())
        said.append([(w.category, str(w.message)) for w in caught if "ReduceLROnPlateau" in str(w.message)])
    assert said[0] == said[1] and len(said[1]) == 2
    assert said[1][0][0] is RuntimeWarning


class StepTakesIndex(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx):
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx, dataloader_idx):
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx, dataloader_idx):
        return super().predict_step(batch, batch_idx)


class HookTakesIndex(Classifier):
    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx):
        pass


@pytest.mark.parametrize(
    "run",
    [
        lambda cls: cls(**QUIET).validate(StepTakesIndex(), val_loader()),
        lambda cls: cls(**QUIET).test(StepTakesIndex(), val_loader()),
        lambda cls: cls(**QUIET).predict(StepTakesIndex(), val_loader()),
        lambda cls: cls(**QUIET, max_epochs=1).fit(HookTakesIndex(), train_loader(), val_loader()),
        lambda cls: cls(**QUIET).validate(Classifier(), [val_loader(), val_loader()]),
        lambda cls: cls(**QUIET).predict(Classifier(), [val_loader(), val_loader()]),
    ],
    ids=["validate", "test", "predict", "fit-hook", "validate-several", "predict-several"],
)
def test_a_dataloader_idx_that_cannot_be_passed_is_lightnings_error(run):
    ours = _same_error(run, RuntimeError)
    assert "dataloader_idx" in str(ours)


class _Indexable:
    """Neither a Logger nor iterable (collections.abc), but indexable without end: list() of it
    would never return."""

    def __getitem__(self, index):
        return index


@pytest.mark.parametrize("make", [object, _Indexable, lambda: 5], ids=["object", "indexable", "int"])
def test_a_logger_that_is_no_logger_fails_as_in_lightning_and_never_loops(make):
    outcome = {}

    def run():
        outcome["errors"] = _raised(lambda cls: cls(**{**QUIET, "logger": make(), "max_epochs": 1}).fit(
            Classifier(), train_loader()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "a logger argument made the trainer loop"
    theirs, ours = outcome["errors"]
    assert type(ours) is type(theirs) is AttributeError
    assert str(ours) == str(theirs)


class DuckLogger:
    """A logger by duck typing (not a Lightning Logger subclass): Lightning takes it as it is."""

    name, version, save_dir, log_dir = "duck", 0, None, None

    def __init__(self):
        self.steps = []

    @property
    def experiment(self):
        return None

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_graph(self, model, input_array=None):
        pass

    def log_metrics(self, metrics, step=None):
        self.steps.append(step)

    def save(self):
        pass

    def finalize(self, status):
        self.status = status


def test_a_duck_typed_logger_gets_metrics_as_in_lightning():
    seen = []
    for trainer_cls in BOTH:
        logger = DuckLogger()
        options = {**QUIET, "logger": logger, "max_epochs": 2, "log_every_n_steps": 2}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer_cls(**options).fit(Classifier(), train_loader(), val_loader())
        seen.append((logger.steps, logger.status))
    assert seen[0] == seen[1] and seen[1][1] == "success" and seen[1][0]


def _warned(run, fragment: str) -> list:
    seen = []
    for trainer_cls in BOTH:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(trainer_cls)
        seen.append(sorted({str(w.message) for w in caught if fragment in str(w.message)}))
    return seen


class SizedStream(IterableDataset):
    def __iter__(self):
        return iter(DATA)

    def __len__(self):
        return len(DATA)


def test_an_iterable_dataset_with_a_length_warns_like_lightning():
    def run(trainer_cls):
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1})
        trainer.fit(Classifier(), DataLoader(SizedStream(), batch_size=8), val_loader())
        trainer.predict(Classifier(), DataLoader(SizedStream(), batch_size=8))

    lightning_said, ours = _warned(run, "has `__len__` defined")
    assert ours == lightning_said and len(ours) == 1


class PredictsNothing(Classifier):
    def predict_step(self, batch, batch_idx):
        return None


def test_predict_returning_none_and_max_epochs_unset_warn_like_lightning():
    lightning_said, ours = _warned(lambda cls: cls(**QUIET).predict(PredictsNothing(), val_loader()), "returned None")
    assert ours == lightning_said and len(ours) == 1

    class StopAfterOneEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = True

    def unset(trainer_cls):
        trainer_cls(**QUIET, callbacks=[StopAfterOneEpoch()]).fit(Classifier(), train_loader())

    lightning_said, ours = _warned(unset, "`max_epochs` was not set")
    assert ours == lightning_said and len(ours) == 1


@pytest.mark.parametrize("value", [(1, 2), "1.0", [0.5]])
def test_a_gradient_clip_value_that_is_no_number_is_lightnings_type_error(value):
    _same_error(lambda trainer_cls: trainer_cls(**QUIET, gradient_clip_val=value), kind=TypeError)


class NoData(Classifier):
    """Defines steps but no dataloader hook."""

    def test_step(self, batch, batch_idx):
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


@pytest.mark.parametrize("run, argument", [("fit", "train_dataloaders"), ("validate", "dataloaders"),
                                           ("test", "dataloaders"), ("predict", "dataloaders")])
@pytest.mark.parametrize("data", [None, object(), [train_loader, object()]])
def test_data_a_run_cannot_iterate_is_lightnings_type_error(run, argument, data):
    """Something that cannot be iterated (alone or in a list), given to the run or returned by its
    hook, and no hook at all: Lightning's TypeError and words; nothing given and LightningModule's
    own hook: the MisconfigurationException that hook raises. Each is a ValueError too (what
    fasttrain raised before)."""
    passed = [d() if callable(d) else d for d in data] if isinstance(data, list) else data

    def given(trainer_cls):
        getattr(trainer_cls(**{**QUIET, "max_epochs": 1}), run)(NoData(), **{argument: passed})

    # nothing at all: LightningModule's own hook raises Lightning's MisconfigurationException
    ours = _same_error(given, kind=MisconfigurationException if data is None else TypeError)
    assert isinstance(ours, ValueError)
    hook = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}[run] + "_dataloader"
    if data is None:
        def no_hook(trainer_cls):
            module = NoData()
            setattr(module, hook, None)  # no hook at all, as Lightning's own test sets it
            getattr(trainer_cls(**{**QUIET, "max_epochs": 1}), run)(module)

        _same_error(no_hook, kind=TypeError)

    def returned(trainer_cls):
        module = NoData()
        setattr(module, hook, lambda: passed)
        getattr(trainer_cls(**{**QUIET, "max_epochs": 1}), run)(module)

    _same_error(returned, kind=TypeError)
