"""validate() and test() print Lightning's results table at their end (verbose=True, the
default), the same table lightning.Trainer prints; verbose=False prints none, nor does a fit's
validation."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch.nn.functional as F  # noqa: E402
from lightning_modules import VAL, Classifier, loader, train_loader, val_loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


def _printed(capsys, action, **trainer_kwargs):
    """What ``action(trainer)`` printed under each trainer (run one after the other)."""
    printed = {}

    def run(trainer):
        capsys.readouterr()
        action(trainer)
        return capsys.readouterr().out

    for name, result in run_both(run, **trainer_kwargs).items():
        if isinstance(result, BaseException):
            raise result
        printed[name] = result
    return printed["lightning"], printed["fasttrain"]


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_the_results_table_is_lightnings(capsys, stage):
    reference, ours = _printed(capsys, lambda trainer: getattr(trainer, stage)(Classifier(), val_loader()))
    title = "Validate metric" if stage == "validate" else "Test metric"
    assert title in reference and "DataLoader 0" in reference
    assert ours == reference


class TwoLoaders(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        if dataloader_idx == 1:
            self.log("second_only", self(x).mean())


def test_the_table_of_two_loaders_is_lightnings(capsys):
    loaders = [val_loader(), loader(VAL, batch_size=7)]
    reference, ours = _printed(capsys, lambda trainer: trainer.validate(TwoLoaders(), loaders))
    assert "DataLoader 1" in reference
    assert ours == reference


def test_no_table_with_verbose_false_nor_in_a_fit(capsys):
    def runs(trainer):
        module = Classifier()
        trainer.validate(module, val_loader(), verbose=False)
        trainer.test(module, val_loader(), verbose=False)
        trainer.fit(module, train_loader(), val_loader())

    reference, ours = _printed(capsys, runs, max_epochs=1)
    assert "metric" not in reference
    assert ours == reference == ""
