"""What a LightningModule or DataModule can ask of the trainer besides the loops: callbacks from
configure_callbacks, a DataModule's batch-transfer hooks, the Lightning callbacks fasttrain does
not run, accelerator and precision spellings, and how checkpoints are
loaded (safely by default, the loss scaler's state included)."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    EarlyStopping,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    ThroughputMonitor,
)

from fasttrain.checkpoint_files import CheckpointError  # noqa: E402
from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    QUIET,
    Classifier,
    assert_same_weights,
    fit_both,
    train_loader,
    val_loader,
)


# ---------------------------------------------------------------------------------- configure_callbacks
class _Seen(L.Callback):
    def __init__(self):
        self.validations = 0

    def on_validation_start(self, trainer, module):
        self.validations += 1


class ModuleCallbacks(Classifier):
    """Returns an EarlyStopping (replacing the trainer's, which would never stop), a checkpoint
    callback (which the merge moves last) and a callback of its own."""

    def configure_callbacks(self):
        self.seen = _Seen()
        root = Path(self.trainer.default_root_dir) / type(self.trainer).__module__.split(".")[0]
        return [
            ModelCheckpoint(dirpath=root, monitor="val_loss"),
            EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.5),
            self.seen,
        ]


def test_configure_callbacks_are_merged_like_lightning(tmp_path, caplog):
    never = EarlyStopping(monitor="val_loss", patience=100)
    caplog.set_level("INFO")
    lt, lm, ft, fm = fit_both(
        ModuleCallbacks, train_loader, val_loader,
        trainer_kwargs=dict(max_epochs=6, default_root_dir=tmp_path, callbacks=[never, _Seen()]),
    )
    # the module's EarlyStopping replaced the trainer's and stopped both runs at the same epoch
    assert ft.current_epoch == lt.current_epoch < 6
    assert ft.should_stop
    assert_same_weights(lm, fm)
    names = [type(cb).__name__ for cb in ft.callbacks]
    assert names == [type(cb).__name__ for cb in lt.callbacks] == ["EarlyStopping", "_Seen", "ModelCheckpoint"]
    assert never not in ft.callbacks and ft.early_stopping_callback.patience == 1
    assert fm.seen in ft.callbacks and fm.seen.validations == ft.current_epoch + 1  # the sanity check too
    assert ft.checkpoint_callback.best_model_path
    # Lightning's message naming the replaced classes, once from each trainer
    assert caplog.text.count("will override existing callbacks passed to Trainer: EarlyStopping, _Seen") == 2
    # validate() merges again: the new callbacks replace the ones of the fit and run
    ft.validate(fm, val_loader())
    assert fm.seen in ft.callbacks and fm.seen.validations == 1


# ---------------------------------------------------------------------------------- DataModule batch hooks
class HookedData(L.LightningDataModule):
    """Overrides on_before_batch_transfer (which the module overrides too: the DataModule's
    runs) and transfer_batch_to_device; records every batch hook that runs."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def train_dataloader(self):
        return train_loader()

    def val_dataloader(self):
        return val_loader()

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.calls.append("datamodule:on_before_batch_transfer")
        x, y = batch
        return x * 2.0, y

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append("datamodule:transfer_batch_to_device")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


class BatchHooked(Classifier):
    calls = None

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.calls.append("module:on_before_batch_transfer")
        return batch[0] * 100.0, batch[1]

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append("module:on_after_batch_transfer")
        x, y = batch
        return x + 1.0, y


def test_datamodule_batch_hooks_are_used_like_lightning():
    out = []
    for trainer_cls in (L.Trainer, Trainer):
        torch.manual_seed(0)
        calls = []
        module = BatchHooked()
        module.calls = calls
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer_cls(max_epochs=2, **QUIET).fit(module, datamodule=HookedData(calls))
        out.append((module, calls, [str(w.message) for w in caught]))
    (lm, lcalls, lwarnings), (fm, fcalls, fwarnings) = out
    assert_same_weights(lm, fm)
    assert fcalls == lcalls
    assert fcalls[:3] == ["datamodule:on_before_batch_transfer", "datamodule:transfer_batch_to_device",
                          "module:on_after_batch_transfer"]
    for message in ("overridden `on_before_batch_transfer` in both",
                    "overridden `on_after_batch_transfer` in `LightningModule` but have passed in a"):
        assert any(message in w for w in lwarnings)
        assert any(message in w for w in fwarnings)


# ---------------------------------------------------------------------------------- unsupported callbacks
@pytest.mark.parametrize("make, instead", [
    (lambda: GradientAccumulationScheduler({0: 1, 1: 2}), "accumulate_grad_batches"),
    (lambda: ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0]), "Callback of your own"),
])
def test_callbacks_fasttrain_cannot_run_are_errors_naming_them(make, instead):
    name = type(make()).__name__
    with pytest.raises(ValueError, match=f"{name}.*{instead}"):
        Trainer(max_epochs=1, callbacks=[make()], **QUIET)

    class Returning(Classifier):
        def configure_callbacks(self):
            return make()

    trainer = Trainer(max_epochs=1, **QUIET)
    with pytest.raises(ValueError, match=f"{name}.*{instead}"):
        trainer.fit(Returning(), train_loader())


