"""Behaviours around a run, each compared with lightning.Trainer: evaluation mode hooks wrapped or
set to None on the instance, configure_callbacks on every run, num_sanity_val_batches, a
ckpt_path="last" without a last checkpoint, optimizer_step hooks that skip the closure or step
under no_grad, and the strategy's teardown at every end of a run (KeyboardInterrupt included)."""

import functools
import signal
import sys
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from lightning_modules import DATA, VAL, Classifier, assert_same_weights, loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class _Modes(Classifier):
    """Records the train/eval mode of the module and of a submodule the user froze in eval mode
    in every evaluation and prediction step."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.BatchNorm1d(6)
        self.frozen.eval()
        self.modes = []

    def _record(self, where):
        self.modes.append((where, self.training, self.net.training, self.frozen.training))

    def validation_step(self, batch, batch_idx):
        self._record("validation")
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self._record("test")
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        self._record("predict")
        return super().predict_step(batch, batch_idx)


def _set_hook(module, variant: str, calls: list):
    """Sets the evaluation mode hooks on the instance, as ``variant`` says."""
    for name in ("on_validation_model_eval", "on_validation_model_train", "on_test_model_eval",
                 "on_test_model_train", "on_predict_model_eval"):
        original = getattr(module, name)
        if variant == "none":
            setattr(module, name, None)
        elif variant == "wrapped":
            def wrapper(*args, _original=original, _name=name, **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)

            setattr(module, name, functools.wraps(original)(wrapper))
        elif variant == "mock":
            setattr(module, name, mock.Mock(wraps=original, side_effect=lambda *a, _n=name: calls.append(_n)))
        elif variant == "replaced":
            setattr(module, name, lambda _n=name: calls.append(_n))


@pytest.mark.parametrize("variant", ["none", "wrapped", "mock", "replaced"])
def test_evaluation_mode_hooks_set_on_the_instance_like_lightning(variant):
    def action(trainer):
        calls = []
        module = _Modes()
        _set_hook(module, variant, calls)
        trainer.fit(module, loader(DATA, batch_size=16), loader(VAL, batch_size=10))
        after_fit = (module.training, module.frozen.training)
        trainer.test(module, loader(VAL, batch_size=10), verbose=False)
        trainer.predict(module, loader(VAL, batch_size=10))
        return module.modes, calls, after_fit, (module.training, module.frozen.training)

    out = run_both(action, max_epochs=2, num_sanity_val_steps=1)
    assert not isinstance(out["lightning"], BaseException), out["lightning"]
    assert out["fasttrain"] == out["lightning"]


class _Counted(L.Callback):
    pass


class _WithCallbacks(Classifier):
    def __init__(self):
        super().__init__()
        self.configured = 0

    def configure_callbacks(self):
        self.configured += 1
        return [_Counted()]


def test_configure_callbacks_on_every_run_like_lightning():
    def action(trainer):
        module = _WithCallbacks()
        seen = []
        for run in ("fit", "fit", "validate", "test", "predict"):
            if run == "fit":
                trainer.fit(module, loader(DATA, batch_size=16), loader(VAL, batch_size=10))
            elif run == "predict":
                trainer.predict(module, loader(VAL, batch_size=10))
            else:
                getattr(trainer, run)(module, loader(VAL, batch_size=10), verbose=False)
            seen.append((module.configured, [type(cb).__name__ for cb in trainer.callbacks]))
        return seen

    out = run_both(action, max_epochs=1)
    assert out["lightning"][-1][0] == 5
    assert out["fasttrain"] == out["lightning"]


@pytest.mark.parametrize("steps", [0, 1, 2, -1])
def test_num_sanity_val_batches_like_lightning(steps):
    class Several(Classifier):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            return super().validation_step(batch, batch_idx)

    class Seen(L.Callback):
        def __init__(self):
            self.seen = []

        def on_sanity_check_start(self, trainer, module):
            self.seen.append(("sanity", trainer.num_sanity_val_batches, trainer.num_sanity_val_steps))

        def on_train_start(self, trainer, module):
            self.seen.append(("train", trainer.num_sanity_val_batches, trainer.num_sanity_val_steps))

    def action(trainer):
        seen = Seen()
        trainer.callbacks.append(seen)
        before = trainer.num_sanity_val_batches
        trainer.fit(Several(), loader(DATA, batch_size=16), [loader(VAL, batch_size=5), loader(VAL, batch_size=8)])
        return before, seen.seen, trainer.num_sanity_val_batches

    out = run_both(action, max_epochs=1, num_sanity_val_steps=steps)
    assert out["fasttrain"] == out["lightning"]


def test_ckpt_path_last_without_a_last_checkpoint_warns_and_starts_fresh_like_lightning(tmp_path):
    def action(trainer):
        torch.manual_seed(0)
        module = Classifier()
        with pytest.warns(UserWarning, match='ckpt_path="last"\\) is set, but there is no last checkpoint available'):
            trainer.fit(module, loader(DATA, batch_size=16), ckpt_path="last")
        return module, trainer.global_step, trainer.current_epoch, trainer.ckpt_path

    out = {}
    for name, trainer_cls in (("lightning", L.Trainer), ("fasttrain", __import__("fasttrain.lightning").lightning.Trainer)):
        trainer = trainer_cls(max_epochs=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
                              callbacks=[ModelCheckpoint(dirpath=tmp_path / name, save_last=True)])
        out[name] = action(trainer)
    assert out["fasttrain"][1:] == out["lightning"][1:] == (6, 2, None)
    assert_same_weights(out["lightning"][0], out["fasttrain"][0])


class _SkipsClosure(Classifier):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step()  # the closure (training step and backward) never runs


def test_optimizer_step_that_skips_the_closure_is_lightnings_error():
    out = run_both(lambda trainer: trainer.fit(_SkipsClosure(), loader(DATA, batch_size=16)), max_epochs=1)
    assert isinstance(out["lightning"], MisconfigurationException)
    assert type(out["fasttrain"]) is type(out["lightning"])
    assert str(out["fasttrain"]) == str(out["lightning"])


class _NoGradStepping(torch.optim.SGD):
    """An optimizer whose step evaluates the closure under no_grad (its own decorator)."""

    @torch.no_grad()
    def step(self, closure):
        loss = closure()
        super().step()
        return loss


class _WithNoGradOptimizer(Classifier):
    def configure_optimizers(self):
        return _NoGradStepping(self.parameters(), lr=0.1)


def test_a_closure_optimizer_that_steps_under_no_grad_trains_like_lightning():
    def action(trainer):
        torch.manual_seed(0)
        module = _WithNoGradOptimizer()
        trainer.fit(module, loader(DATA, batch_size=16))
        return module, trainer.global_step

    out = run_both(action, max_epochs=2)
    assert not isinstance(out["fasttrain"], BaseException), out["fasttrain"]
    assert out["fasttrain"][1] == out["lightning"][1] == 6
    assert_same_weights(out["lightning"][0], out["fasttrain"][0])


class _Fails(Classifier):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.error is not None and batch_idx == 1:
            raise self.error("stop")


@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_the_strategy_teardown_ends_every_run_like_lightning(error):
    previous = signal.getsignal(signal.SIGINT)

    def action(trainer):
        calls = []

        class Record(L.Callback):
            def on_exception(self, trainer, module, exception):
                calls.append("on_exception")

            def on_fit_end(self, trainer, module):
                calls.append("on_fit_end")

            def teardown(self, trainer, module, stage):
                calls.append("teardown")

        trainer.callbacks.append(Record())
        original = trainer.strategy.teardown
        trainer.strategy.teardown = lambda: (calls.append("strategy.teardown"), original())[1]
        try:
            trainer.fit(_Fails(error), loader(DATA, batch_size=16))
        except SystemExit as exit_:
            calls.append(("exit", exit_.code))
        except RuntimeError:
            calls.append("raised")
        signal.signal(signal.SIGINT, previous)
        return calls

    out = run_both(action, max_epochs=1)
    assert out["fasttrain"] == out["lightning"]
    assert out["lightning"][-1] == {None: "teardown", RuntimeError: "raised", KeyboardInterrupt: ("exit", 1)}[error]
