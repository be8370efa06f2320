"""``training_step`` returning ``None`` and a loader yielding a ``None`` batch, under automatic
optimization: fasttrain.lightning.Trainer skips what lightning.Trainer skips (the backward, the
update where no gradient was accumulated) and counts, schedules, logs and calls the hooks as it
does; a step that can return None runs on the eager engine."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402
from lightning.pytorch.loops.optimization.automatic import Closure  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402
from fasttrain.lightning.skipped_steps import may_return_none  # noqa: E402
from lightning_modules import DATA, QUIET, Classifier, assert_same_metrics, assert_same_weights, loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class NoneSteps(Classifier):
    """Returns None from ``training_step`` at the batch indices of ``skip``; records what each
    batch sees. Adam with a per-step scheduler, so an update that should not happen shows in
    the weights, the optimizer's step count and the learning rate."""

    def __init__(self, skip=(1, 2, 5)):
        super().__init__()
        self.skip = set(skip)
        self.events = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.events.append(("step", self.current_epoch, batch_idx, self.trainer.global_step))
        if batch_idx in self.skip:
            return None
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.events.append(("before_optimizer_step", [p.grad is None for p in self.parameters()]))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        keys = None if outputs is None else sorted(outputs)
        loop = self.trainer.fit_loop.epoch_loop
        self.events.append(("batch_end", batch_idx, keys, self.trainer.global_step, loop._batches_that_stepped))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _state(trainer, module):
    optimizer = trainer.optimizers[0]
    steps = [float(s["step"]) for s in optimizer.state.values()]
    return {
        "events": module.events,
        "global_step": trainer.global_step,
        "adam_steps": steps,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def _compare(out, ours_module, reference_module):
    reference, ours = out["lightning"], out["fasttrain"]
    assert not isinstance(reference, BaseException), reference
    assert not isinstance(ours, BaseException), ours
    assert ours["events"] == reference["events"]
    assert ours["global_step"] == reference["global_step"]
    assert ours["adam_steps"] == reference["adam_steps"]
    assert ours["lr"] == pytest.approx(reference["lr"], rel=1e-6)
    assert_same_metrics(reference["metrics"], ours["metrics"])
    assert_same_weights(reference_module, ours_module)


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_a_none_training_step_skips_the_update_like_lightning(accumulate):
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = NoneSteps()
        trainer.fit(module, loader(DATA, batch_size=8))
        return _state(trainer, module)

    out = run_both(action, max_epochs=2, accumulate_grad_batches=accumulate)
    _compare(out, modules["fasttrain"], modules["lightning"])
    if accumulate == 1:
        # updates without a gradient changed nothing: Adam stepped fewer times than the fit counts
        assert out["lightning"]["adam_steps"][0] < out["lightning"]["global_step"] == 12


def test_every_batch_returning_none_leaves_the_weights_unchanged_like_lightning():
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = NoneSteps(skip=range(6))
        trainer.fit(module, loader(DATA, batch_size=8))
        return _state(trainer, module)

    out = run_both(action, max_epochs=1)
    _compare(out, modules["fasttrain"], modules["lightning"])
    assert out["fasttrain"]["adam_steps"] == [] and out["fasttrain"]["global_step"] == 6


class OwnZeroGrad(NoneSteps):
    """Overrides the zero-grad hooks, which Lightning calls at a window's first batch whether
    or not its step returns None."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.events.append(("zero_grad", epoch, batch_idx))
        optimizer.zero_grad()


class OwnOptimizerStep(NoneSteps):
    """Overrides ``optimizer_step``: Lightning calls it on every stepping batch, and its closure
    runs the training step (which returns None) without a backward."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.events.append(("optimizer_step", epoch, batch_idx))
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("module_cls", [OwnZeroGrad, OwnOptimizerStep])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_none_steps_with_overridden_update_hooks_call_them_like_lightning(module_cls, accumulate):
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = module_cls(skip=(0, 1, 4))
        trainer.fit(module, loader(DATA, batch_size=8))
        return _state(trainer, module)

    out = run_both(action, max_epochs=2, accumulate_grad_batches=accumulate)
    _compare(out, modules["fasttrain"], modules["lightning"])


def test_the_none_warning_is_lightnings_once_per_process():
    Closure.warning_cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            Trainer(max_epochs=1, **QUIET).fit(NoneSteps(), loader(DATA, batch_size=8))
    said = [str(w.message) for w in caught if "returned `None`" in str(w.message)]
    assert said == ["`training_step` returned `None`. If this was on purpose, ignore this warning..."]


def _none_batches(positions):
    """A collate_fn returning None for the batches at ``positions`` of each 6-batch epoch, as one
    that drops a bad batch does."""
    counter = {"n": 0}

    def collate(items):
        index = counter["n"] % 6
        counter["n"] += 1
        if index in positions:
            return None
        return torch.utils.data.default_collate(items)

    return collate


class Batches(NoneSteps):
    def __init__(self):
        super().__init__(skip=())

    def on_train_batch_start(self, batch, batch_idx):
        self.events.append(("batch_start", batch_idx))


# a None batch opening a window too: Lightning zeroes gradients in the closure of a window's first
# batch, which a None batch does not run, so the window carries the last update's gradients into
# its update; fasttrain.lightning clears them where Lightning does, and so does the same
@pytest.mark.parametrize("accumulate, positions", [(1, (1, 4)), (2, (1, 3)), (3, (1, 5)), (2, (0, 4)), (3, (3,))])
def test_a_none_batch_is_skipped_like_lightning(accumulate, positions):
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = Batches()
        trainer.fit(module, DataLoader(DATA, batch_size=8, collate_fn=_none_batches(positions)))
        return _state(trainer, module)

    out = run_both(action, max_epochs=2, accumulate_grad_batches=accumulate)
    _compare(out, modules["fasttrain"], modules["lightning"])
    ends = [e for e in out["lightning"]["events"] if e[0] == "batch_end"]
    assert ends[positions[0]][2] is None  # on_train_batch_end got outputs=None for the None batch


def test_a_none_batch_gives_lightnings_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(max_epochs=1, **QUIET).fit(Batches(), DataLoader(DATA, batch_size=8, collate_fn=_none_batches((1, 4))))
    said = [str(w.message) for w in caught if "yielded None" in str(w.message)]
    assert said == ["train_dataloader yielded None. If this was on purpose, ignore this warning..."]


# ---------------------------------------------------------------------------------- engines
class Helper(Classifier):
    """Returns None through a helper: nothing in training_step's own code says so."""

    def _maybe(self, loss, batch_idx):
        return None if batch_idx == 3 else loss

    def training_step(self, batch, batch_idx):
        return self._maybe(super().training_step(batch, batch_idx), batch_idx)


def test_which_steps_can_return_none_is_read_from_their_code():
    class Bare(Classifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                return
            return super().training_step(batch, batch_idx)

    class Ternary(Classifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss if batch_idx else None

    class NoReturn(Classifier):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)

    assert may_return_none(NoneSteps()) and may_return_none(Bare()) and may_return_none(Ternary())
    assert may_return_none(NoReturn())
    assert not may_return_none(Classifier()) and not may_return_none(Helper())


def test_a_step_that_can_return_none_runs_on_the_eager_engine_with_one_warning():
    torch.manual_seed(0)
    module = NoneSteps()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(max_epochs=1, engine="compiled", **QUIET)
        trainer.fit(module, loader(DATA, batch_size=8))
    moved = [str(w.message) for w in caught if "eager" in str(w.message)]
    assert len(moved) == 1 and "training_step can return None" in moved[0]
    assert trainer.engine == "eager"


def test_a_none_met_in_the_compiled_engine_falls_back_to_eager_and_matches_lightning():
    modules = {}

    def action(trainer):
        module = modules[type(trainer).__module__.split(".")[0]] = Helper()
        trainer.fit(module, loader(DATA, batch_size=8))
        return trainer

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_both(action, max_epochs=1)
        torch.manual_seed(0)
        ours = modules["fasttrain"] = Helper()
        compiled = Trainer(max_epochs=1, engine="compiled", **QUIET)
        compiled.fit(ours, loader(DATA, batch_size=8))
    assert compiled.engine == "eager" and out["lightning"].global_step == compiled.global_step == 6
    fallbacks = [str(w.message) for w in caught if "falls back" in str(w.message)]
    assert len(fallbacks) == 1 and "training_step returned None" in fallbacks[0]
    assert_same_weights(modules["lightning"], ours, atol=1e-5)


@pytest.mark.filterwarnings("ignore:You defined a `validation_step`")
def test_a_none_step_in_several_processes_is_lightnings_error(monkeypatch):
    trainer = Trainer(max_epochs=1, **QUIET)
    monkeypatch.setattr(type(trainer), "world_size", property(lambda self: 2))
    with pytest.raises(RuntimeError, match="Skipping the `training_step` by returning None in distributed training"):
        trainer.fit(NoneSteps(), loader(DATA, batch_size=8))
