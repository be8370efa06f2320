"""Checkpoint behaviour compared with lightning.Trainer: validate/test/predict without a model
after fit load the best checkpoint (with Lightning's warning) and set trainer.ckpt_path;
ckpt_path="last" without a last checkpoint warns and starts fresh, and finds last.ckpt in the
checkpoint folder that another trainer wrote; an unpicklable hyperparameter is dropped with a
warning; torch.save(trainer) works after fit; the errors for a missing or wrong model."""

import io
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, assert_same_results, assert_same_weights, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)
KWARGS = {k: v for k, v in QUIET.items() if k != "enable_checkpointing"}


def _fitted(trainer_cls, folder, epochs=4, **callback_kwargs):
    torch.manual_seed(0)
    module = Classifier(lr=0.3)  # a large step, so the best epoch is not the last
    torch.manual_seed(1)
    callback = ModelCheckpoint(dirpath=folder, monitor="val_loss", **callback_kwargs)
    trainer = trainer_cls(max_epochs=epochs, callbacks=[callback], **KWARGS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_loader(), val_loader())
    return trainer, module


@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_a_run_without_a_model_after_fit_loads_the_best_checkpoint_like_lightning(tmp_path, call):
    results = []
    for trainer_cls in BOTH:
        folder = tmp_path / trainer_cls.__module__
        trainer, module = _fitted(trainer_cls, folder)
        best = trainer.checkpoint_callback.best_model_path
        assert best and best != trainer.checkpoint_callback.last_model_path
        with pytest.warns(UserWarning, match=rf"`.{call}\(ckpt_path=None\)` was called without a model. The best"):
            if call == "predict":
                out = torch.cat(trainer.predict(dataloaders=val_loader()))
            else:
                out = getattr(trainer, call)(dataloaders=val_loader(), verbose=False)
        assert trainer.ckpt_path == best
        results.append((out, Path(best).name))
    (theirs, their_best), (ours, our_best) = results
    assert our_best == their_best
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs)
    else:
        assert_same_results(theirs, ours)


def test_ckpt_path_last_without_a_last_checkpoint_warns_and_starts_fresh(tmp_path):
    modules = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        module = Classifier()
        torch.manual_seed(1)
        trainer = trainer_cls(max_epochs=2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "none")], **KWARGS)
        with pytest.warns(UserWarning, match=r'ckpt_path="last"\) is set, but there is no last checkpoint available'):
            trainer.fit(module, train_loader(), ckpt_path="last")
        assert trainer.global_step == 12 and trainer.ckpt_path is None
        modules.append(module)
    assert_same_weights(*modules)


def test_ckpt_path_last_finds_the_last_checkpoint_another_trainer_wrote(tmp_path):
    modules = []
    for trainer_cls in BOTH:
        folder = tmp_path / trainer_cls.__module__
        _fitted(trainer_cls, folder, epochs=2, save_last=True)
        torch.manual_seed(0)
        module = Classifier(lr=0.3)
        torch.manual_seed(2)
        # this trainer's checkpoint callback does not save a last checkpoint itself
        trainer = trainer_cls(max_epochs=3, callbacks=[ModelCheckpoint(dirpath=folder, monitor="val_loss")], **KWARGS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader(), val_loader(), ckpt_path="last")
        assert Path(trainer.ckpt_path) == folder / "last.ckpt"
        assert trainer.global_step == 18 and trainer.current_epoch == 3
        modules.append(module)
    assert_same_weights(*modules)


class WithFunction(Classifier):
    def __init__(self, transform=lambda x: x * 2, lr=0.05):
        super().__init__(lr=lr)
        self.save_hyperparameters()


def test_an_unpicklable_hyperparameter_is_dropped_with_lightnings_warning(tmp_path):
    saved = []
    for trainer_cls in BOTH:
        module = WithFunction()
        trainer = trainer_cls(max_epochs=1, **QUIET)
        with pytest.warns(UserWarning, match="Attribute 'transform' removed from hparams because it cannot be pickled"):
            trainer.fit(module, train_loader())
        path = tmp_path / f"{trainer_cls.__module__}.ckpt"
        trainer.save_checkpoint(path)
        saved.append(torch.load(path, weights_only=False)["hyper_parameters"])
    assert saved[0] == saved[1] == {"features": 6, "classes": 3, "lr": 0.05}


