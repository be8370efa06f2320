"""The loop objects Lightning's callbacks and users read (``trainer.fit_loop`` with its progress
counters, ``epoch_loop``, ``val_loop``, ``validate_loop``, ``test_loop``, ``predict_loop``),
recorded at every hook under lightning.Trainer and fasttrain.lightning.Trainer and compared; the
checkpoints' ``loops`` state; Lightning's own ``BasePredictionWriter``."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loops.progress import _BatchProgress, _OptimizationProgress, _Progress  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    DATA,
    QUIET,
    VAL,
    Classifier,
    TwoOptimizerManual,
    assert_same_weights,
    classification_data,
    loader,
)
from side_by_side import run_both  # noqa: E402

#: callback hooks that run outside the training step
OUTER_HOOKS = (
    "setup", "on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_train_start",
    "on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_validation_start",
    "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_epoch_end", "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
    "teardown", "on_save_checkpoint",
)
#: callback hooks inside the step (overriding them moves fasttrain onto its hook paths)
STEP_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


def _counters(trainer) -> dict:
    """What a callback can read of the loops, as plain values."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return {
        "epoch_progress": fit_loop.epoch_progress.state_dict(),
        "batch_progress": epoch_loop.batch_progress.state_dict(),
        "scheduler_progress": epoch_loop.scheduler_progress.state_dict(),
        "optim_progress": epoch_loop.automatic_optimization.optim_progress.state_dict(),
        "manual_progress": epoch_loop.manual_optimization.optim_step_progress.state_dict(),
        "val_progress": epoch_loop.val_loop.batch_progress.state_dict(),
        "validate_progress": trainer.validate_loop.batch_progress.state_dict(),
        "test_progress": trainer.test_loop.batch_progress.state_dict(),
        "predict_progress": trainer.predict_loop.batch_progress.state_dict(),
        "indices": (fit_loop.total_batch_idx, fit_loop.batch_idx, epoch_loop.total_batch_idx, epoch_loop.batch_idx),
        "stepped": epoch_loop._batches_that_stepped,
        "global_step": (trainer.global_step, epoch_loop.global_step),
        "epoch": trainer.current_epoch,
        "limits": (fit_loop.max_epochs, fit_loop.min_epochs, fit_loop.max_steps, fit_loop.min_steps),
        "restarting": (fit_loop.restarting, epoch_loop.restarting),
        "is_last_batch": trainer.is_last_batch,
        "max_batches": (fit_loop.max_batches, trainer.num_training_batches),
        "val_has_run": epoch_loop.val_loop._has_run,
        "stage": trainer.state.stage,
    }


class _Recorder(L.Callback):
    """Records ``read(trainer)`` (:func:`_counters` by default) at each hook it is built with."""

    def __init__(self, hooks, read=None):
        self.seen = []
        self._read = read or _counters
        for name in hooks:
            setattr(self, name, self._make(name))

    def _make(self, name):
        def hook(trainer, *args, **kwargs):
            self.seen.append((name, self._read(trainer)))

        return hook


def _assert_same_records(reference, ours):
    assert [name for name, _ in ours] == [name for name, _ in reference]
    for (name, theirs), (_, mine) in zip(reference, ours):
        for key in theirs:
            if key == "max_batches" and theirs["stage"] is RunningStage.SANITY_CHECKING:
                continue  # fasttrain loads the training data before the sanity check (docs/lightning.md)
            assert mine[key] == theirs[key], f"{key} at {name}: {mine[key]} != {theirs[key]}"


