"""Lightning's checks and the exception types and messages it raises, compared under
lightning.Trainer and fasttrain.lightning.Trainer: two stateful callbacks with the same
state_key, self.log in a hook that may not log, a logged Metric whose compute() returns a
tuple, bad Trainer settings (MisconfigurationException, as Lightning raises)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torchmetrics  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, train_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)


def _raised(run) -> list:
    """For each trainer class, (the exception's type, its message) from ``run(cls)``."""
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(Exception) as info:
            run(trainer_cls)
        seen.append(info.value)
    return seen


class _Stateful(L.Callback):
    def state_dict(self):
        return {"n": 1}


def test_two_stateful_callbacks_with_one_state_key_are_lightnings_error():
    theirs, ours = _raised(lambda cls: cls(callbacks=[_Stateful(), _Stateful()], **QUIET))
    assert type(ours) is type(theirs) is RuntimeError
    assert str(ours) == str(theirs) and "state_key" in str(ours)


class LogsInOnFitStart(Classifier):
    def on_fit_start(self):
        self.log("x", 1.0)


def test_self_log_in_a_hook_that_may_not_log_is_lightnings_error():
    theirs, ours = _raised(lambda cls: cls(max_epochs=1, **QUIET).fit(LogsInOnFitStart(), train_loader()))
    assert isinstance(ours, MisconfigurationException) and type(ours) is type(theirs)
    assert str(ours) == str(theirs)


class _PairMetric(torchmetrics.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value):
        self.total += value.sum()

    def compute(self):
        return self.total, self.total


class LogsPairMetric(Classifier):
    def __init__(self):
        super().__init__()
        self.pair = _PairMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.pair(loss.detach())
        self.log("pair", self.pair, on_step=False, on_epoch=True)
        return loss


def test_a_metric_whose_compute_returns_a_tuple_is_lightnings_error():
    theirs, ours = _raised(lambda cls: cls(max_epochs=1, **QUIET).fit(LogsPairMetric(), train_loader()))
    assert type(ours) is type(theirs) is ValueError
    # the same words; the values found differ with the two modules' random initialisations
    assert str(ours).split("Found")[0] == str(theirs).split("Found")[0]
    assert "'pair' must be a tensor" in str(ours)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(limit_train_batches=1.5),
        dict(fast_dev_run=-1),
        dict(reload_dataloaders_every_n_epochs=-1),
        dict(check_val_every_n_epoch=None, val_check_interval=0.5),
        dict(enable_checkpointing=False, callbacks=[L.pytorch.callbacks.ModelCheckpoint()]),
    ],
)
def test_bad_trainer_settings_are_lightnings_misconfiguration(kwargs):
    theirs, ours = _raised(lambda cls: cls(**{**QUIET, **kwargs}))
    assert isinstance(theirs, MisconfigurationException) and isinstance(ours, MisconfigurationException)
    assert str(ours) == str(theirs)
