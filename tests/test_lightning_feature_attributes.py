"""Trainer attributes and construction paths Lightning users rely on, each compared with
lightning.Trainer: init_module, device_ids, num_nodes, num_test_batches/num_predict_batches,
assignable logger/loggers, PL_TRAINER_* environment defaults, the callbacks_factory entry
point, default_root_dir "~", the public values of max_epochs/num_sanity_val_steps and
trainer.state.stage in every loop."""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import lightning.fabric.utilities.registry as registry  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.profilers import SimpleProfiler  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from fasttrain.lightning import external_callbacks  # noqa: E402
from lightning_modules import QUIET, VAL, Classifier, loader, train_loader, val_loader  # noqa: E402

BOTH = (L.Trainer, Trainer)


def test_init_module_builds_on_the_run_device_like_lightning():
    for trainer_cls in BOTH:
        trainer = trainer_cls(**QUIET)
        with trainer.init_module():
            inside = torch.get_default_device()
            module = Classifier()
        assert inside == torch.device("cpu")
        assert module.net[0].weight.device.type == "cpu"
        with trainer.init_module(empty_init=True):
            empty = torch.nn.Linear(3, 3)
        assert empty.weight.shape == (3, 3)
    assert torch.get_default_device() == torch.device("cpu")


def test_device_ids_num_nodes_and_batch_counts_like_lightning():
    values = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(limit_test_batches=3, **QUIET)
        module = Classifier()
        trainer.test(module, val_loader(), verbose=False)
        tested = trainer.num_test_batches
        trainer.predict(module, loader(VAL, batch_size=6))
        values.append((trainer.device_ids, trainer.num_nodes, tested, trainer.num_predict_batches))
    assert values[0] == values[1] == ([0], 1, [3], [4])


def test_logger_and_loggers_are_assignable_like_lightning(tmp_path):
    seen = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(**QUIET)
        first, second = CSVLogger(tmp_path), CSVLogger(tmp_path, name="b")
        trainer.logger = first
        row = [trainer.logger is first, trainer.loggers == [first]]
        trainer.loggers = [first, second]
        row += [trainer.logger is first, len(trainer.loggers)]
        trainer.logger = None
        row += [trainer.logger, trainer.loggers]
        seen.append(row)
    assert seen[0] == seen[1] == [True, True, True, 2, None, []]


def test_pl_trainer_environment_defaults_like_lightning(monkeypatch):
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "3")
    monkeypatch.setenv("PL_TRAINER_LIMIT_VAL_BATCHES", "0.5")
    for trainer_cls in BOTH:
        trainer = trainer_cls(**QUIET)
        assert (trainer.max_epochs, trainer.limit_val_batches) == (3, 0.5)
        assert trainer_cls(max_epochs=5, **QUIET).max_epochs == 5  # a given argument wins
    monkeypatch.setenv("PL_TRAINER_PROFILER", "'simple'")
    assert type(Trainer(**QUIET).profiler) is type(L.Trainer(**QUIET).profiler) is SimpleProfiler
    monkeypatch.setenv("PL_TRAINER_BENCHMARK", "True")
    with pytest.raises(TypeError, match="benchmark"):  # one fasttrain does not take is named
        Trainer(**QUIET)


class _FromFactory(L.Callback):
    pass


class _EntryPoint:
    name = "plugin"

    @staticmethod
    def load():
        return lambda: [_FromFactory()]


def _installed_entry_points(monkeypatch, looked_up=None):
    # the group's entries, as Lightning's registry and fasttrain.lightning find them
    def entry_points(group):
        if looked_up is not None:
            looked_up.append(group)
        return [_EntryPoint()] if group == "lightning.pytorch.callbacks_factory" else []

    monkeypatch.setattr(registry, "entry_points", entry_points)
    monkeypatch.setattr(external_callbacks, "entry_points", entry_points)
    monkeypatch.setattr(external_callbacks, "_FOUND", {})


def test_callbacks_factory_entry_point_like_lightning(monkeypatch):
    _installed_entry_points(monkeypatch)
    for trainer_cls in BOTH:
        trainer = trainer_cls(enable_progress_bar=False, enable_model_summary=False, logger=False)
        assert [type(cb).__name__ for cb in trainer.callbacks] == ["_FromFactory", "ModelCheckpoint"]


