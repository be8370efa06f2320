"""validate/test/predict, a DataModule, Lightning's built-in callbacks and Lightning-format
checkpoints read and written both ways."""

import csv

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    VAL,
    Classifier,
    ScheduledClassifier,
    assert_same_weights,
    loader,
    train_loader,
)


class DataModule(L.LightningDataModule):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self):
        return train_loader()

    def val_dataloader(self):
        return loader(VAL, batch_size=5)

    def test_dataloader(self):
        return loader(VAL, batch_size=4)

    def predict_dataloader(self):
        return loader(VAL, batch_size=7)

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")


def _both(fn):
    """Run ``fn(trainer_cls)`` for both trainers from one seed."""
    out = []
    for trainer_cls in (L.Trainer, Trainer):
        torch.manual_seed(0)
        out.append(fn(trainer_cls))
    return out


def test_datamodule_fit_validate_test_predict_match_lightning():
    def run(trainer_cls):
        calls = []
        dm = DataModule(calls)
        module = Classifier()
        trainer = trainer_cls(max_epochs=2, **QUIET)
        trainer.fit(module, datamodule=dm)
        validated = trainer.validate(module, datamodule=dm)
        tested = trainer.test(module, datamodule=dm)
        predicted = trainer.predict(module, datamodule=dm)
        return module, validated, tested, predicted, calls

    (lm, lval, ltest, lpred, lcalls), (fm, fval, ftest, fpred, fcalls) = _both(run)
    assert_same_weights(lm, fm)
    assert fcalls == lcalls
    assert list(fval[0]) == list(lval[0]) == ["val_loss", "val_acc"]
    for ours, reference in ((fval, lval), (ftest, ltest)):
        assert len(ours) == len(reference) == 1
        for key, value in reference[0].items():
            assert ours[0][key] == pytest.approx(value, abs=1e-6)
    assert len(fpred) == len(lpred) == 3
    for ours, reference in zip(fpred, lpred):
        assert torch.equal(ours, reference)


def test_several_validation_loaders_are_suffixed_like_lightning():
    loaders = lambda: [loader(VAL, batch_size=5), loader(DATA, batch_size=16)]  # noqa: E731

    class TwoLoaders(Classifier):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            super().validation_step(batch, batch_idx)

    def run(trainer_cls):
        module = TwoLoaders()
        trainer = trainer_cls(**QUIET)
        return trainer.validate(module, loaders()), dict(trainer.callback_metrics)

    (lres, lmetrics), (fres, fmetrics) = _both(run)
    assert [sorted(r) for r in fres] == [sorted(r) for r in lres]
    assert sorted(fmetrics) == sorted(lmetrics)
    for key in lmetrics:
        assert float(fmetrics[key]) == pytest.approx(float(lmetrics[key]), abs=1e-6)


