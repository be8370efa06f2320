"""``detect_anomaly``, ``inference_mode``, ``use_distributed_sampler``, ``plugins`` and
``save_checkpoint(storage_options=...)``, compared under lightning.Trainer and
fasttrain.lightning.Trainer."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment  # noqa: E402
from lightning.pytorch.plugins import DoublePrecision, HalfPrecision, MixedPrecision, Precision  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    QUIET, Classifier, ReturnsLogits, assert_same_weights, fit_both, train_loader, val_loader,
)

BOTH = (L.Trainer, Trainer)


def _quietly(run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run()


# ---------------------------------------------------------------------------------- detect_anomaly
class NanGradient(Classifier):
    """sqrt at 0 has an infinite derivative: times 0 it gives NaN in backward only."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.0 * torch.sqrt(torch.zeros((), requires_grad=True) * loss)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_detect_anomaly_raises_autogrades_error_as_in_lightning(engine):
    errors = []
    for trainer_cls, extra in ((L.Trainer, {}), (Trainer, {"engine": engine})):
        trainer = trainer_cls(max_epochs=1, detect_anomaly=True, **QUIET, **extra)
        with pytest.raises(RuntimeError) as info:
            _quietly(lambda: trainer.fit(NanGradient(), train_loader()))
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "returned nan values" in errors[1]