def test_torch_save_of_a_fitted_trainer_works_like_lightning():
    for trainer_cls in BOTH:
        trainer = trainer_cls(max_epochs=1, **QUIET)
        module = Classifier()
        trainer.fit(module, train_loader(), val_loader())
        buffer = io.BytesIO()
        torch.save(trainer, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert loaded.global_step == 6
        assert_same_weights(module, loaded.lightning_module)
        assert loaded.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)
        assert len(loaded.strategy._lightning_optimizers) == 1


@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_errors_for_a_missing_or_wrong_model_are_lightnings(call):
    for trainer_cls in BOTH:
        with pytest.raises(TypeError, match=rf"`Trainer.{call}\(\)` requires a `LightningModule` when it hasn't"):
            getattr(trainer_cls(**QUIET), call)(dataloaders=val_loader())
        with pytest.raises(TypeError, match="`model` must be a `LightningModule` or `torch._dynamo.OptimizedModule`"):
            getattr(trainer_cls(**QUIET), call)(torch.nn.Linear(2, 2), val_loader())


class _Adapted(Classifier):
    """A module whose checkpoints keep only its trainable part (as adapter fine-tuning saves):
    the frozen first layer is left out of ``state_dict`` at saving."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net[0].requires_grad_(False)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("net.0.")}


@pytest.mark.parametrize("call", ["fit", "validate"])
def test_strict_loading_false_loads_a_partial_checkpoint_as_lightning(tmp_path, call):
    """LightningModule.strict_loading = False: the checkpoint's weights are loaded with
    strict=False, on resuming a fit and for an evaluation; the keys it lacks keep the module's."""
    modules = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        first = _Adapted()
        trainer = trainer_cls(max_epochs=1, **QUIET)
        trainer.fit(first, train_loader())
        path = tmp_path / f"{trainer_cls.__module__.split('.')[0]}.ckpt"
        trainer.save_checkpoint(path)
        torch.manual_seed(3)  # another first layer: the checkpoint has none to load
        module = _Adapted()
        module.strict_loading = False
        again = trainer_cls(max_epochs=2, **QUIET)
        torch.manual_seed(1)
        if call == "fit":
            again.fit(module, train_loader(), ckpt_path=path)
        else:
            again.validate(module, val_loader(), ckpt_path=path, verbose=False)
        modules.append(module)
        strict = _Adapted()
        with pytest.raises(RuntimeError, match="Missing key"):  # the default: strict loading
            trainer_cls(max_epochs=2, **QUIET).fit(strict, train_loader(), ckpt_path=path)
    assert_same_weights(*modules)
    torch.manual_seed(3)
    assert torch.equal(modules[1].net[0].weight, _Adapted().net[0].weight)


class _Threshold(L.Callback):
    """State a training run computes and an evaluation uses (a decision threshold, say), kept in
    the checkpoint through the callback's state_dict."""

    def __init__(self):
        self.threshold = 0.0
        self.loaded = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.threshold = float(trainer.current_epoch + 1) / 4

    def state_dict(self):
        return {"threshold": self.threshold}

    def load_state_dict(self, state):
        self.loaded.append(("state", state["threshold"], str(type(self).__name__)))
        self.threshold = state["threshold"]

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.loaded.append(("hook", trainer.state.fn.value, pl_module.training))


class _StatefulData(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.restored = None

    def val_dataloader(self):
        return val_loader()

    def test_dataloader(self):
        return val_loader()

    def predict_dataloader(self):
        return val_loader()

    def state_dict(self):
        return {"seen": 7}

    def load_state_dict(self, state):
        self.restored = state


@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_an_evaluation_from_a_checkpoint_restores_callbacks_and_datamodule_as_lightning(tmp_path, call):
    seen = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)
        trainer = trainer_cls(max_epochs=2, callbacks=[_Threshold()], **QUIET)
        trainer.fit(Classifier(), train_loader())
        path = tmp_path / f"{trainer_cls.__module__.split('.')[0]}.ckpt"
        trainer.save_checkpoint(path)
        checkpoint = torch.load(path, weights_only=True)
        checkpoint[_StatefulData.__qualname__] = {"seen": 7}
        torch.save(checkpoint, path)
        callback, data = _Threshold(), _StatefulData()
        evaluating = trainer_cls(callbacks=[callback], **QUIET)
        kwargs = {"verbose": False} if call != "predict" else {}
        getattr(evaluating, call)(Classifier(), datamodule=data, ckpt_path=path, **kwargs)
        seen.append((callback.threshold, callback.loaded, data.restored))
    assert seen[1] == seen[0]
    assert seen[0][0] == 0.5 and seen[0][2] == {"seen": 7}