def test_installed_callbacks_are_looked_up_once_and_made_for_each_trainer(monkeypatch, tmp_path):
    """Finding the entry points reads every installed package's metadata: a Trainer built per fit
    does not pay it again until an installation may have changed them (a folder of sys.path
    modified, sys.path changed). Each Trainer still gets callbacks of its own."""
    looked_up = []
    _installed_entry_points(monkeypatch, looked_up)
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    made = [Trainer(enable_progress_bar=False, enable_model_summary=False, logger=False).callbacks[0]
            for _ in range(3)]
    assert len(looked_up) == 1
    assert all(type(cb) is _FromFactory for cb in made) and len({id(cb) for cb in made}) == 3
    (site / "new_package-1.0.dist-info").mkdir()  # a package installed meanwhile
    os.utime(site, ns=(0, site.stat().st_mtime_ns + 1_000_000))  # a coarse clock: changed for sure
    Trainer(enable_progress_bar=False, enable_model_summary=False, logger=False)
    assert len(looked_up) == 2
    monkeypatch.syspath_prepend(str(tmp_path))
    Trainer(enable_progress_bar=False, enable_model_summary=False, logger=False)
    assert len(looked_up) == 3


@pytest.mark.parametrize("given", [[], ["ModelSummary"], ["RichModelSummary"]])
def test_the_model_summary_is_lightnings_callback_in_trainer_callbacks(given):
    from lightning.pytorch import callbacks

    for trainer_cls in BOTH:
        trainer = trainer_cls(callbacks=[getattr(callbacks, name)() for name in given],
                              enable_progress_bar=False, logger=False, enable_checkpointing=False)
        made = [type(cb) for cb in trainer.callbacks]
        if trainer_cls is L.Trainer:
            expected = made
    assert made == expected and len(made) == 1
    assert issubclass(made[0], callbacks.ModelSummary)
    off = Trainer(enable_model_summary=False, enable_progress_bar=False, logger=False, enable_checkpointing=False)
    assert off.callbacks == []


def test_a_model_summary_callback_of_yours_is_the_only_summary_as_in_lightning(caplog, capsys):
    """ModelSummary(max_depth=2) given: its table, once, in the log Lightning writes it to."""
    from lightning.pytorch.callbacks import ModelSummary

    tables = []
    for trainer_cls in BOTH:
        caplog.clear()
        with caplog.at_level("INFO", logger="lightning.pytorch.callbacks.model_summary"):
            trainer = trainer_cls(max_epochs=1, callbacks=[ModelSummary(max_depth=2)],
                                  enable_progress_bar=False, logger=False, enable_checkpointing=False)
            trainer.fit(Classifier(), train_loader())
        tables.append([r.getMessage() for r in caplog.records if r.name.endswith("model_summary")])
        assert "Trainable params" not in capsys.readouterr().out
    assert tables[1] == tables[0] and len(tables[0]) == 1
    assert "net.0" in tables[0][0]  # the second level: max_depth=2


def test_num_nodes_must_match_the_launch():
    trainer = Trainer(num_nodes=2, max_epochs=1, **QUIET)
    assert trainer.num_nodes == 2
    with pytest.raises(ValueError, match=r"num_nodes=2.*torchrun --nnodes 2"):
        trainer.fit(Classifier(), train_loader())


def test_default_root_dir_expands_home_like_lightning(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for trainer_cls in BOTH:
        assert trainer_cls(default_root_dir="~/runs/../x", **QUIET).default_root_dir == str(tmp_path / "x")


def test_public_values_like_lightning():
    for trainer_cls in BOTH:
        trainer = trainer_cls(num_sanity_val_steps=-1, **QUIET)
        assert trainer.max_epochs is None
        assert trainer.num_sanity_val_steps == float("inf")
        assert trainer.state.stage is None


class _Stages(L.Callback):
    def __init__(self):
        self.seen = []

    def _record(self, trainer, *args):
        stage = trainer.state.stage
        if not self.seen or self.seen[-1] != stage:
            self.seen.append(stage)

    on_sanity_check_start = on_validation_batch_start = on_train_batch_start = _record
    on_test_batch_start = on_predict_batch_start = on_fit_end = on_test_end = _record


def test_state_stage_in_every_loop_like_lightning():
    stages = []
    for trainer_cls in BOTH:
        recorder = _Stages()
        trainer = trainer_cls(max_epochs=1, limit_train_batches=2, callbacks=[recorder], **QUIET)
        module = Classifier()
        trainer.fit(module, train_loader(), val_loader())
        after_fit = trainer.state.stage
        trainer.validate(module, val_loader(), verbose=False)
        trainer.test(module, val_loader(), verbose=False)
        trainer.predict(module, val_loader())
        stages.append((recorder.seen, after_fit, trainer.state.stage))
    assert stages[0] == stages[1]
    assert stages[1][0] == [
        RunningStage.SANITY_CHECKING, RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.TRAINING,
        RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.PREDICTING,
    ]