class Scheduled(Classifier):
    """A per-step scheduler every 2 steps and a per-epoch one."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [
            {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), "interval": "step", "frequency": 2},
            torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
        ]


def _record_fit(module_cls, hooks, fit_kwargs=None, **trainer_kwargs):
    def action(trainer):
        recorder = _Recorder(hooks)
        trainer.callbacks.insert(0, recorder)
        torch.manual_seed(3)
        trainer.fit(module_cls(), loader(DATA, batch_size=8), loader(VAL, batch_size=5), **(fit_kwargs or {}))
        return recorder.seen

    out = run_both(action, **trainer_kwargs)
    for name, result in out.items():
        assert not isinstance(result, BaseException), f"{name}: {result!r}"
    return out


@pytest.mark.parametrize("hooks", ["outer", "all"])
def test_fit_loop_counters_at_every_hook_like_lightning(hooks):
    names = OUTER_HOOKS + (STEP_HOOKS if hooks == "all" else ())
    out = _record_fit(Scheduled, names, max_epochs=2, accumulate_grad_batches=2, val_check_interval=0.5,
                      limit_train_batches=5)
    assert len(out["lightning"]) > 60
    _assert_same_records(out["lightning"], out["fasttrain"])


def test_fit_loop_counters_under_manual_optimization_like_lightning():
    class Manual(TwoOptimizerManual):
        def validation_step(self, batch, batch_idx):
            pass

    out = _record_fit(Manual, OUTER_HOOKS + STEP_HOOKS, max_epochs=2, limit_train_batches=3)
    _assert_same_records(out["lightning"], out["fasttrain"])


class _SkipsRest(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        if self.current_epoch == 0 and batch_idx == 2:
            return -1


def test_counters_when_on_train_batch_start_ends_the_epoch_like_lightning():
    out = _record_fit(_SkipsRest, OUTER_HOOKS, max_epochs=2)
    _assert_same_records(out["lightning"], out["fasttrain"])


def test_counters_when_max_steps_ends_the_fit_like_lightning():
    out = _record_fit(Scheduled, OUTER_HOOKS, max_steps=8, min_epochs=1)
    _assert_same_records(out["lightning"], out["fasttrain"])


class _SeveralLoaders(Classifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return super().validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return super().predict_step(batch, batch_idx)


def test_counters_of_validate_test_and_predict_like_lightning():
    hooks = ("setup", "teardown", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
             "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end", "on_test_start",
             "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end", "on_test_epoch_end", "on_test_end",
             "on_predict_start", "on_predict_epoch_start", "on_predict_batch_start", "on_predict_batch_end",
             "on_predict_epoch_end", "on_predict_end")

    def action(trainer):
        recorder = _Recorder(hooks)
        trainer.callbacks.insert(0, recorder)
        module = _SeveralLoaders()
        loaders = [loader(VAL, batch_size=5), loader(VAL, batch_size=8)]
        for _ in range(2):  # the totals count on over runs, as Lightning's do
            trainer.validate(module, loaders, verbose=False)
            trainer.test(module, loader(VAL, batch_size=6), verbose=False)
            trainer.predict(module, loader(VAL, batch_size=7))
        after = _counters(trainer)
        return recorder.seen, after, trainer.predict_loop.batch_progress.is_last_batch

    out = run_both(action)
    _assert_same_records(out["lightning"][0], out["fasttrain"][0])
    assert out["fasttrain"][1:] == out["lightning"][1:]


@pytest.mark.parametrize("batches", [6, 7])
def test_should_accumulate_at_every_batch_like_lightning(batches):
    """``fit_loop._should_accumulate()``, which a step or callback asks to act on updating
    batches only: False at the last batch of each accumulation window and at the epoch's last."""
    seen = {}

    class Asking(Classifier):
        def training_step(self, batch, batch_idx):
            loop = self.trainer.fit_loop
            seen.setdefault(type(self.trainer).__module__, []).append(
                (loop._should_accumulate(), loop.epoch_loop._accumulated_batches_reached(),
                 loop.epoch_loop._num_ready_batches_reached()))
            return super().training_step(batch, batch_idx)

    for trainer_cls in (L.Trainer, Trainer):
        trainer = trainer_cls(max_epochs=2, accumulate_grad_batches=3, limit_train_batches=batches, **QUIET)
        trainer.fit(Asking(), loader(DATA, batch_size=4))
    lightning, fasttrain = seen.values()
    assert fasttrain == lightning
    assert [not accumulate for accumulate, _, _ in lightning[:batches]].count(True) == -(-batches // 3)


def test_loop_objects_are_lightnings_progress_classes():
    trainer = Trainer(**QUIET)
    fit_loop = trainer.fit_loop
    assert type(fit_loop.epoch_progress) is _Progress
    assert type(fit_loop.epoch_loop.batch_progress) is _BatchProgress
    assert type(fit_loop.epoch_loop.val_loop.batch_progress) is _BatchProgress
    assert type(trainer.validate_loop.batch_progress) is _BatchProgress
    assert type(trainer.test_loop.batch_progress) is _BatchProgress
    assert type(trainer.predict_loop.batch_progress) is _Progress
    assert type(fit_loop.epoch_loop.automatic_optimization.optim_progress) is _OptimizationProgress


class _MoreEpochs(L.Callback):
    """Assigns fit_loop.max_epochs during the fit: the fit runs to the new limit."""

    def __init__(self, epochs):
        self.epochs = epochs
        self.seen = []

    def on_train_epoch_end(self, trainer, module):
        self.seen.append((trainer.max_epochs, trainer.fit_loop.done))
        if trainer.current_epoch == 0:
            trainer.fit_loop.max_epochs = self.epochs


@pytest.mark.parametrize("epochs", [1, 3])
def test_assigning_fit_loop_max_epochs_changes_the_fit_like_lightning(epochs):
    def action(trainer):
        callback = _MoreEpochs(epochs)
        trainer.callbacks.append(callback)
        module = Classifier()
        trainer.fit(module, loader(DATA, batch_size=8))
        return trainer.current_epoch, trainer.global_step, callback.seen, module

    out = run_both(action, max_epochs=2, min_epochs=1)
    assert out["fasttrain"][:3] == out["lightning"][:3]
    assert out["lightning"][0] == max(epochs, 1)
    assert_same_weights(out["lightning"][3], out["fasttrain"][3])


def _loops_of_checkpoints(folder: Path) -> dict:
    return {
        path.name: torch.load(path, weights_only=False)["loops"] for path in sorted(folder.glob("*.ckpt"))
    }


@pytest.mark.parametrize("manual", [False, True])
def test_checkpoints_loops_state_like_lightning(tmp_path, manual):
    module_cls = TwoOptimizerManual if manual else Scheduled

    def action(trainer):
        folder = tmp_path / type(trainer).__module__.split(".")[0]
        trainer.callbacks.append(
            ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{epoch}-{step}")
        )
        trainer.callbacks.append(ModelCheckpoint(dirpath=folder / "epochs", save_top_k=-1, filename="{epoch}"))
        trainer.fit(module_cls(), loader(DATA, batch_size=8), loader(VAL, batch_size=5))
        trainer.save_checkpoint(folder / "after.ckpt")
        found = {f"epochs/{name}": loops for name, loops in _loops_of_checkpoints(folder / "epochs").items()}
        found.update(_loops_of_checkpoints(folder))
        return found

    out = run_both(action, max_epochs=2, limit_train_batches=5, accumulate_grad_batches=1 if manual else 2,
                   enable_checkpointing=True, default_root_dir=tmp_path)
    assert sorted(out["fasttrain"]) == sorted(out["lightning"])
    for name, state in out["lightning"].items():
        assert out["fasttrain"][name] == state, name


@pytest.mark.parametrize(
    "resume_from",
    # mid-epoch (a batch's end), the epoch's last batch, after the epoch's validation, at the fit's end
    ["every2/epoch=0-step=2.ckpt", "every3/epoch=0-step=3.ckpt", "epochs/epoch=0.ckpt", "end.ckpt"],
)
def test_counters_after_a_resume_like_lightning(tmp_path, resume_from):
    torch.manual_seed(0)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / f"every{n}", every_n_train_steps=n, save_top_k=-1,
                                 filename="{epoch}-{step}") for n in (2, 3)]
    callbacks.append(ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1, filename="{epoch}"))
    kwargs = dict(QUIET, enable_checkpointing=True)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=5, accumulate_grad_batches=2, callbacks=callbacks, **kwargs)
    trainer.fit(Scheduled(), loader(DATA, batch_size=8), loader(VAL, batch_size=5))
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    out = _record_fit(Scheduled, OUTER_HOOKS, fit_kwargs={"ckpt_path": tmp_path / resume_from}, max_epochs=3,
                      limit_train_batches=5, accumulate_grad_batches=2)
    _assert_same_records(out["lightning"], out["fasttrain"])


