"""Hooks set on the instance (LambdaCallback, ``model.hook = f``, ``mock.patch.object``) and
steps or hooks set to ``None``: fasttrain.lightning.Trainer does what lightning.Trainer does."""

import sys
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

from lightning.pytorch.callbacks import LambdaCallback  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from lightning_modules import VAL, Classifier, loader, train_loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


def _fit(module_factory, epochs=2, val=True):
    def action(trainer):
        module = module_factory()
        trainer.fit(module, train_loader(), loader(VAL, batch_size=10) if val else None)
        return module

    return action


def test_lambda_callback_hooks_are_called_like_lightning():
    calls = {}

    def action(trainer):
        seen = calls.setdefault(type(trainer).__module__, [])
        callback = LambdaCallback(
            on_train_epoch_start=lambda t, m: seen.append(("epoch_start", t.current_epoch)),
            on_train_batch_end=lambda t, m, out, batch, i: seen.append(("batch_end", i)),
            on_validation_end=lambda t, m: seen.append(("val_end", t.sanity_checking)),
            on_fit_end=lambda t, m: seen.append(("fit_end", t.global_step)),
        )
        trainer.callbacks.append(callback)
        trainer.fit(Classifier(), train_loader(), loader(VAL, batch_size=10))

    run_both(action, max_epochs=2)
    ours, reference = calls["fasttrain.lightning.trainer"], calls["lightning.pytorch.trainer.trainer"]
    assert ("fit_end", 12) in reference
    assert ours == reference


def test_hooks_set_on_the_instance_are_called_like_lightning():
    seen = {}

    def action(trainer):
        calls = seen.setdefault(type(trainer).__module__, [])
        module = Classifier()
        module.on_train_epoch_start = lambda: calls.append(("epoch_start", module.current_epoch))
        module.on_validation_epoch_end = lambda: calls.append(("val_epoch_end", module.trainer.sanity_checking))
        with mock.patch.object(module, "on_train_batch_end") as batch_end, \
                mock.patch.object(module, "on_train_end", wraps=lambda: calls.append("train_end")):
            trainer.fit(module, train_loader(), loader(VAL, batch_size=10))
        calls.append(("batch_end", batch_end.call_count, [c.args[2] for c in batch_end.call_args_list][:3]))

    run_both(action, max_epochs=2)
    ours, reference = seen["fasttrain.lightning.trainer"], seen["lightning.pytorch.trainer.trainer"]
    assert ("batch_end", 12, [0, 1, 2]) in reference
    assert ours == reference


def test_validation_step_set_to_none_skips_validation_like_lightning():
    def factory():
        module = Classifier()
        module.validation_step = None
        return module

    def action(trainer):
        module = factory()
        trainer.fit(module, train_loader(), loader(VAL, batch_size=10))
        return trainer.global_step, sorted(trainer.callback_metrics), trainer.fit_loop.epoch_loop.val_loop._has_run

    out = run_both(action, max_epochs=2)
    assert out["lightning"] == (12, ["train_loss", "train_loss_epoch", "train_loss_step", "train_max"], False)
    assert out["fasttrain"] == out["lightning"]


@pytest.mark.parametrize("hook", ["configure_optimizers", "training_step"])
def test_required_hook_set_to_none_raises_like_lightning(hook):
    def action(trainer):
        module = Classifier()
        setattr(module, hook, None)
        trainer.fit(module, train_loader())

    out = run_both(action, max_epochs=1)
    assert isinstance(out["lightning"], MisconfigurationException)
    assert type(out["fasttrain"]) is type(out["lightning"])
    assert str(out["fasttrain"]) == str(out["lightning"])


def test_a_callback_hook_set_to_none_is_skipped_like_lightning():
    import lightning as L

    seen = []

    class Watch(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append(type(trainer).__module__)

    def action(trainer):
        callback = Watch()
        callback.on_train_epoch_end = None
        trainer.callbacks.append(callback)
        trainer.fit(Classifier(), train_loader())
        return trainer.global_step

    out = run_both(action, max_epochs=1)
    assert out == {"lightning": 6, "fasttrain": 6}
    assert seen == []


@pytest.mark.parametrize("entry,step", [("validate", "validation_step"), ("test", "test_step"),
                                        ("predict", "predict_step")])
def test_an_evaluation_step_set_to_none_raises_like_lightning(entry, step):
    def action(trainer):
        module = Classifier()
        setattr(module, step, None)
        getattr(trainer, entry)(module, loader(VAL, batch_size=10))

    out = run_both(action)
    assert isinstance(out["lightning"], MisconfigurationException)
    assert isinstance(out["fasttrain"], MisconfigurationException)
    assert str(out["fasttrain"]) == str(out["lightning"])