def test_callbacks_checkpoints_and_early_stopping(tmp_path):
    def run(trainer_cls):
        root = tmp_path / trainer_cls.__module__.split(".")[0]
        checkpoint = ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", mode="min", save_top_k=2,
                                     save_last=True)
        steps = ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=4, save_top_k=-1)
        stop = EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.5)
        monitor = LearningRateMonitor(logging_interval="step")
        module = ScheduledClassifier()
        trainer = trainer_cls(max_epochs=6, callbacks=[checkpoint, steps, stop, monitor], default_root_dir=root,
                              logger=CSVLogger(root, name="csv", version=0), log_every_n_steps=2,
                              enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, train_loader(), loader(VAL, batch_size=5))
        saved = sorted(p.name for p in (root / "ckpt").iterdir())
        step_files = sorted(p.name for p in (root / "steps").iterdir())
        with open(root / "csv" / "version_0" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        return module, trainer, checkpoint, saved, step_files, rows

    (lm, lt, lck, lsaved, lsteps, lrows), (fm, ft, fck, fsaved, fsteps, frows) = _both(run)
    assert ft.current_epoch == lt.current_epoch < 6  # early stopping ended both runs at the same epoch
    assert ft.should_stop and lt.should_stop
    assert_same_weights(lm, fm)
    assert fsaved == lsaved and "last.ckpt" in fsaved
    assert fsteps == lsteps
    assert fck.best_model_score == pytest.approx(float(lck.best_model_score), abs=1e-6)
    # the loggers got the same rows: per-step values every 2 steps, the learning rate, epoch values
    assert len(frows) == len(lrows) > 10
    assert any(row["lr-SGD"] for row in frows)
    for ours, theirs in zip(frows, lrows):
        assert set(ours) == set(theirs)
        for key in theirs:
            if theirs[key] == "":
                assert ours[key] == "", key
            else:
                assert float(ours[key]) == pytest.approx(float(theirs[key]), abs=1e-5), key
    # a fasttrain checkpoint loads in Lightning, with its hyperparameters and the same keys
    ours = torch.load(fck.best_model_path, weights_only=False)
    theirs = torch.load(lck.best_model_path, weights_only=False)
    assert set(ours) == set(theirs)
    assert ours["epoch"] == theirs["epoch"] and ours["global_step"] == theirs["global_step"]
    restored = Classifier.load_from_checkpoint(fck.best_model_path)
    assert_same_weights(Classifier.load_from_checkpoint(lck.best_model_path), restored)
    # validate(ckpt_path="best") evaluates the best checkpoint's weights, as Lightning's does
    best_ours = ft.validate(fm, loader(VAL, batch_size=5), ckpt_path="best")
    best_theirs = lt.validate(lm, loader(VAL, batch_size=5), ckpt_path="best")
    assert best_ours[0]["val_loss"] == pytest.approx(best_theirs[0]["val_loss"], abs=1e-6)
    assert best_ours[0]["val_loss"] == pytest.approx(float(lck.best_model_score), abs=1e-6)


def _in_order():
    return loader(DATA, batch_size=8)


def _same_initial_weights():
    """Two ScheduledClassifiers with the same weights, from seed 0: an uninterrupted run's and
    the first part of an interrupted one's."""
    torch.manual_seed(0)
    reference = ScheduledClassifier()
    first = ScheduledClassifier()
    first.load_state_dict(reference.state_dict())
    return reference, first


@pytest.mark.parametrize("writer, reader", [("fasttrain", "lightning"), ("lightning", "fasttrain")])
def test_resume_across_trainers_matches_an_uninterrupted_run(tmp_path, writer, reader):
    """Train 2 epochs with one trainer, save; resume for 2 more with the other: the same weights
    as 4 epochs in one go (step schedulers and optimizer state included)."""
    classes = {"fasttrain": Trainer, "lightning": L.Trainer}
    reference, first = _same_initial_weights()
    L.Trainer(max_epochs=4, **QUIET).fit(reference, _in_order())

    trainer = classes[writer](max_epochs=4, **QUIET)
    # estimated_stepping_batches (the OneCycle length) must agree: stop after 2 of the 4 epochs
    stopper = _StopAfter(2)
    trainer.callbacks.append(stopper)
    trainer.fit(first, _in_order())
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)

    resumed = ScheduledClassifier()
    second = classes[reader](max_epochs=4, **QUIET)
    second.fit(resumed, _in_order(), ckpt_path=path)
    assert second.global_step == 24
    assert_same_weights(reference, resumed)


class _StopAfter(L.Callback):
    def __init__(self, epochs):
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


def test_mid_epoch_checkpoint_resumes_like_lightning(tmp_path):
    """A checkpoint written by ModelCheckpoint(every_n_train_steps=4) in the middle of an epoch of
    6 batches resumes at batch index 4 of that epoch on a fresh iterator of the loader, as
    Lightning resumes it: both trainers end with the same weights and step count."""
    _, first = _same_initial_weights()
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    Trainer(max_epochs=2, callbacks=[every], enable_progress_bar=False, enable_model_summary=False,
            logger=False).fit(first, _in_order())
    path = tmp_path / "step=4.ckpt"
    assert torch.load(path, weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"][
        "processed"] == 4
    resumed = {}
    for trainer_cls in (L.Trainer, Trainer):
        module = resumed[trainer_cls] = ScheduledClassifier()
        trainer = trainer_cls(max_epochs=2, **QUIET)
        trainer.fit(module, _in_order(), ckpt_path=path)
        assert trainer.global_step == 12
    assert_same_weights(resumed[L.Trainer], resumed[Trainer])


def test_default_arguments_write_the_same_files_as_lightning(tmp_path):
    """With Lightning's defaults (TensorBoard logger, a ModelCheckpoint, model summary), both
    trainers write the same files under default_root_dir."""

    def run(trainer_cls):
        root = tmp_path / trainer_cls.__module__.split(".")[0]
        trainer = trainer_cls(max_epochs=2, default_root_dir=root, enable_progress_bar=False)
        trainer.fit(Classifier(), loader(DATA, batch_size=8), loader(VAL, batch_size=5))
        return sorted(str(p.relative_to(root).parent / (p.name if "tfevents" not in p.name else "events"))
                      for p in root.rglob("*") if p.is_file())

    lightning_files, fasttrain_files = _both(run)
    assert "lightning_logs/version_0/checkpoints/epoch=1-step=12.ckpt" in fasttrain_files
    assert fasttrain_files == lightning_files
