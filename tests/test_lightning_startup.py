"""Start-up order of fit(): the same module, DataModule, callback and logger, recorded under
lightning.Trainer and fasttrain.lightning.Trainer, call their hooks in the same order (dataloader
requests, configure_optimizers, on_fit_start, hyperparameter logging, checkpoint restoring)."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import DATA, QUIET, VAL, Classifier, loader, train_loader  # noqa: E402

TRAINERS = (L.Trainer, Trainer)


def _name(trainer) -> str:
    return type(trainer).__module__.split(".")[0]


class Recorder:
    """A module class, a DataModule, a callback and a logger that append what runs to one list."""

    def __init__(self, reads_estimate=False, loaders_in="datamodule"):
        self.calls = []
        calls = self.calls

        class Module(Classifier):
            def configure_optimizers(self):
                weight = round(float(self.net[0].weight.flatten()[0]), 5)
                calls.append(f"configure_optimizers(w={weight})")
                if reads_estimate:
                    calls.append(f"estimate={self.trainer.estimated_stepping_batches}")
                return super().configure_optimizers()

            def on_fit_start(self):
                optimizer = self.trainer.optimizers[0]
                calls.append(f"module.on_fit_start(step={self.trainer.global_step}, "
                             f"optimizer_state={len(optimizer.state)})")

            def on_train_start(self):
                calls.append(f"module.on_train_start(step={self.trainer.global_step})")

            def on_load_checkpoint(self, checkpoint):
                calls.append("module.on_load_checkpoint")

        class DataModule(L.LightningDataModule):
            def prepare_data(self):
                calls.append("dm.prepare_data")

            def setup(self, stage):
                calls.append("dm.setup")

            def state_dict(self):
                return {"seen": 1}

            def load_state_dict(self, state):
                calls.append(f"dm.load_state_dict({state})")

        def train_dataloader(self):
            calls.append(f"{prefix}.train_dataloader")
            return loader(DATA, batch_size=8)

        def val_dataloader(self):
            calls.append(f"{prefix}.val_dataloader")
            return loader(VAL, batch_size=5)

        prefix = "dm" if loaders_in == "datamodule" else "module"
        holder = DataModule if loaders_in == "datamodule" else Module
        holder.train_dataloader = train_dataloader
        holder.val_dataloader = val_dataloader

        class Record(L.Callback):
            def on_fit_start(self, trainer, module):
                calls.append("callback.on_fit_start")

            def on_load_checkpoint(self, trainer, module, checkpoint):
                calls.append("callback.on_load_checkpoint")

            def state_dict(self):
                return {"kept": 1}

            def load_state_dict(self, state):
                calls.append(f"callback.load_state_dict({state})")

        class RecordingLogger(Logger):
            name, version = "recording", 0

            def log_hyperparams(self, params, *args, **kwargs):
                calls.append("logger.log_hyperparams")

            def log_metrics(self, metrics, step=None):
                pass

        self.module_cls, self.datamodule_cls = Module, DataModule
        self.callback_cls, self.logger_cls = Record, RecordingLogger
        self.uses_datamodule = loaders_in == "datamodule"

    def fit(self, trainer_cls, ckpt_path=None, extra_callbacks=(), **kwargs):
        """``calls`` of one fit, and whether it ran a sanity check."""
        self.calls.clear()
        sanity = []

        class Sanity(L.Callback):
            def on_sanity_check_end(self, trainer, module):
                sanity.append(True)

        torch.manual_seed(0)
        module = self.module_cls()
        args = dict(QUIET, max_epochs=1, logger=self.logger_cls(),
                    callbacks=[self.callback_cls(), Sanity(), *extra_callbacks])
        args.update(kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(**args)
            if self.uses_datamodule:
                trainer.fit(module, datamodule=self.datamodule_cls(), ckpt_path=ckpt_path)
            else:
                trainer.fit(module, ckpt_path=ckpt_path)
        return list(self.calls), bool(sanity), trainer


@pytest.mark.parametrize("loaders_in", ["datamodule", "module"])
@pytest.mark.parametrize(
    "reads_estimate,trainer_kwargs",
    [
        (False, {}),  # sanity check: validation loaders first
        (False, {"num_sanity_val_steps": 0}),  # training loader first
        (False, {"limit_val_batches": 0}),  # no validation: val_dataloader is never called
        (True, {}),  # the estimate loads the training data inside configure_optimizers
        (True, {"num_sanity_val_steps": 0}),
    ],
)
def test_fit_requests_dataloaders_in_lightnings_order(loaders_in, reads_estimate, trainer_kwargs):
    recorder = Recorder(reads_estimate=reads_estimate, loaders_in=loaders_in)
    (lcalls, lsanity, _), (fcalls, fsanity, _) = [recorder.fit(cls, **trainer_kwargs) for cls in TRAINERS]
    assert fcalls == lcalls
    assert fsanity == lsanity
    # Lightning's order, as observed: no loader before on_fit_start unless the estimate is read;
    # with a sanity check, the validation loaders before the training loader
    prefix = "dm" if loaders_in == "datamodule" else "module"
    names = [c.split("(")[0] for c in lcalls]
    train = names.index(f"{prefix}.train_dataloader")
    if reads_estimate:
        assert names.index("configure_optimizers") < train < names.index("callback.on_fit_start")
    else:
        assert names.index("logger.log_hyperparams") < train
    if trainer_kwargs.get("limit_val_batches") == 0:
        assert f"{prefix}.val_dataloader" not in names
    else:
        assert (names.index(f"{prefix}.val_dataloader") < train) == (lsanity and not reads_estimate)


def test_hyperparameters_reach_loggers_after_on_fit_start():
    recorder = Recorder()
    (lcalls, _, _), (fcalls, _, _) = [recorder.fit(cls, num_sanity_val_steps=0) for cls in TRAINERS]
    starts = [c.split("(")[0] for c in fcalls]
    assert starts.index("module.on_fit_start") < starts.index("logger.log_hyperparams")
    assert fcalls == lcalls


def _checkpoint(tmp_path, writer, where):
    """A checkpoint of Recorder's module written by ``writer``: after one full epoch
    (``"end"``), or (``"mid"``) by ModelCheckpoint at the third and last batch of an epoch
    limited to 3 batches, before the epoch's end: a state both trainers count as inside the
    epoch."""
    recorder = Recorder()
    root = tmp_path / f"{writer.__module__.split('.')[0]}-{where}"
    if where == "end":
        _, _, trainer = recorder.fit(writer, num_sanity_val_steps=0)
        path = root / "end.ckpt"
        trainer.save_checkpoint(path)
        return path
    steps = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1, filename="mid")
    recorder.fit(writer, num_sanity_val_steps=0, extra_callbacks=[steps], enable_checkpointing=True,
                 limit_train_batches=3)
    return root / "mid.ckpt"


@pytest.mark.parametrize("writer", TRAINERS, ids=["lightning_file", "fasttrain_file"])
@pytest.mark.parametrize("where,resume_kwargs", [
    ("end", {"max_epochs": 2}),  # a finished epoch: the sanity check runs
    ("mid", {"max_epochs": 1}),  # inside an epoch: no sanity check
    ("end", {"max_epochs": -1, "max_steps": 9}),  # step-limited: no sanity check
])
def test_resume_restores_module_and_callbacks_before_configure_optimizers(tmp_path, writer, where, resume_kwargs):
    """The module's on_load_checkpoint and weights, the DataModule's and the callbacks' states
    come before configure_optimizers (which sees the restored weights); the optimizer state and
    the counters come after on_fit_start."""
    path = _checkpoint(tmp_path, writer, where)
    recorder = Recorder()
    (lcalls, lsanity, _), (fcalls, fsanity, _) = [
        recorder.fit(cls, ckpt_path=path, **resume_kwargs) for cls in TRAINERS]
    assert fcalls == lcalls
    assert fsanity == lsanity == (where == "end" and "max_steps" not in resume_kwargs)
    names = [c.split("(")[0] for c in fcalls]
    assert names.index("module.on_load_checkpoint") < names.index("callback.on_load_checkpoint") < names.index(
        "configure_optimizers")
    assert "optimizer_state=0" in fcalls[names.index("module.on_fit_start")]


def test_a_single_callback_instance_is_accepted_like_lightning():
    seen = []

    class EpochEnds(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append(_name(trainer))

    for trainer_cls in TRAINERS:
        callback = EpochEnds()
        trainer = trainer_cls(max_epochs=2, callbacks=callback, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Classifier(), train_loader())
        assert callback in trainer.callbacks
    assert seen == ["lightning", "lightning", "fasttrain", "fasttrain"]


def test_the_trainers_dataloader_properties_are_lightnings():
    """train_dataloader, val_dataloaders, test_dataloaders and predict_dataloaders after each run
    of a sequence, as under Lightning: a run's own loaders (one, or the list of several; the
    prediction loaders rebuilt over the same data as Lightning rebuilds them), None for the kinds
    it does not run (an earlier run's loaders are not held)."""
    from torch.utils.data import DataLoader

    from lightning_modules import classification_data, val_loader

    class TestsSeveral(Classifier):
        def test_step(self, batch, batch_idx, dataloader_idx=0):
            return super().test_step(batch, batch_idx)

    def held(trainer, given):
        out = []
        for name in ("train_dataloader", "val_dataloaders", "test_dataloaders", "predict_dataloaders"):
            value = getattr(trainer, name)
            if value is None:
                out.append(None)
            elif name == "predict_dataloaders":
                out.append(isinstance(value, DataLoader) and value.dataset is given[name].dataset)
            else:
                out.append(value is given[name] or value == given[name])
        return out

    seen = []
    for trainer_cls in (L.Trainer, Trainer):
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1})
        module = TestsSeveral()
        given = dict(train_dataloader=train_loader(), val_dataloaders=val_loader(),
                     test_dataloaders=[val_loader(), val_loader()],
                     predict_dataloaders=loader(classification_data(n=8, seed=1).tensors[0], batch_size=4))
        states = [held(trainer, given)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, given["train_dataloader"], given["val_dataloaders"])
            states.append(held(trainer, given))
            trainer.test(module, given["test_dataloaders"], verbose=False)
            states.append(held(trainer, given))
            trainer.validate(module, given["val_dataloaders"], verbose=False)
            states.append(held(trainer, given))
            trainer.predict(module, given["predict_dataloaders"])
            states.append(held(trainer, given))
        seen.append(states)
    assert seen[1] == seen[0]
    assert seen[0][-1] == [None, None, None, True] and seen[0][1] == [True, True, None, None]


