"""Hook order: every hook a module or a callback overrides is called in Lightning's order."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_modules import QUIET, Classifier, classification_data, fit_both, loader, train_loader, val_loader  # noqa: E402

MODULE_HOOKS = [
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "setup", "teardown", "configure_model",
    "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end",
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "backward", "on_after_backward",
    "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step", "lr_scheduler_step",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_validation_model_eval",
    "on_validation_model_train", "on_validation_model_zero_grad", "on_save_checkpoint",
]
CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_validation_start", "on_validation_end", "on_validation_epoch_start",
    "on_validation_epoch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
]


def _recording(cls, hooks, prefix, calls):
    def make(name):
        base = getattr(cls, name)

        def hook(self, *args, **kwargs):
            calls.append(f"{prefix}.{name}")
            return base(self, *args, **kwargs)

        return hook

    return type(f"Recording{cls.__name__}", (cls,), {name: make(name) for name in hooks})


# without the optimizer_step and zero-grad overrides, the update runs in the engine's own order
ENGINE_PATH_EXCLUDED = {"optimizer_step", "optimizer_zero_grad", "on_before_zero_grad"}


@pytest.mark.parametrize("path", ["closure", "engine"])
def test_fit_hook_order_matches_lightning(path):
    calls = []
    module_hooks = MODULE_HOOKS if path == "closure" else [h for h in MODULE_HOOKS if h not in ENGINE_PATH_EXCLUDED]
    callback_hooks = CALLBACK_HOOKS if path == "closure" else [
        h for h in CALLBACK_HOOKS if h not in ENGINE_PATH_EXCLUDED]

    class Scheduled(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                       "interval": "step"}}

    module_cls = _recording(Scheduled, module_hooks, "module", calls)
    callback_cls = _recording(L.Callback, callback_hooks, "callback", calls)
    runs = []

    def factory():
        return module_cls()

    def train():
        calls.clear()
        return loader(classification_data(n=20), batch_size=4)

    def val():
        return loader(classification_data(n=8, seed=1), batch_size=4)

    class Collect(L.Callback):
        def on_fit_end(self, trainer, module):
            runs.append(list(calls))

    kwargs = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, limit_val_batches=1,
                  num_sanity_val_steps=1, callbacks=[callback_cls(), Collect()])
    results = fit_both(factory, train, val, trainer_kwargs=kwargs)
    lightning_calls, fasttrain_calls = runs
    assert len(fasttrain_calls) > 100
    assert fasttrain_calls == lightning_calls
    assert results[0].global_step == results[2].global_step == 6


def test_on_train_batch_end_gets_lightnings_outputs():
    """The loss divided by the accumulation steps, and the other entries of a returned dict."""
    from lightning_modules import TinyGPT, token_data

    seen = {"lightning": [], "fasttrain": []}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen[type(trainer).__module__.split(".")[0]].append(
                (batch_idx, sorted(outputs), float(outputs["loss"]), int(outputs["tokens"])))

    fit_both(TinyGPT, lambda: loader(token_data(n=24), batch_size=4),
             trainer_kwargs=dict(max_epochs=1, accumulate_grad_batches=2, callbacks=[Record()]))
    assert len(seen["fasttrain"]) == len(seen["lightning"]) == 6
    for (idx, keys, loss, tokens), (l_idx, l_keys, l_loss, l_tokens) in zip(seen["fasttrain"], seen["lightning"]):
        assert (idx, keys, tokens) == (l_idx, l_keys, l_tokens) == (idx, ["loss", "tokens"], 32)
        assert loss == pytest.approx(l_loss, rel=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_global_module_hooks_see_the_modules_that_lightning_calls_and_nothing_around_the_steps(precision):
    # Lightning's single-process strategies call training_step and validation_step on the module
    # itself (under autocast in mixed precision): a global forward hook sees the module's own
    # calls (self(x) and its layers), never a call wrapping the step
    from fasttrain.lightning import Trainer as FastTrainer

    calls = {}
    current = []

    def record(module, args):
        calls[current[0]].append(type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        for trainer_cls in (L.Trainer, FastTrainer):
            current[:] = [trainer_cls.__module__]
            calls[current[0]] = []
            torch.manual_seed(0)
            trainer_cls(max_epochs=1, num_sanity_val_steps=1, precision=precision, **QUIET).fit(
                Classifier(), train_loader(), val_loader()
            )
    finally:
        handle.remove()
    lightning_calls, fasttrain_calls = calls.values()
    assert lightning_calls[:5] == ["Classifier", "Sequential", "Linear", "Tanh", "Linear"]
    assert fasttrain_calls == lightning_calls


class RecordsRunStarts(Classifier):
    """Records ``zero_grad`` (nn.Module's, which Lightning calls on the module as each run's loop
    starts) among the hooks around it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(("zero_grad", self.trainer.state.fn.value if self._trainer is not None else None))
        super().zero_grad(set_to_none)

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        return train_loader()

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return val_loader()

    def test_dataloader(self):
        self.calls.append("test_dataloader")
        return val_loader()

    def predict_dataloader(self):
        self.calls.append("predict_dataloader")
        return loader(classification_data(n=8, seed=1).tensors[0], batch_size=4)

    def on_train_start(self):
        self.calls.append("on_train_start")

    def on_validation_start(self):
        self.calls.append("on_validation_start")


@pytest.mark.parametrize("run", ["fit", "validate", "test", "predict"])
def test_each_run_starts_with_the_modules_zero_grad_as_under_lightning(run):
    """Lightning calls the module's zero_grad() (gradients to None) as each run's loop starts:
    a fit's after on_fit_start and before the validation loader's request, an evaluation's before
    its loader's; gradients left by earlier code are gone during an evaluation too."""
    from fasttrain.lightning import Trainer

    seen = []
    for trainer_cls in (L.Trainer, Trainer):
        torch.manual_seed(0)
        module = RecordsRunStarts()
        for p in module.parameters():
            p.grad = torch.ones_like(p)  # left by the user's own code before the run
        trainer = trainer_cls(**{**QUIET, "max_epochs": 1, "limit_train_batches": 2, "limit_val_batches": 1,
                                 "num_sanity_val_steps": 0})
        getattr(trainer, run)(module)
        calls = [c for c in module.calls if c != "train_dataloader"]  # requested at another time (docs/lightning.md)
        seen.append((calls, run == "fit" or all(p.grad is None for p in module.parameters())))
    assert seen[1] == seen[0]
    assert seen[0][1] and ("zero_grad", run if run != "validate" else "validate") in seen[0][0]
