"""Module modes and the sanity check: fasttrain.lightning.Trainer keeps each submodule's
train/eval mode as lightning.Trainer does, and the sanity check is not a validation run for
ModelCheckpoint."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_modules import VAL, Classifier, assert_same_weights, loader, train_loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class FrozenBackbone(Classifier):
    """A BatchNorm backbone the user froze in eval mode; a head that trains."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.5))
        self.backbone.eval()
        self.backbone.requires_grad_(False)
        self.modes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.modes.append(tuple(m.training for m in self.modules()))
        return F.cross_entropy(self(self.backbone(x)), y)


def test_fit_keeps_each_submodule_mode_like_lightning():
    def action(trainer):
        module = FrozenBackbone()
        trainer.fit(module, train_loader(), loader(VAL, batch_size=10))
        return module

    out = run_both(action, max_epochs=2)
    reference, ours = out["lightning"], out["fasttrain"]
    # the backbone (Sequential, BatchNorm, Dropout) stays in eval mode under Lightning, the rest trains
    assert set(reference.modes) == {(True, True, True, True, True, False, False, False, False)}
    assert ours.modes == reference.modes
    assert [m.training for m in ours.modules()] == [m.training for m in reference.modules()]
    # the eval-mode BatchNorm kept its running statistics; the weights are the same
    assert torch.equal(ours.backbone[1].running_mean, torch.zeros(6))
    assert_same_weights(reference, ours)


def test_a_module_left_in_eval_mode_stays_there_like_lightning():
    def action(trainer):
        module = FrozenBackbone()
        module.eval()
        trainer.fit(module, train_loader())
        return module

    out = run_both(action, max_epochs=1)
    assert set(out["lightning"].modes) == {(False,) * 9}
    assert out["fasttrain"].modes == out["lightning"].modes


class ValOnlyLoss(Classifier):
    """Logs its monitored value only in validation_step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_the_sanity_check_is_not_a_validation_run_for_model_checkpoint_like_lightning(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint, model_checkpoint

    def action(trainer):
        model_checkpoint.warning_cache.clear()  # Lightning warns once per process
        name = type(trainer).__module__.split(".")[0]
        checkpoint = ModelCheckpoint(dirpath=tmp_path / name, monitor="val_loss", save_top_k=2,
                                     save_on_train_epoch_end=True)
        trainer.callbacks.append(checkpoint)
        with pytest.warns(UserWarning, match="could not find the monitored key"):
            trainer.fit(ValOnlyLoss(), train_loader(), loader(VAL, batch_size=10))
        return sorted(p.name for p in (tmp_path / name).iterdir()), trainer.fit_loop.epoch_loop.val_loop._has_run

    out = run_both(action, max_epochs=3, check_val_every_n_epoch=2, num_sanity_val_steps=2)
    # epoch 0 ends before any validation but after the sanity check: warned, not raised
    assert out["lightning"] == (["epoch=1-step=12.ckpt", "epoch=2-step=18.ckpt"], True)
    assert out["fasttrain"] == out["lightning"]