def test_without_detect_anomaly_the_fit_runs_with_it_off_as_in_lightning():
    seen = []

    class Records(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(torch.is_anomaly_enabled())

    for trainer_cls in BOTH:
        # Lightning turns anomaly detection off for the fit even when it was on (the default False)
        with torch.autograd.set_detect_anomaly(True):
            _quietly(lambda: trainer_cls(max_epochs=1, callbacks=[Records()], **QUIET).fit(
                Classifier(), train_loader()))
        _quietly(lambda: trainer_cls(max_epochs=1, callbacks=[Records()], detect_anomaly=True, **QUIET).fit(
            Classifier(), train_loader()))
    assert seen == ([False] * 6 + [True] * 6) * 2


def test_detect_anomaly_in_barebones_mode_is_lightnings_error():
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(ValueError) as info:
            trainer_cls(barebones=True, detect_anomaly=True)
        seen.append(str(info.value))
    assert seen[0] == seen[1] and "Anomaly detection can impact raw speed" in seen[1]


# ---------------------------------------------------------------------------------- inference_mode
class RecordsGradModes(Classifier):
    def __init__(self):
        super().__init__()
        self.modes = []

    def _record(self, where):
        self.modes.append((where, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    def validation_step(self, batch, batch_idx):
        self._record("validation_step")
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        self._record("on_validation_epoch_end")

    def test_step(self, batch, batch_idx):
        self._record("test_step")
        return super().test_step(batch, batch_idx)

    def on_test_start(self):
        self._record("on_test_start")

    def predict_step(self, batch, batch_idx):
        self._record("predict_step")
        return super().predict_step(batch, batch_idx)


@pytest.mark.parametrize("inference_mode", [True, False])
def test_evaluation_grad_modes_follow_inference_mode_as_in_lightning(inference_mode):
    seen = []
    for trainer_cls in BOTH:
        module = RecordsGradModes()
        trainer = trainer_cls(max_epochs=1, limit_val_batches=1, inference_mode=inference_mode, **QUIET)

        def run():
            trainer.fit(module, train_loader(), val_loader())
            trainer.validate(module, val_loader())
            trainer.test(module, val_loader())
            return trainer.predict(module, val_loader())

        predictions = _quietly(run)
        seen.append((module.modes, [torch.is_inference(p) for p in predictions]))
    assert seen[0] == seen[1]
    modes, inference_tensors = seen[1]
    # the fit's validation (and sanity check) runs under no_grad, the others by inference_mode
    assert ("validation_step", False, False) in modes
    assert ("test_step", inference_mode, False) in modes and ("on_test_start", inference_mode, False) in modes
    assert inference_tensors == [inference_mode] * 4


@pytest.mark.parametrize("inference_mode", [True, False])
def test_the_loops_inference_mode_follows_the_argument_as_in_lightning(inference_mode):
    seen = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(inference_mode=inference_mode, **QUIET)
        loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
        seen.append([loop.inference_mode for loop in loops])
    assert seen[0] == seen[1] == [False] + [inference_mode] * 3


def test_an_fsdp_strategy_evaluates_under_no_grad():
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn

    from fasttrain.lightning.grad_modes import evaluation_context

    trainer = Trainer(strategy="fsdp", **QUIET)
    assert isinstance(trainer.strategy, FSDPStrategy)
    for fn in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
        trainer.state.fn = fn
        with evaluation_context(trainer):  # Lightning's choice for FSDP: no inference tensors
            assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()


# ---------------------------------------------------------------------------------- use_distributed_sampler
@pytest.mark.parametrize("use", [True, False])
def test_use_distributed_sampler_in_one_process_trains_as_in_lightning(use):
    lt, lm, ft, fm = fit_both(Classifier, train_loader, val_loader,
                              trainer_kwargs=dict(max_epochs=2, use_distributed_sampler=use))
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm, fm)


def test_use_distributed_sampler_false_in_a_launch_of_several_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="use_distributed_sampler=False with several processes"):
        Trainer(use_distributed_sampler=False, **QUIET)


# ---------------------------------------------------------------------------------- plugins
@pytest.mark.parametrize(
    "plugins, precision",
    [
        ([Precision()], "32-true"),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        ([LightningEnvironment()], "32-true"),
        ([TorchElasticEnvironment(), Precision()], "32-true"),
    ],
    ids=["precision", "bf16-mixed", "lightning-env", "elastic-env"],
)
def test_precision_and_environment_plugins_train_as_in_lightning(plugins, precision):
    lt, lm, ft, fm = fit_both(Classifier, train_loader, val_loader,
                              trainer_kwargs=dict(max_epochs=1, plugins=plugins))
    assert ft.precision == lt.precision == precision
    given = [p for p in (plugins if isinstance(plugins, list) else [plugins]) if isinstance(p, Precision)]
    if given:
        assert ft.precision_plugin is given[0]
    assert_same_weights(lm, fm, atol=1e-2 if precision == "bf16-mixed" else 1e-6)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_bf16_mixed_steps_hand_back_their_outputs_in_the_dtypes_they_computed_as_in_lightning(engine):
    """Lightning runs each step under autocast and hands its outputs on as they are (bf16 logits
    from a Linear); nothing converts them to fp32 (accelerate's prepared forward would)."""
    lt, lm, ft, fm = fit_both(ReturnsLogits, train_loader, trainer_kwargs=dict(max_epochs=1, precision="bf16-mixed"),
                              fasttrain_kwargs=dict(engine=engine))
    assert lm.handed[0] == (torch.float32, torch.bfloat16)
    assert fm.handed == lm.handed
    assert_same_weights(lm, fm, atol=1e-2)
    predictions = [
        _quietly(lambda: trainer.predict(module, val_loader())) for trainer, module in ((lt, lm), (ft, fm))
    ]
    assert [p.dtype for p in predictions[1]] == [p.dtype for p in predictions[0]] == [torch.bfloat16] * len(val_loader())
    for ours, reference in zip(*reversed(predictions)):
        torch.testing.assert_close(ours, reference, atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        (dict(plugins="bf16"), MisconfigurationException),
        (dict(plugins=[object()]), MisconfigurationException),
        (dict(plugins=[Precision(), MixedPrecision("bf16-mixed", "cpu")]), MisconfigurationException),
        (dict(plugins=[LightningEnvironment(), TorchElasticEnvironment()]), MisconfigurationException),
        (dict(plugins=[Precision()], precision="bf16-mixed"), ValueError),
    ],
    ids=["string", "object", "two-precisions", "two-environments", "precision-twice"],
)
def test_invalid_plugins_are_lightnings_error(kwargs, kind):
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(kind) as info:
            trainer_cls(**{**QUIET, **kwargs})
        seen.append(str(info.value))
    assert seen[0].split(" at 0x")[0] == seen[1].split(" at 0x")[0]


