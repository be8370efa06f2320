"""Closure optimizers (LBFGS) under automatic and manual optimization, and what
LightningOptimizer.step() returns: fasttrain.lightning.Trainer does what lightning.Trainer does."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_modules import Classifier, assert_same_weights, train_loader  # noqa: E402
from side_by_side import run_both  # noqa: E402


class LBFGSClassifier(Classifier):
    """Automatic optimization with LBFGS: its step needs the closure (several evaluations)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def training_step(self, batch, batch_idx):
        self.calls.append(("training_step", batch_idx))
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(("on_before_optimizer_step", self.trainer.global_step))

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)


class ManualClosure(Classifier):
    """Manual optimization stepping LBFGS with a closure, then SGD without one; keeps what
    each ``step()`` returned."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.returned = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        lbfgs, sgd = self.optimizers()

        def closure():
            loss = F.cross_entropy(self(x), y)
            lbfgs.zero_grad()
            self.manual_backward(loss)
            return loss

        self.returned.append(lbfgs.step(closure=closure))
        loss = F.cross_entropy(self(x), y)
        sgd.zero_grad()
        self.manual_backward(loss)
        self.returned.append(sgd.step())
        self.returned.append(sgd.step(closure=lambda: torch.tensor(7.0)))

    def configure_optimizers(self):
        return [torch.optim.LBFGS(self.net[0].parameters(), lr=0.3, max_iter=2),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def _fit(factory, **kwargs):
    def action(trainer):
        module = factory()
        trainer.fit(module, train_loader())
        return module, trainer.global_step

    return run_both(action, **kwargs)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lbfgs_under_automatic_optimization_trains_like_lightning(accumulate):
    out = _fit(LBFGSClassifier, max_epochs=2, accumulate_grad_batches=accumulate)
    (reference, ref_steps), (ours, steps) = out["lightning"], out["fasttrain"]
    assert ref_steps == 12 // accumulate
    # LBFGS evaluates the closure several times per step: the training step runs each time
    assert len(reference.calls) > 12 + ref_steps
    assert steps == ref_steps
    assert ours.calls == reference.calls
    assert_same_weights(reference, ours)


def test_closure_optimizers_under_manual_optimization_like_lightning():
    out = _fit(ManualClosure, max_epochs=1)
    (reference, ref_steps), (ours, steps) = out["lightning"], out["fasttrain"]
    assert ref_steps == steps == 18
    # step() returns what the optimizer's step returned: LBFGS its first loss, SGD the closure's value
    assert reference.returned[1] is None and float(reference.returned[2]) == 7.0
    assert len(ours.returned) == len(reference.returned)
    for mine, theirs in zip(ours.returned, reference.returned):
        assert (mine is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(mine, theirs)
    assert_same_weights(reference, ours)


class NormalizedClassifier(Classifier):
    """A BatchNorm layer, whose running statistics StochasticWeightAveraging recomputes for the
    averaged weights in an extra epoch of forward passes only."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_stochastic_weight_averaging_with_batchnorm_ends_with_lightnings_weights(engine):
    """The callback's BatchNorm epoch (fit_loop._skip_backward): training_step runs for its
    statistics, with no backward and no update; the averaged weights and the recomputed running
    statistics are Lightning's, and so are the step count and the epochs."""
    import warnings

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from fasttrain.lightning import Trainer
    from lightning_modules import QUIET
    import lightning as L

    modules, seen = [], []
    for trainer_cls, extra in ((L.Trainer, {}), (Trainer, {"engine": engine})):
        torch.manual_seed(0)
        module = NormalizedClassifier()
        trainer = trainer_cls(**QUIET, max_epochs=4, **extra,
                              callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader())
        modules.append(module)
        seen.append((trainer.global_step, trainer.current_epoch))
    assert seen[1] == seen[0]
    assert_same_weights(modules[0], modules[1])
    assert int(modules[0].net[1].num_batches_tracked) > 0


class InspectsItsClosure(Classifier):
    """An optimizer_step that records what the closure is and what calling it returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        from lightning.pytorch.loops.optimization.automatic import Closure

        holder = {}

        def closure():
            holder["loss"] = optimizer_closure()
            return holder["loss"]

        optimizer.step(closure=closure)
        loss = holder["loss"]
        self.seen.append((isinstance(optimizer_closure, Closure), loss.requires_grad, float(loss)))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_optimizer_closure_is_lightnings_and_returns_its_loss(accumulate):
    """The closure is Lightning's Closure; calling it gives a detached copy of the loss backward
    saw: divided over the accumulation window, as under Lightning."""
    def fit(trainer):
        module = InspectsItsClosure()
        trainer.fit(module, train_loader())
        return module

    out = run_both(fit, max_epochs=1, accumulate_grad_batches=accumulate)
    reference, ours = out["lightning"], out["fasttrain"]
    assert len(ours.seen) == len(reference.seen) == 6 // accumulate
    assert all(is_closure and not requires_grad for is_closure, requires_grad, _ in ours.seen)
    for (_, _, theirs), (_, _, mine) in zip(reference.seen, ours.seen):
        assert mine == pytest.approx(theirs, rel=1e-5)
    assert_same_weights(reference, ours)
