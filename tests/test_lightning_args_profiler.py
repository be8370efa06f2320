"""``Trainer(profiler=...)``: Lightning's profilers time the actions Lightning times, under its
names, set up and summarised per run, compared under lightning.Trainer and
fasttrain.lightning.Trainer."""

import collections
import re
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, SimpleProfiler  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import QUIET, Classifier, assert_same_weights, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)
# Lightning names its strategy's class in the actions: the classes differ between the trainers
STRATEGY = re.compile(r"^\[Strategy\]\w+\.")
#: actions fasttrain does not time (listed in docs/lightning.md): configure_callbacks runs only
#: when the module overrides it
NOT_TIMED = {"[LightningModule]Classifier.configure_callbacks"}


class Recording(Profiler):
    """A profiler of one's own: records every start and stop, and its set-up and summary."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.setups = []
        self.described = 0

    def start(self, action_name):
        self.events.append(("start", STRATEGY.sub("[Strategy].", action_name)))

    def stop(self, action_name):
        self.events.append(("stop", STRATEGY.sub("[Strategy].", action_name)))

    def setup(self, stage, local_rank=None, log_dir=None):
        super().setup(stage, local_rank, log_dir)
        self.setups.append((getattr(stage, "value", stage), local_rank))

    def describe(self):
        self.described += 1
        super().describe()


class Noting(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        pass


def _profile(trainer_cls, **kwargs):
    torch.manual_seed(0)
    profiler = Recording()
    module = Classifier()
    trainer = trainer_cls(**{**QUIET, "max_epochs": 2, "profiler": profiler, "callbacks": [Noting()], **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_loader(), val_loader())
        trainer.validate(module, val_loader(), verbose=False)
        trainer.test(module, val_loader(), verbose=False)
        trainer.predict(module, val_loader())
    assert trainer.profiler is profiler
    return profiler, module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_profiler_times_lightnings_actions_under_its_names(accumulate):
    (theirs, their_module), (ours, our_module) = [
        _profile(cls, accumulate_grad_batches=accumulate, gradient_clip_val=0.5) for cls in BOTH
    ]
    their_starts = collections.Counter(a for kind, a in theirs.events if kind == "start" and a not in NOT_TIMED)
    our_starts = collections.Counter(a for kind, a in ours.events if kind == "start")
    assert our_starts == their_starts
    assert our_starts["run_training_batch"] == 12 and our_starts["[Strategy].backward"] == 12
    assert our_starts["[Callback]Noting.on_train_batch_end"] == 12
    # every action started is stopped, in nesting order
    open_actions = []
    for kind, action in ours.events:
        if kind == "start":
            open_actions.append(action)
        else:
            assert open_actions.pop() == action
    assert open_actions == []
    assert ours.setups == theirs.setups == [("fit", None), ("validate", None), ("test", None), ("predict", None)]
    assert ours.described == theirs.described == 4
    # profiling changes no number
    assert_same_weights(their_module, our_module)


@pytest.mark.parametrize("name, kind", [("simple", SimpleProfiler), ("Advanced", AdvancedProfiler)])
def test_profiler_names_give_lightnings_profilers_and_summaries(name, kind, tmp_path):
    reports = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1, "profiler": name, "default_root_dir": tmp_path})
        assert type(trainer.profiler) is kind
        trainer.profiler.dirpath, trainer.profiler.filename = tmp_path / trainer_cls.__module__, "profile"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Classifier(), train_loader())
        reports.append((tmp_path / trainer_cls.__module__ / "fit-profile.txt").read_text())
    assert all("FIT Profiler Report" in report for report in reports)
    if kind is SimpleProfiler:
        rows = [{line.split("|")[1].strip() for line in report.splitlines() if line.startswith("|  ")}
                for report in reports]
        rows = [{STRATEGY.sub("[Strategy].", row) for row in report_rows} - NOT_TIMED for report_rows in rows]
        assert rows[0] == rows[1]
        assert {"run_training_batch", "[Strategy].training_step", "[LightningModule]Classifier.optimizer_step"} <= rows[1]


def test_without_a_profiler_the_trainer_has_lightnings_pass_through_profiler():
    assert type(Trainer(**QUIET).profiler) is type(L.Trainer(**QUIET).profiler) is PassThroughProfiler


@pytest.mark.parametrize("kwargs, kind", [
    (dict(profiler="fancy"), MisconfigurationException),
    (dict(profiler="simple", barebones=True), ValueError),
])
def test_bad_profiler_settings_are_lightnings_errors(kwargs, kind):
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(kind) as info:
            trainer_cls(**kwargs)
        seen.append(str(info.value))
    assert seen[0] == seen[1]


class Data(L.LightningDataModule):
    def prepare_data(self):
        pass

    def setup(self, stage):
        pass

    def train_dataloader(self):
        return train_loader()

    def val_dataloader(self):
        return val_loader()


def test_the_datamodules_hooks_are_timed_as_lightning_times_them():
    def events(trainer_cls):
        profiler = Recording()
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1, "profiler": profiler})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = Classifier()
            trainer.fit(module, datamodule=Data())
            trainer.validate(module, datamodule=Data(), verbose=False)
        return [event for event in profiler.events if "LightningDataModule" in event[1]]

    theirs, ours = (events(cls) for cls in BOTH)
    assert ("start", "[LightningDataModule]Data.prepare_data") in theirs
    assert ours == theirs