@pytest.mark.parametrize(
    "plugin, named",
    [(HalfPrecision("bf16-true"), "HalfPrecision"), (DoublePrecision(), "DoublePrecision"),
     (TorchSyncBatchNorm(), "TorchSyncBatchNorm")],
)
def test_plugins_fasttrain_cannot_run_are_one_clear_error(plugin, named):
    with pytest.raises(TypeError, match=f"does not support the (precision )?plugin {named}"):
        Trainer(plugins=[plugin], **QUIET)


class RecordingIO(TorchCheckpointIO):
    def __init__(self):
        self.calls = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", Path(path).name, storage_options, sorted(checkpoint)[:3]))
        super().save_checkpoint(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", Path(path).name, None, weights_only))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):
        self.calls.append(("remove", Path(path).name, None, None))
        super().remove_checkpoint(path)

    def teardown(self):
        self.calls.append(("teardown", None, None, None))


def test_a_checkpoint_io_plugin_saves_loads_and_removes_as_in_lightning(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = []
    for trainer_cls in BOTH:
        torch.manual_seed(0)  # the same weights and data order: the same checkpoints kept and removed
        io = RecordingIO()
        folder = tmp_path / trainer_cls.__module__
        options = {**QUIET, "enable_checkpointing": True, "max_epochs": 3, "plugins": [io],
                   "callbacks": [ModelCheckpoint(folder, monitor="val_loss", save_top_k=1)]}
        trainer = trainer_cls(**options)
        _quietly(lambda: trainer.fit(Classifier(), train_loader(), val_loader()))
        trainer.save_checkpoint(folder / "extra.ckpt", storage_options={"bucket": "b"})
        _quietly(lambda: trainer.validate(Classifier(), val_loader(), ckpt_path=folder / "extra.ckpt",
                                          weights_only=False))
        seen.append(io.calls)
    assert seen[0] == seen[1]
    assert ("save", "extra.ckpt", {"bucket": "b"}, ["callbacks", "epoch", "global_step"]) in seen[1]
    assert [c[0] for c in seen[1]].count("load") == 1
    assert [c[0] for c in seen[1]].count("teardown") == 2  # the strategy's, as each run ends


# ---------------------------------------------------------------------------------- storage_options
def test_storage_options_without_a_checkpoint_io_is_lightnings_error(tmp_path):
    seen = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(max_epochs=1, **QUIET)
        _quietly(lambda: trainer.fit(Classifier(), train_loader()))
        with pytest.raises(TypeError) as info:
            trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"a": 1})
        seen.append(str(info.value))
    assert seen[0] == seen[1] and "is not supported for `TorchCheckpointIO`" in seen[1]
    assert not (tmp_path / "x.ckpt").exists()


def test_save_checkpoint_before_any_run_is_lightnings_error(tmp_path):
    seen = []
    for trainer_cls in BOTH:
        with pytest.raises(AttributeError) as info:
            trainer_cls(**QUIET).save_checkpoint(tmp_path / "x.ckpt")
        seen.append(str(info.value))
    assert seen[0] == seen[1]


@pytest.mark.parametrize("weights_only", [None, True, False])
def test_save_checkpoint_weights_only_keys_as_in_lightning(tmp_path, weights_only):
    keys = []
    for trainer_cls in BOTH:
        trainer = trainer_cls(max_epochs=1, **QUIET)
        _quietly(lambda: trainer.fit(Classifier(), train_loader()))
        path = tmp_path / f"{trainer_cls.__module__}.ckpt"
        trainer.save_checkpoint(path, weights_only=weights_only)
        keys.append(sorted(torch.load(path, weights_only=False)))
    assert keys[0] == keys[1]
    assert ("optimizer_states" in keys[1]) is (not weights_only)


def test_the_module_of_a_loss_with_nan_gradient_is_unchanged_when_anomaly_stops_it():
    # the error comes in backward, before any optimizer step: nothing a user has is changed
    module = NanGradient()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(RuntimeError):
        _quietly(lambda: Trainer(max_epochs=1, detect_anomaly=True, **QUIET).fit(module, train_loader()))
    for key, value in before.items():
        torch.testing.assert_close(module.state_dict()[key], value)
    assert not torch.is_anomaly_enabled()  # off again after the fit