class _Writer(BasePredictionWriter):
    def __init__(self, interval):
        super().__init__(interval)
        self.written = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append(("batch", prediction.tolist(), list(batch_indices), batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        flat = predictions if isinstance(predictions[0], list) else [predictions]
        self.written.append(("epoch", [[p.tolist() for p in loader_predictions] for loader_predictions in flat],
                             batch_indices))


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
@pytest.mark.parametrize("return_predictions", [None, False])
@pytest.mark.parametrize("several", [False, True])
def test_lightnings_prediction_writer_works_unchanged(interval, return_predictions, several):
    shuffled = torch.utils.data.DataLoader(VAL, batch_size=6, shuffle=True)

    def action(trainer):
        writer = _Writer(interval)
        trainer.callbacks.append(writer)
        torch.manual_seed(5)
        module = _SeveralLoaders()
        loaders = [shuffled, loader(DATA, batch_size=16)] if several else shuffled
        torch.manual_seed(7)
        returned = trainer.predict(module, loaders, return_predictions=return_predictions)
        if returned is not None:
            returned = [[p.tolist() for p in group] for group in (returned if several else [returned])]
        return (writer.written, returned, trainer.predict_loop.return_predictions,
                trainer.predict_loop.epoch_batch_indices)

    out = run_both(action)
    assert not isinstance(out["lightning"], BaseException)
    assert out["fasttrain"] == out["lightning"]
    assert out["lightning"][0]  # the writer wrote


def test_predictions_without_return_like_lightning():
    data = classification_data(n=12)

    def action(trainer):
        module = Classifier()
        returned = trainer.predict(module, loader(data, batch_size=4), return_predictions=False)
        kept = trainer.predict_loop.predictions
        returned_again = trainer.predict(module, loader(data, batch_size=4))
        return returned, kept, [p.shape for p in returned_again], [p.shape for p in trainer.predict_loop.predictions]

    out = run_both(action)
    assert out["fasttrain"] == out["lightning"]
    assert out["lightning"][:2] == (None, [])
