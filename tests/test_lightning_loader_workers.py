"""A run's end ends the worker processes its loaders keep between epochs
(``persistent_workers=True``), as lightning.Trainer's teardown does: after a fit that finished or
raised, and after validate(), test() and predict(). Left alive, they hold their memory (and the
dataset copies in it) for as long as the loaders live, which is as long as the Trainer."""

import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_modules import DATA, QUIET, VAL, Classifier  # noqa: E402
from side_by_side import trainers  # noqa: E402


class Stop(Exception):
    pass


class FailsInTheSecondEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == 1:
            raise Stop


def _loader(dataset):
    return DataLoader(dataset, batch_size=8, num_workers=1, persistent_workers=True)


def _alive() -> int:
    return len(multiprocessing.active_children())


@pytest.mark.parametrize("fails", [False, True])
def test_the_loaders_persistent_workers_end_with_a_fit_as_under_lightning(fails):
    for name, trainer_cls in trainers():
        before = _alive()
        train, val = _loader(DATA), _loader(VAL)
        trainer = trainer_cls(**{**QUIET, "max_epochs": 3, "callbacks": [FailsInTheSecondEpoch()] if fails else []})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if fails:
                with pytest.raises(Stop):
                    trainer.fit(Classifier(), train, val)
            else:
                trainer.fit(Classifier(), train, val)
        assert _alive() == before, name
        assert train._iterator is None and val._iterator is None, name


def test_the_loaders_persistent_workers_end_with_validate_test_and_predict():
    for name, trainer_cls in trainers():
        before = _alive()
        trainer = trainer_cls(**QUIET)
        module = Classifier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for run in (trainer.validate, trainer.test, trainer.predict):
                loader = _loader(VAL)
                run(module, loader)
                assert _alive() == before, (name, run.__name__)
                assert loader._iterator is None, (name, run.__name__)
