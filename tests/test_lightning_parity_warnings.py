"""Lightning's warnings, each checked under lightning.Trainer and fasttrain.lightning.Trainer
with the same module and data: few dataloader workers, an epoch shorter than
log_every_n_steps, a validation loader without validation_step and the reverse, predict_step
returning None, submodules in eval mode at the start of a fit, a checkpoint holding states of
callbacks the trainer lacks."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import lightning.fabric.utilities.data as fabric_data  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)


def _warned(run, fragment: str) -> list:
    """For each trainer class, the warnings whose text holds ``fragment`` while ``run(cls)`` runs."""
    seen = []
    for trainer_cls in BOTH:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(trainer_cls)
        seen.append(sorted({str(w.message) for w in caught if fragment in str(w.message)}))
    return seen


def _fit(trainer_cls, module=None, val=True, **kwargs):
    options = {**QUIET, "max_epochs": 1, **kwargs}
    trainer = trainer_cls(**options)
    trainer.fit(module or Classifier(), train_loader(), val_loader() if val else None)
    return trainer


def test_few_dataloader_workers_warns_like_lightning(monkeypatch):
    monkeypatch.setattr(fabric_data, "_num_cpus_available", lambda: 8)
    lightning_said, ours = _warned(_fit, "does not have many workers")
    assert ours == lightning_said
    assert len(ours) == 2  # the training and the validation loader


def test_an_epoch_shorter_than_the_logging_interval_warns_like_lightning(tmp_path):
    def run(trainer_cls):
        _fit(trainer_cls, logger=CSVLogger(tmp_path))

    lightning_said, ours = _warned(run, "smaller than the logging interval")
    assert ours == lightning_said and len(ours) == 1


class NoValidationStep(Classifier):
    validation_step = L.LightningModule.validation_step


def test_validation_loader_without_step_and_the_reverse_warn_like_lightning():
    lightning_said, ours = _warned(lambda cls: _fit(cls, NoValidationStep()), "but have no `validation_step`")
    assert ours == lightning_said and len(ours) == 1
    lightning_said, ours = _warned(lambda cls: _fit(cls, val=False), "but have no `val_dataloader`")
    assert ours == lightning_said and len(ours) == 1


class PredictsNothing(Classifier):
    def predict_step(self, batch, batch_idx):
        return None


def test_predict_step_returning_none_warns_like_lightning():
    lightning_said, ours = _warned(lambda cls: cls(**QUIET).predict(PredictsNothing(), val_loader()), "returned None")
    assert ours == lightning_said and len(ours) == 1


def test_modules_in_eval_mode_at_fit_start_warn_like_lightning():
    def run(trainer_cls):
        module = Classifier()
        module.net[1].eval()
        _fit(trainer_cls, module)

    lightning_said, ours = _warned(run, "in eval mode at the start of training")
    assert ours == lightning_said and len(ours) == 1


def test_a_checkpoint_with_callbacks_the_trainer_lacks_warns_like_lightning(tmp_path):
    def run(trainer_cls):
        trainer = _fit(trainer_cls, callbacks=[EarlyStopping(monitor="val_loss")])
        path = tmp_path / f"{trainer_cls.__module__}.ckpt"
        trainer.save_checkpoint(path)
        resumed = trainer_cls(**{**QUIET, "max_epochs": 2})
        resumed.fit(Classifier(), train_loader(), val_loader(), ckpt_path=path, weights_only=False)

    lightning_said, ours = _warned(run, "Please add the following callbacks")
    assert ours == lightning_said and len(ours) == 1