# ---------------------------------------------------------------------------------- arguments
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_gpu_accelerator_without_cuda_is_an_error(accelerator):
    with pytest.raises(Exception):
        L.Trainer(accelerator=accelerator, **QUIET)
    with pytest.raises(ValueError, match=r"CUDA is not available.*accelerator='cpu'"):
        Trainer(accelerator=accelerator, **QUIET)


@pytest.mark.parametrize("precision, warns", [("bf16", True), (16, True), ("16", True), ("32", False), (32, False)])
def test_precision_aliases_like_lightning(precision, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(precision=precision, **QUIET)
    discouraged = [w for w in caught if "supported for historical reasons" in str(w.message)]
    assert len(discouraged) == (1 if warns else 0)
    assert discouraged == [] or discouraged[0].filename == __file__  # points at the caller
    expected = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true"}[str(precision)]
    if expected == "16-mixed" and not torch.cuda.is_available():
        expected = "bf16-mixed"  # fp16 on the CPU runs as bf16 (test_lightning_manual_precision.py)
    assert trainer.precision == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert L.Trainer(precision=precision, **QUIET).precision == expected


# ---------------------------------------------------------------------------------- loading checkpoints
UNPICKLED = []


def _record(what):
    UNPICKLED.append(what)


class _Arbitrary:
    """Unpickling it runs code (appends to UNPICKLED), as a malicious file's object would."""

    def __reduce__(self):
        return (_record, ("ran",))


def _saved(tmp_path, name="plain.ckpt", **kwargs):
    module = Classifier()
    trainer = Trainer(max_epochs=1, **QUIET, **kwargs)
    trainer.fit(module, train_loader())
    path = tmp_path / name
    trainer.save_checkpoint(path)
    return path, module


def test_checkpoints_load_safely_unless_weights_only_false(tmp_path):
    path, module = _saved(tmp_path)
    # save_hyperparameters() values and the callback states are plain: the default load reads them
    assert torch.load(path, weights_only=True)["hyper_parameters"] == {"features": 6, "classes": 3, "lr": 0.05}
    restored = Classifier()
    Trainer(max_epochs=2, **QUIET).fit(restored, train_loader(), ckpt_path=path)
    assert Trainer(**QUIET).validate(Classifier(), val_loader(), ckpt_path=path)

    unsafe = tmp_path / "unsafe.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["extra"] = _Arbitrary()
    torch.save(checkpoint, unsafe)
    with pytest.raises(Exception):
        L.Trainer(**QUIET).validate(Classifier(), val_loader(), ckpt_path=unsafe)
    for run in (
        lambda trainer, **kw: trainer.fit(Classifier(), train_loader(), ckpt_path=unsafe, **kw),
        lambda trainer, **kw: trainer.validate(Classifier(), val_loader(), ckpt_path=unsafe, **kw),
        lambda trainer, **kw: trainer.test(Classifier(), val_loader(), ckpt_path=unsafe, **kw),
        lambda trainer, **kw: trainer.predict(Classifier(), val_loader(), ckpt_path=unsafe, **kw),
    ):
        with pytest.raises(CheckpointError, match="only if\\) you trust the file, pass weights_only=False"):
            run(Trainer(max_epochs=2, **QUIET))
        with pytest.raises(CheckpointError):
            run(Trainer(max_epochs=2, **QUIET), weights_only=True)
    assert UNPICKLED == []
    # a trusted file: the caller says so
    trusted = Classifier()
    Trainer(**QUIET).predict(trusted, val_loader(), ckpt_path=unsafe, weights_only=False)
    assert UNPICKLED == ["ran"]
    assert_same_weights(module, trusted)


def test_the_loss_scaler_state_round_trips(tmp_path, monkeypatch):
    """The fp16 loss scaler (CUDA only, so a CPU scaler stands in for accelerate's here) is saved
    under Lightning's key and loaded back into the resumed fit's scaler."""
    saved_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    module = Classifier()
    trainer = Trainer(max_epochs=1, **QUIET)
    monkeypatch.setattr(trainer, "_scaler", lambda: saved_scaler)
    trainer.fit(module, train_loader())
    path = tmp_path / "scaled.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["MixedPrecision"]["scale"] == 1024.0

    resumed_scaler = torch.amp.GradScaler("cpu")
    resumed = Trainer(max_epochs=2, **QUIET)
    monkeypatch.setattr(resumed, "_scaler", lambda: resumed_scaler)
    resumed.fit(Classifier(), train_loader(), ckpt_path=path)
    assert resumed_scaler.state_dict() == saved_scaler.state_dict()
    assert resumed._scaler_state is None  # loaded once, not again at the next fit
