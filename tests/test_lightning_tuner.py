"""Lightning's tuner on fasttrain.lightning.Trainer, side by side with lightning.Trainer: the
learning rate finder (``Tuner.lr_find``, ``LearningRateFinder``) and the batch size finder
(``Tuner.scale_batch_size``, ``BatchSizeFinder``) find the same values from the same losses,
leave the module as they found it (no checkpoint file left behind), and a fit after them, or
around them as callbacks, ends with Lightning's weights."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from lightning_modules import DATA, VAL, Classifier, assert_same_weights, loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class Tunable(Classifier):
    """SGD at ``self.lr`` (what the learning rate finder sets), its own loaders in batches of
    ``self.batch_size`` (what the batch size finder sets); records the batch size of every
    training loader it hands out."""

    def __init__(self, lr=0.05, batch_size=4):
        super().__init__(lr=lr)
        self.lr = lr
        self.batch_size = batch_size
        self.requested = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        self.requested.append(self.batch_size)
        return loader(DATA, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return loader(VAL, batch_size=self.batch_size)

    def test_dataloader(self):
        return loader(VAL, batch_size=self.batch_size)

    def predict_dataloader(self):
        return loader(VAL, batch_size=self.batch_size)


def _tune_then_fit(tune, trainer_kwargs, fit_kwargs=None):
    """``tune(Tuner(trainer), module)`` then a fit, under both trainers from one seed; per trainer
    (found value, module, weights right after tuning, weights before it, files left)."""
    out = {}

    def action(trainer):
        module = Tunable()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        found = tune(Tuner(trainer), module)
        after_tuning = {k: v.clone() for k, v in module.state_dict().items()}
        leftovers = sorted(p.name for p in Path(trainer.default_root_dir).glob(".*.ckpt"))
        trainer.fit(module, **(fit_kwargs or {}))
        return found, module, after_tuning, before, leftovers

    for name, result in run_both(action, **trainer_kwargs).items():
        if isinstance(result, BaseException):
            raise result
        out[name] = result
    return out["lightning"], out["fasttrain"]


def test_lr_find_finds_lightnings_learning_rate_from_the_same_losses(tmp_path):
    reference, ours = _tune_then_fit(
        lambda tuner, module: tuner.lr_find(module, num_training=20, min_lr=1e-4, max_lr=1.0),
        dict(max_epochs=2, default_root_dir=str(tmp_path)),
    )
    (ref_finder, ref_module, _, _, ref_left), (finder, module, tuned, before, left) = reference, ours
    assert len(finder.results["lr"]) == len(ref_finder.results["lr"]) == 20
    torch.testing.assert_close(finder.results["lr"], ref_finder.results["lr"], rtol=1e-12, atol=0)
    torch.testing.assert_close(finder.results["loss"], ref_finder.results["loss"], rtol=1e-5, atol=1e-7)
    assert finder.suggestion() == pytest.approx(ref_finder.suggestion(), rel=1e-9)
    # the suggestion becomes the module's lr (update_attr=True), and the module is as it was
    assert module.lr == ref_module.lr == pytest.approx(ref_finder.suggestion(), rel=1e-9)
    assert module.lr != 0.05
    for key in before:
        torch.testing.assert_close(tuned[key], before[key], rtol=0, atol=0)
    assert left == ref_left == []  # the finder's checkpoint is removed
    # the fit after it trains at the found rate as under Lightning
    assert_same_weights(ref_module, module)
    assert module.trainer.global_step == ref_module.trainer.global_step == 2 * 12


def test_the_learning_rate_finder_callback_fits_at_the_rate_it_finds(tmp_path):
    def fit(trainer):
        module = Tunable()
        trainer.fit(module)
        finder = next(cb for cb in trainer.callbacks if isinstance(cb, LearningRateFinder))
        return finder.optimal_lr, module, trainer.global_step, trainer.current_epoch

    # one callback object for both trainers (run_both builds them from the same arguments): the
    # fits run one after the other and each reads what its own fit found right after it
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=15, mode="linear")
    out = run_both(fit, max_epochs=2, default_root_dir=str(tmp_path), callbacks=[finder])
    assert not isinstance(out["lightning"], BaseException), out["lightning"]
    assert not isinstance(out["fasttrain"], BaseException), out["fasttrain"]
    (ref_finder, ref_module, ref_step, ref_epoch), (finder, module, step, epoch) = out["lightning"], out["fasttrain"]
    torch.testing.assert_close(finder.results["loss"], ref_finder.results["loss"], rtol=1e-5, atol=1e-7)
    assert module.lr == pytest.approx(ref_module.lr, rel=1e-9)
    assert (step, epoch) == (ref_step, ref_epoch) == (24, 2)
    assert_same_weights(ref_module, module)


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_scale_batch_size_finds_lightnings_batch_size(tmp_path, mode):
    reference, ours = _tune_then_fit(
        lambda tuner, module: tuner.scale_batch_size(module, mode=mode, steps_per_trial=2, init_val=2, max_trials=4),
        dict(max_epochs=1, default_root_dir=str(tmp_path)),
    )
    (ref_size, ref_module, _, _, ref_left), (size, module, tuned, before, left) = reference, ours
    assert size == ref_size
    assert module.batch_size == ref_module.batch_size == size
    # every trial requested the training data at its batch size, in Lightning's order
    assert module.requested == ref_module.requested
    assert len(set(module.requested)) > 2
    for key in before:
        torch.testing.assert_close(tuned[key], before[key], rtol=0, atol=0)
    assert left == ref_left == []
    assert_same_weights(ref_module, module)
    assert module.trainer.global_step == ref_module.trainer.global_step


def test_the_batch_size_finder_callback_fits_at_the_size_it_finds(tmp_path):
    def fit(trainer):
        module = Tunable()
        trainer.fit(module)
        finder = next(cb for cb in trainer.callbacks if isinstance(cb, BatchSizeFinder))
        return finder.optimal_batch_size, module, trainer.global_step

    out = run_both(fit, max_epochs=2, default_root_dir=str(tmp_path),
                   callbacks=[BatchSizeFinder(steps_per_trial=1, init_val=4, max_trials=2)])
    (ref_size, ref_module, ref_step), (size, module, step) = out["lightning"], out["fasttrain"]
    assert size == ref_size == module.batch_size
    assert step == ref_step
    assert module.requested == ref_module.requested
    assert_same_weights(ref_module, module)


def test_the_batch_size_finder_refuses_loaders_given_to_fit_as_lightning_does(tmp_path):
    def fit(trainer):
        trainer.fit(Tunable(), train_dataloaders=loader(DATA, batch_size=4))

    out = run_both(fit, max_epochs=1, default_root_dir=str(tmp_path), callbacks=[BatchSizeFinder()])
    assert type(out["fasttrain"]) is type(out["lightning"]) is MisconfigurationException
    assert str(out["fasttrain"]) == str(out["lightning"])


def test_a_finder_run_inside_the_fit_loop_is_a_clear_error(tmp_path):
    """Lightning's finders also run from a later hook (a LearningRateFinder subclass re-tuning at
    epoch milestones); fasttrain runs its loop again only before it started, and says so."""
    from fasttrain.lightning import Trainer

    class AtEpochStart(LearningRateFinder):
        def on_fit_start(self, trainer, pl_module):
            pass

        def on_train_epoch_start(self, trainer, pl_module):
            self.lr_find(trainer, pl_module)

    trainer = Trainer(max_epochs=1, enable_progress_bar=False, enable_model_summary=False, logger=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path),
                      callbacks=[AtEpochStart(num_training_steps=5)])
    module = Tunable()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(RuntimeError, match="only before it started: from `on_fit_start`"):
        trainer.fit(module)
    for key in weights:  # the checkpoint the finder saved first is restored
        torch.testing.assert_close(module.state_dict()[key], weights[key], rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.glob(".*.ckpt")) == []


def test_the_loops_run_and_setup_data_outside_a_run_are_a_clear_error():
    from fasttrain.lightning import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match=r"FitLoop.run\(\)` works inside a run"):
        trainer.fit_loop.run()
    with pytest.raises(RuntimeError, match=r"setup_data\(\)` works inside a run"):
        trainer.fit_loop.setup_data()
    # Lightning's loop classes, as its tuner tells them apart, without Lightning's loop code
    from lightning.pytorch.loops import _EvaluationLoop, _FitLoop, _PredictionLoop

    assert isinstance(trainer.fit_loop, _FitLoop)
    assert isinstance(trainer.validate_loop, _EvaluationLoop)
    assert isinstance(trainer.predict_loop, _PredictionLoop)
    assert not hasattr(trainer.fit_loop, "advance")
    with pytest.raises(AttributeError, match="fasttrain runs its own loops"):
        trainer.fit_loop.on_advance_end()


@pytest.mark.parametrize("method", ["validate", "test", "predict"])
def test_scale_batch_size_for_an_evaluation_finds_lightnings_size(tmp_path, method):
    def tune(trainer):
        module = Tunable()
        found = Tuner(trainer).scale_batch_size(module, method=method, mode="power", steps_per_trial=2, init_val=2,
                                                max_trials=3)
        return found, module.batch_size, trainer.state.status

    out = run_both(tune, default_root_dir=str(tmp_path))
    assert not isinstance(out["fasttrain"], BaseException), out["fasttrain"]
    assert out["fasttrain"] == out["lightning"]
    assert out["fasttrain"][0] == 8
    assert sorted(p.name for p in tmp_path.glob(".*.ckpt")) == []


@pytest.mark.parametrize("method", ["validate", "test"])
def test_the_batch_size_finder_callback_evaluates_at_the_size_it_finds(tmp_path, method):
    class Finder(BatchSizeFinder):
        def on_fit_start(self, trainer, pl_module):
            pass

    def evaluate(trainer):
        module = Tunable()
        metrics = getattr(trainer, method)(module)
        return metrics, module.batch_size

    out = run_both(evaluate, default_root_dir=str(tmp_path),
                   callbacks=[Finder(steps_per_trial=1, init_val=2, max_trials=2)])
    (ref_metrics, ref_size), (metrics, size) = out["lightning"], out["fasttrain"]
    assert size == ref_size == 4  # 2, then 4 (two trials)
    assert len(metrics) == len(ref_metrics) == 1
    assert sorted(metrics[0]) == sorted(ref_metrics[0])
    for key, value in ref_metrics[0].items():
        assert metrics[0][key] == pytest.approx(value, rel=1e-5)


class RunsOutOfMemory(Tunable):
    """Raises CUDA's out-of-memory error in a training step over more than 12 samples, as a
    device would: the batch size finder backs off from it."""

    def training_step(self, batch, batch_idx):
        if len(batch[0]) > 12:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_the_batch_size_finder_backs_off_from_out_of_memory_errors_as_under_lightning(tmp_path, mode):
    def tune_then_fit(trainer):
        module = RunsOutOfMemory()
        size = Tuner(trainer).scale_batch_size(module, mode=mode, steps_per_trial=1, init_val=2, max_trials=6)
        trainer.fit(module)  # the fit after it runs at the size found (no error)
        return size, module.requested, module, trainer.global_step

    out = run_both(tune_then_fit, max_epochs=1, default_root_dir=str(tmp_path))
    assert not isinstance(out["fasttrain"], BaseException), out["fasttrain"]
    (ref_size, ref_requested, ref_module, ref_step), (size, requested, module, step) = out["lightning"], out["fasttrain"]
    assert size == ref_size <= 12
    assert requested == ref_requested
    assert step == ref_step
    assert_same_weights(ref_module, module)
