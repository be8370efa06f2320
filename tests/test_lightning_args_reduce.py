"""``self.log(..., reduce_fx=...)`` in every form Lightning accepts (its strings in any case,
``"avg"``, torch's and Python's ``mean``/``max``/``min``/``sum`` callables), compared under
lightning.Trainer and fasttrain.lightning.Trainer; the forms it refuses give its error; Python's
builtins reduce on the device (no more host reads than the strings)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, assert_same_metrics, fit_both, train_loader, val_loader  # noqa: E402

ACCEPTED = {
    "mean": "mean", "MEAN": "MEAN", "avg": "avg", "Avg": "Avg", "max": "max", "Min": "Min", "sum": "sum",
    "t_mean": torch.mean, "t_max": torch.max, "t_min": torch.min, "t_sum": torch.sum,
    "b_max": max, "b_min": min, "b_sum": sum,
}


class LogsEveryReduction(Classifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        for name, reduce_fx in ACCEPTED.items():
            self.log(f"train_{name}", loss * (batch_idx + 1), on_step=True, on_epoch=True, reduce_fx=reduce_fx)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        for name, reduce_fx in ACCEPTED.items():
            self.log(f"val_{name}", loss - batch_idx, reduce_fx=reduce_fx)


def test_every_accepted_reduce_fx_gives_lightnings_values():
    lt, _, ft, _ = fit_both(LogsEveryReduction, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2))
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    assert len(ft.callback_metrics) == 3 * len(ACCEPTED) + len(ACCEPTED)  # x, x_step, x_epoch; val x


class LogsTwoSpellings(Classifier):
    """One key logged with two spellings Lightning reads as one reduction (no error there)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("twice", loss, reduce_fx="max" if batch_idx % 2 else torch.max)
        self.log("avg", loss, reduce_fx="avg" if batch_idx % 2 else "MEAN")
        return loss


def test_two_spellings_of_one_reduction_are_one_option_as_in_lightning():
    lt, _, ft, _ = fit_both(LogsTwoSpellings, train_loader, trainer_kwargs=dict(max_epochs=1))
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    assert "twice" in ft.callback_metrics


def _refused(reduce_fx, change_at=None):
    class Refused(Classifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            fx = reduce_fx if change_at is None or batch_idx == change_at else "max"
            self.log("refused", loss, reduce_fx=fx)
            return loss

    seen = []
    for trainer_cls in (L.Trainer, Trainer):
        with pytest.raises(MisconfigurationException) as info:
            trainer_cls(max_epochs=1, **QUIET).fit(Refused(), train_loader())
        seen.append(str(info.value))
    return seen


def _custom(values):
    return values.median()


@pytest.mark.parametrize("reduce_fx", ["median", "maximum", "", torch.median, _custom, len])
def test_a_reduction_lightning_refuses_is_its_error(reduce_fx):
    theirs, ours = _refused(reduce_fx)
    assert ours == theirs
    assert "Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported" in ours


def test_builtin_and_torch_max_logged_under_one_key_is_lightnings_error():
    # Lightning keeps Python's max apart from torch.max (and the string "max")
    theirs, ours = _refused(max, change_at=1)
    assert ours == theirs and "twice in `training_step` with different arguments" in ours


def _host_reads(sync_counter, reduce_fx) -> int:
    class Logs(Classifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("reduced", loss, on_step=False, on_epoch=True, reduce_fx=reduce_fx)
            return loss

    trainer = Trainer(max_epochs=2, log_every_n_steps=1000, **QUIET)
    module = Logs()
    before = sync_counter["n"]
    trainer.fit(module, train_loader())
    return sync_counter["n"] - before


@pytest.mark.parametrize("builtin, name", [(max, "max"), (min, "min"), (sum, "sum")])
def test_python_builtins_reduce_on_the_device(sync_counter, builtin, name):
    # max(a, b) of two tensors would read both on the host at every batch
    assert _host_reads(sync_counter, builtin) == _host_reads(sync_counter, name)