@pytest.mark.parametrize("limits", [{"max_epochs": 2}, {"max_steps": 3, "max_epochs": -1}, {"max_epochs": 1, "limit_train_batches": 0}])
def test_the_fit_says_why_it_stopped_as_lightning_does(limits, caplog):
    """Lightning's info line at a fit's end: which limit ended it (none where the fit had no
    training batch to run)."""
    import logging

    from lightning_modules import train_loader

    said = []
    for trainer_cls in (L.Trainer, Trainer):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer_cls(**{**QUIET, **limits}).fit(Classifier(), train_loader())
        said.append([r.getMessage() for r in caplog.records if "`Trainer.fit` stopped" in r.getMessage()])
    assert said[1] == said[0]
    assert bool(said[0]) == ("limit_train_batches" not in limits)


def test_the_callback_and_scaler_properties_are_lightnings():
    """early_stopping_callbacks lists every EarlyStopping; scaler is the fp16 precision plugin's
    loss scaler, None in full precision."""
    from lightning.pytorch.callbacks import EarlyStopping

    stoppers = [EarlyStopping("a"), EarlyStopping("b")]
    for trainer_cls in (L.Trainer, Trainer):
        trainer = trainer_cls(**{**QUIET, "callbacks": stoppers})
        assert trainer.early_stopping_callbacks == stoppers
        assert trainer.early_stopping_callback is stoppers[0]
        assert trainer.scaler is None
