"""An unchanged LightningModule on the CUDA-graphed engine, its logic run on the CPU with the host
stand-ins of test_engine_graph_logic (the same fit runs on a GPU in test_lightning_engines):
Lightning's default zero-grad keeps the graphs, ``self.log`` in a replayed step is filed as if the
step had run, and a logged torchmetrics Metric keeps the step off the graphs."""

import functools
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

from fasttrain.engine import ENGINES  # noqa: E402
from fasttrain.engine.step_guards import run_by_design  # noqa: E402
from fasttrain.lightning import Trainer  # noqa: E402
from lightning_modules import (  # noqa: E402
    QUIET,
    Classifier,
    assert_same_metrics,
    assert_same_weights,
    classification_data,
    fit_both,
    loader,
    train_loader,
)
from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: E402,F401


def val_loader():
    return loader(classification_data(n=16, seed=1), batch_size=8)


class ReplaysRunNoPython(HostGraphEngine):
    """The stand-in's replay runs the recorded step again; a real replay runs its kernels only,
    none of the step's Python, and writes its outputs into the memory of the captured ones. So
    the values a stand-in replay logs are written into the tensors the capture logged, and the
    calls themselves dropped: the calls a real replay would leave out are left out."""

    def _record(self, body):
        lt = self.trainer.lt
        stores = (lt._train_results, lt._val_results, lt._test_results)
        before = [len(store.pending) for store in stores]
        graph, outputs = super()._record(body)
        captured = [store.pending[length:] for store, length in zip(stores, before)]
        step = graph._body

        def kernels_only():
            lengths = [len(store.pending) for store in stores]
            for store in stores:  # the step's eager hooks record their calls too, as at capture
                store.recording = True
            try:
                step()
            finally:
                for store in stores:
                    store.recording = False
            with _disable_current_modes():  # the stand-in's own copies are no kernels of the step
                for store, length, calls in zip(stores, lengths, captured):
                    for call, template in zip(store.pending[length:], calls):
                        if isinstance(template[2], torch.Tensor):  # a logged number is a constant of the capture
                            template[2].copy_(call[2])  # the value, into the captured value's memory
                    del store.pending[length:]

        graph._body = kernels_only
        return graph, outputs


@pytest.fixture
def graphed_engine(monkeypatch):
    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)


def fit_graphed(module_cls, max_epochs):
    """``fit_both`` with fasttrain.lightning on the graphed engine (the stand-ins of this file)."""
    return fit_both(module_cls, train_loader, trainer_kwargs=dict(max_epochs=max_epochs),
                    fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT))


def _replays():
    return sum(graph.replays for graph in HostGraphEngine.graphs)


def test_the_graphed_engine_fits_a_default_module_as_lightning_does(graphed_engine):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(
            Classifier, train_loader, val_loader, trainer_kwargs=dict(max_epochs=3),
            fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT),
        )
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ours == []
    assert ft.engine == "cudagraph"
    engine = ft._runner._engine
    assert set(engine._train_graphs) == {True} and engine.active_eval_engine == "cudagraph"
    # Lightning's default zeroing: in place, in the step before its backward (runner._ZeroGradAhead),
    # not in the update's zero-grad hook
    assert not engine._grads.cleared and not engine._own_zero_grad
    assert _replays() > 0
    assert ft.global_step == lt.global_step == 18
    assert_same_weights(lm, fm, atol=1e-5)
    # the logged values of replayed steps (train_loss on step and epoch, max, validation means)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)


class NotesWhereGradientsClear(ReplaysRunNoPython):
    """Notes, at each clearing of the gradients, whether a recorded step (a capture's run or a
    replay) is running: a real replay runs only what its capture recorded."""

    inside_a_graph = 0

    def _record(self, body):
        return super()._record(functools.partial(_marked, body))


def _marked(body):
    NotesWhereGradientsClear.inside_a_graph += 1
    try:
        return body()
    finally:
        NotesWhereGradientsClear.inside_a_graph -= 1


run_by_design(_marked)  # the stand-in's, not the step's, Python (step_guards.FramesRun)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightnings_default_zeroing_is_recorded_in_the_graphs_where_every_batch_opens_a_window(
    monkeypatch, accumulate
):
    """A replayed step clears the gradients inside its graph, as its capture recorded it in the
    backward step (in place, where Lightning clears them): the host launches nothing for it. With
    accumulation the non-stepping batches share a graph whether they open a window or not, so the
    first batch of each window is cleared before its step, outside the graph."""
    from fasttrain.lightning.runner import ModuleRunner

    clearings = []
    original = ModuleRunner.zero_grad_at_window_start

    def noting(self, in_place=False):
        clearings.append((NotesWhereGradientsClear.inside_a_graph > 0, in_place))
        return original(self, in_place)

    run_by_design(noting)  # called by the step's backward: the test's Python, not the step's
    monkeypatch.setattr(ModuleRunner, "zero_grad_at_window_start", noting)
    monkeypatch.setitem(ENGINES, "cudagraph", NotesWhereGradientsClear)
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader, trainer_kwargs=dict(max_epochs=3, accumulate_grad_batches=accumulate),
        fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT),
    )
    assert ft.engine == "cudagraph" and ft.global_step == lt.global_step
    replayed = sum(graph.replays for graph in HostGraphEngine.graphs if graph.captured_grads)
    assert replayed > 0
    assert all(in_place for _, in_place in clearings)  # the tensors the graphs accumulate into stay
    outside = [inside for inside, _ in clearings].count(False)
    if accumulate == 1:
        # one clearing per batch: recorded for the replayed ones, eager for those that ran compiled
        assert outside == 18 - replayed and len(clearings) > 18
    else:
        assert outside == 9 and len(clearings) == 9  # before each window's first batch, eagerly
    assert_same_weights(lm, fm, atol=1e-5)


class CountsEpochChecks(ReplaysRunNoPython):
    """Counts the checks the graphed engine makes at an epoch's first step (what a callback may
    have frozen or swapped at the epoch's start)."""

    epoch_checks = 0

    def _check_trainable(self):
        CountsEpochChecks.epoch_checks += 1
        super()._check_trainable()


class _Stream(torch.utils.data.IterableDataset):
    """The samples of a dataset, streamed: a loader of unknown length."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


@pytest.mark.parametrize("length", ["known", "unknown"])
def test_an_epoch_whose_last_batch_is_partial_keeps_the_graphs_as_under_lightning(monkeypatch, length):
    """52 samples in batches of 8: six full batches and a last one of 4 each epoch. The engine
    sees Lightning's batch index and last-batch flag (from a one-batch look-ahead where the
    loader has no length): the partial batch runs on graphs of its own (not a change of shape
    that ends the graphs), and what an epoch's start may change is checked once per epoch, not
    at every step."""
    monkeypatch.setitem(ENGINES, "cudagraph", CountsEpochChecks)
    CountsEpochChecks.epoch_checks = 0

    def partial_last_batch():
        if length == "unknown":
            return torch.utils.data.DataLoader(_Stream(classification_data(n=52)), batch_size=8)
        return loader(classification_data(n=52), batch_size=8, shuffle=True)

    lt, lm, ft, fm = fit_both(Classifier, partial_last_batch, trainer_kwargs=dict(max_epochs=3),
                              fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT))
    assert ft.engine == "cudagraph"
    engine = ft._runner._engine
    assert set(engine._train_graphs) == {True} and set(engine._last_graphs) == {True}
    assert CountsEpochChecks.epoch_checks == 3
    assert ft.global_step == lt.global_step == 21
    assert_same_weights(lm, fm, atol=1e-5)


class LogsAMetric(Classifier):
    def __init__(self):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.accuracy = MulticlassAccuracy(num_classes=3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("train_acc", self.accuracy, on_step=False, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits, y)


def test_a_logged_metric_keeps_the_step_off_the_graphs_with_one_warning(graphed_engine):
    pytest.importorskip("torchmetrics")
    lt, lm, ft, fm = fit_graphed(LogsAMetric, max_epochs=2)
    assert ft.engine == "compiled"
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(max_epochs=1, engine="cudagraph", compile_options=AOT, **QUIET).fit(LogsAMetric(), train_loader())
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert len(ours) == 1 and "torchmetrics Metric" in ours[0] and "'compiled'" in ours[0]


class GathersOutputs(Classifier):
    """Lightning's documented way to reduce a step's results at the epoch end."""

    def __init__(self):
        super().__init__()
        self.validation_step_outputs = []
        self.epoch_means = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.validation_step_outputs.append(loss)
        return loss

    def on_validation_epoch_end(self):
        self.epoch_means.append(torch.stack(self.validation_step_outputs).mean())
        self.log("val_mean", self.epoch_means[-1])
        self.validation_step_outputs.clear()


def test_a_step_that_appends_to_a_module_attribute_is_not_replayed(graphed_engine):
    lt, lm, ft, fm = fit_both(
        GathersOutputs, train_loader, val_loader, trainer_kwargs=dict(max_epochs=3),
        fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT),
    )
    engine = ft._runner._engine
    assert ft.engine == "cudagraph" and engine.active_eval_engine == "compiled"
    # every validation gathered all of its steps' losses, as under Lightning
    assert len(fm.epoch_means) == len(lm.epoch_means)
    for ours, theirs in zip(fm.epoch_means, lm.epoch_means):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert_same_weights(lm, fm, atol=1e-5)


def test_a_counter_in_the_update_hook_refuses_the_capture_naming_it(graphed_engine):
    """The module's own update hooks are captured with the update (and watched as the training step
    is): a counter there, which a replay would not advance, refuses the capture; the warning names
    the attribute and the step, not a hook the engine happened to be in."""
    from test_lightning_engines import HostSideStep

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(HostSideStep, train_loader, trainer_kwargs=dict(max_epochs=2),
                                  fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT), quiet=False)
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ft.engine == "compiled"
    assert "'host_steps'" in ours[0] and "the 'cudagraph' engine cannot run here" in ours[0], ours
    assert fm.host_steps == lm.host_steps == 12
    assert_same_weights(lm, fm, atol=1e-5)


class LogsAroundTheBackward(Classifier):
    """Logs the loss before the backward and each layer's gradient norm after it, on the device
    (no host read)."""

    def on_before_backward(self, loss):
        self.log("loss_before_backward", loss * 3)

    def on_after_backward(self):
        self.log_dict({f"grad/{name}": p.grad.norm() for name, p in self.net.named_parameters()})


class GradientNormsAfterBackward(Classifier):
    """Lightning's grad_norm after the backward: eagerly, it builds the total norm on the host;
    traced by dynamo, on the device."""

    def on_after_backward(self):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self.net, norm_type=2))


class ReadsTheHostAfterBackward(Classifier):
    """Logs a gradient norm read on the host: dynamo cannot trace it into one graph."""

    def on_after_backward(self):
        self.log("norm_on_the_host", self.net[0].weight.grad.norm().item())


class BreaksTheGraphAfterBackward(Classifier):
    """Python dynamo does not trace (here, an explicit graph break), with no host read."""

    def on_after_backward(self):
        torch._dynamo.graph_break()
        self.log("norm_after_a_break", self.net[0].weight.grad.norm())


class BranchesOnTheStepAfterBackward(Classifier):
    """Logs the first layer's gradient norm under one of two names, by the parity of the step
    (Lightning's own example of the hook logs every 25 steps this way): Python a replay skips."""

    def on_after_backward(self):
        norm = self.net[0].weight.grad.norm()
        if self.global_step % 2 == 0:
            self.log("even_step_norm", norm, on_step=True, on_epoch=False)
        else:
            self.log("odd_step_norm", norm * 2, on_step=True, on_epoch=False)


class HalvesTheGradientsFromTheSecondEpoch(Classifier):
    """Scales the gradients by a number read from the epoch, which changes once."""

    def on_after_backward(self):
        scale = 1.0 if self.current_epoch == 0 else 0.5
        for p in self.parameters():
            p.grad.mul_(scale)


class ScalesTheLossBeforeTheBackwardByTheEpoch(Classifier):
    """Logs the loss scaled by the epoch (a number in on_before_backward's Python)."""

    def on_before_backward(self, loss):
        self.log("scaled_loss", loss * (self.current_epoch + 1), on_step=True, on_epoch=True)


class LogsGradientNormsFromACallback(L.Callback):
    """A callback logging the gradients' norms through the module, after the backward and, with
    Lightning's grad_norm, before the update."""

    def on_after_backward(self, trainer, module):
        module.log("first_layer_norm", module.net[0].weight.grad.norm())

    def on_before_optimizer_step(self, trainer, module, optimizer):
        from lightning.pytorch.utilities import grad_norm

        module.log_dict(grad_norm(module, norm_type=2))


class ReadsGradientsAfterBackward(L.Callback):
    def __init__(self):
        self.norms = []

    def on_after_backward(self, trainer, module):
        self.norms.append(sum(p.grad.norm() for p in module.parameters()))


@pytest.mark.parametrize("module_cls, callbacks, runs, warned", [
    (LogsAroundTheBackward, (), "cudagraph", None),
    (GradientNormsAfterBackward, (), "cudagraph", None),
    (HalvesTheGradientsFromTheSecondEpoch, (), "cudagraph", None),
    (ScalesTheLossBeforeTheBackwardByTheEpoch, (), "cudagraph", None),
    (BranchesOnTheStepAfterBackward, (), "compiled", "the 'on_after_backward' hook cannot run in the 'cudagraph' engine "
     "(the step compiled again while it was captured: its hooks read a Python value that changes between steps"),
    (ReadsTheHostAfterBackward, (), "compiled", "called a synchronizing CUDA operation (host read during capture)"),
    (BreaksTheGraphAfterBackward, (), "compiled", "on_after_backward (the module's or a callback's) does not trace into one graph"),
    (Classifier, (LogsGradientNormsFromACallback,), "cudagraph", None),
    (Classifier, (ReadsGradientsAfterBackward,), "compiled",
     "the step changed the callback ReadsGradientsAfterBackward's attribute 'norms' in Python"),
], ids=["module-logs", "module-grad-norm", "module-scales-by-the-epoch", "module-logs-by-the-epoch-before",
        "module-branches-on-the-step", "module-reads-the-host", "module-breaks-the-graph", "callback-logs",
        "callback-appends"])
def test_the_modules_own_backward_hooks_are_captured_with_the_step(graphed_engine, module_cls, callbacks, runs, warned):
    """The module's on_before_backward and on_after_backward run compiled inside a capture: their
    self.log calls are recorded and filed again after each replay, with accumulation too, and what
    their Python reads is checked before each replay. A number that changed once (the epoch) has
    the step captured again; one that changes at every step (a branch on global_step, which a
    replay would freeze) and a hook dynamo cannot trace whole (a host read) keep the fit on the
    compiled engine, where these hooks run eagerly. A callback's hooks there are captured alike,
    what they change on their callback refusing the capture (an append to a list). In every case
    the weights and the logged values are Lightning's."""
    ours_callbacks = [cls() for cls in callbacks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(
            module_cls, train_loader,
            trainer_kwargs=dict(max_epochs=3, accumulate_grad_batches=2, callbacks=[cls() for cls in callbacks]),
            fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT, callbacks=ours_callbacks), quiet=False,
        )
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ft.engine == runs
    if runs == "cudagraph":
        assert ours == [] and _replays() > 0
    else:
        assert len(ours) == 1 and warned in ours[0] and "'compiled'" in ours[0], ours
    if hasattr(ours_callbacks[0] if callbacks else None, "norms"):
        assert len(ours_callbacks[0].norms) == 18  # the refused capture's append was undone
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)


def test_a_backward_hook_past_dynamos_recompile_limit_is_not_captured(graphed_engine, monkeypatch):
    """Past dynamo's recompile limit a compiled hook runs uncompiled, and the guards of its
    variants say nothing of the call a capture made: the capture is refused (the fit runs
    compiled, with Lightning's values), here with the limit reached at once."""
    from fasttrain.lightning import graphed_hooks

    monkeypatch.setattr(graphed_hooks, "compiled_variants",
                        lambda code: [None] * torch._dynamo.config.recompile_limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(
            LogsAroundTheBackward, train_loader, trainer_kwargs=dict(max_epochs=2),
            fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT), quiet=False,
        )
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ft.engine == "compiled" and _replays() == 0
    assert len(ours) == 1 and "compiled once per value of a number it reads" in ours[0], ours
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)


def _gradients(module) -> list:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


class ReadsGradientsAroundTheZeroing(L.Callback):
    """Records, into the module's ``seen``, the gradients at each batch's start, before each
    clearing and at each batch's end, with the step counter: what eager training shows a hook."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        module.seen.append(("batch_start", trainer.global_step, _gradients(module)))

    def on_before_zero_grad(self, trainer, module, optimizer):
        module.seen.append(("on_before_zero_grad", trainer.global_step, _gradients(module)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.seen.append(("batch_end", trainer.global_step, _gradients(module)))


class ClearsGradientsItself(Classifier):
    """Clears the gradients in its own optimizer_zero_grad (to None, torch's default, or to zeros
    in place) and reads them through a callback of its own around each clearing."""

    set_to_none = True

    def __init__(self):
        super().__init__()
        self.seen = []

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.seen.append(("optimizer_zero_grad", batch_idx, _gradients(self)))
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def configure_callbacks(self):
        return [ReadsGradientsAroundTheZeroing()]


class ClearsGradientsToZeros(ClearsGradientsItself):
    set_to_none = False


class ReadsGradientsBeforeLightningsZeroing(Classifier):
    """Lightning's own optimizer_zero_grad (gradients to None), with a callback reading them
    before each clearing: the callback's hook makes the zeroing the module's, as in Lightning."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def configure_callbacks(self):
        return [ReadsGradientsAroundTheZeroing()]


def _assert_same_sightings(reference: list, ours: list) -> None:
    assert [event[:2] for event in ours] == [event[:2] for event in reference]
    for (name, step, theirs), (_, _, mine) in zip(reference, ours):
        assert [g is None for g in mine] == [g is None for g in theirs], (name, step)
        for a, b in zip(theirs, mine):
            if a is not None:
                torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=f"{name} at step {step}")


@pytest.mark.parametrize("module_cls, accumulate", [
    (ClearsGradientsItself, 1),
    (ClearsGradientsItself, 2),
    (ClearsGradientsToZeros, 2),
    (ReadsGradientsBeforeLightningsZeroing, 2),
], ids=["to-none", "to-none-accumulating", "to-zeros-accumulating", "callback-reads-before"])
def test_zero_grad_hooks_that_clear_gradients_keep_the_graphs_and_show_what_lightning_shows(
    graphed_engine, module_cls, accumulate
):
    """The zero-grad hooks Lightning calls at the start of each accumulation window (the module's
    optimizer_zero_grad, a callback's on_before_zero_grad) run eagerly before each graphed step,
    whatever they do to the gradients: the fit stays on the graphed engine, the hooks see the
    gradients Lightning shows them, and the weights are Lightning's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(
            module_cls, train_loader, trainer_kwargs=dict(max_epochs=3, accumulate_grad_batches=accumulate),
            fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT), quiet=False,
        )
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ours == []
    assert ft.engine == "cudagraph"
    assert True in ft._runner._engine._train_graphs and _replays() > 0
    assert len(fm.seen) == len(lm.seen) > 18 * 2
    _assert_same_sightings(lm.seen, fm.seen)
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)


class ReadsTheStep(Classifier):
    """Logs Lightning's step counter and branches on the batch index: Python values that change
    every batch, which a replayed graph would repeat as captured."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("step_seen", float(self.global_step), on_step=True, on_epoch=False)
        if batch_idx == 1:
            loss = loss * 2
        return loss


def test_a_step_reading_the_batch_index_and_global_step_is_not_replayed_stale(graphed_engine, dynamos_own_limits):
    lt, lm, ft, fm = fit_graphed(ReadsTheStep, max_epochs=3)
    # no graph is kept: each capture compiled the step again; the compiled engine then takes the
    # step counter and the batch index as symbolic integers (symbolic_ints.py) and stays compiled
    assert ft.engine == "compiled"
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)
    assert float(ft.logged_metrics["step_seen"]) == float(lt.logged_metrics["step_seen"]) == 17.0
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(max_epochs=3, engine="cudagraph", compile_options=AOT, **QUIET).fit(ReadsTheStep(), train_loader())
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert len(ours) == 1, ours
    assert "compiled again while it was captured" in ours[0] and "lightning_graphed.py" in ours[0], ours
    assert "'compiled'" in ours[0], ours


class WeighsByTheBatchIndex(Classifier):
    """Weighs the training and validation losses by the batch index: values that come back every
    epoch, each compiled by the end of the first, so that no later capture compiles."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y) * (1.0 + 0.1 * batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y) * (1.0 + 0.1 * batch_idx))


def test_a_step_weighed_by_the_batch_index_trains_as_under_lightning(graphed_engine):
    # the graphs' guards (step_guards.py) fail at the next batch's replay: the steps are captured
    # again, and training, whose index changes at every step, then runs compiled; evaluation (two
    # batches an epoch, each captured after two warm-up steps) drops its graph at each changed
    # index and has not recaptured too often by the end of the fit
    lt, lm, ft, fm = fit_both(
        WeighsByTheBatchIndex, train_loader, val_loader, trainer_kwargs=dict(max_epochs=4),
        fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT),
    )
    engine = ft._runner._engine
    assert ft.engine == "compiled"
    assert engine._eval_recaptures == 3 and engine.active_eval_engine == "cudagraph"
    assert ft.global_step == lt.global_step == 24
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    # the warning names the batch index
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(max_epochs=4, engine="cudagraph", compile_options=AOT, **QUIET)
        trainer.fit(WeighsByTheBatchIndex(), train_loader())
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert len(ours) == 1 and ".batch_idx ==" in ours[0] and "'compiled' engine" in ours[0], ours


class LogsNumbers(Classifier):
    """Logs Python numbers that do not change (a float, an int, a bool) beside its tensors."""

    def training_step(self, batch, batch_idx):
        self.log("constant", 0.5)
        self.log("count", 3, on_step=True, on_epoch=False)
        self.log("flag", True, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_numbers_logged_in_a_captured_step_are_logged_as_under_lightning(graphed_engine):
    # a number is a constant of the captured step (logged_numbers.py): the capture is kept
    lt, lm, ft, fm = fit_graphed(LogsNumbers, max_epochs=3)
    assert ft.engine == "cudagraph"
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)


def test_a_replays_logged_values_are_copied_together_and_kept_apart_from_the_next_replay():
    """After each replay the logged values are copied out of the graph's outputs, which the next
    replay overwrites: the float scalars in one stack (one kernel for a step that logs a norm per
    parameter), any other tensor alone, a Python number as it is."""
    from fasttrain.lightning.graph_logging import _ReplayedCalls
    from host_reads import HostReads

    outputs = [torch.tensor(float(i)) for i in range(5)] + [torch.tensor(7), torch.arange(3.0), 2.5]
    calls = [("training_step", f"v{i}", value, i % 2 == 0) for i, value in enumerate(outputs)]
    replayed = _ReplayedCalls(calls)
    for replay in range(2):
        for value in outputs[:7]:  # the replay writes into the captured outputs
            value.add_(10)
        with HostReads() as counted:
            fresh = replayed.with_fresh_values()
        # detach makes a view (no kernel): a copy of it records no autograd history
        assert counted.ops == {"detach": 2, "clone": 2, "stack": 1, "unbind": 1} and counted.reads == 0
        assert [call[:2] + call[3:] for call in fresh] == [call[:2] + call[3:] for call in calls]
        expected = [float(i + 10 * (replay + 1)) for i in range(5)] + [7 + 10 * (replay + 1)]
        for value in outputs[:7]:  # the next replay: the copies keep this one's values
            value.add_(1000)
        assert [call[2].item() for call in fresh[:6]] == expected
        assert fresh[5][2].dtype == torch.int64
        assert torch.equal(fresh[6][2], torch.arange(3.0) + 10 * (replay + 1))
        assert fresh[7][2] == 2.5
        for value in outputs[:7]:
            value.sub_(1000)


def test_a_replays_calls_go_straight_into_their_entries_once_the_store_has_filed_them_alike():
    """From the second replay on, a replay's ``self.log`` calls are filed straight into the
    store's entries, with the first call's checks behind them, instead of through the pending list
    and a second round of checks. A call the store has not filed with the same arguments (the
    first replay, a key logged in between with other arguments, another evaluation loader) goes
    the checking way, as the loop's drain files it."""
    from fasttrain.lightning.graph_logging import _ReplayedCalls
    from fasttrain.lightning.results import ResultStore
    from host_reads import HostReads

    store = ResultStore(training=True)
    store.start_batch(torch.zeros(4, 2))
    loss, norm, scale = torch.tensor(1.5), torch.tensor(3.0), torch.tensor(0.25)
    store.recording = True  # as while a step is captured: the calls are recorded
    store.log("training_step", "loss", loss, on_step=True, on_epoch=True)
    store.log("training_step", "norm", norm, reduce_fx="max")
    store.log("training_step", "scale", scale, on_step=True, on_epoch=False)
    calls, store.pending, store.recording = list(store.pending), [], False
    replayed = _ReplayedCalls(calls)
    assert not replayed.file_into(store) and store.pending == []  # keys new to the store
    store.pending.extend(replayed.with_fresh_values())
    store.drain(torch.device("cpu"))
    loss.fill_(2.5)  # the next replay writes into the captured outputs
    norm.fill_(5.0)
    with HostReads() as counted:
        assert replayed.file_into(store) and store.pending == []
    # no copy of the replay's outputs is made for a value nobody reads: the epoch's sum reads it now
    assert counted.ops == {"mul": 1, "add": 1, "maximum": 1} and counted.reads == 0, counted.ops
    entry = store.entries["training_step.loss"]
    assert entry.epoch_value().item() == 2.0  # the mean of 1.5 and 2.5, four samples each
    assert store.entries["training_step.norm"].epoch_value().item() == 5.0
    read = store.metrics(on_step=True)["callback"]["loss_step"]  # what a callback may keep
    assert read.item() == 2.5 and read is not loss  # a copy of the replay's output
    loss.fill_(7.0)  # the next replay writes into the captured outputs: what was read stays
    norm.fill_(1.0)
    assert read.item() == 2.5 and entry.epoch_value().item() == 2.0
    scale.fill_(0.5)
    assert replayed.file_into(store)
    # a step value only, already the replay's output: the next replay rewrites it in place, and
    # nothing is filed again for it
    scale_entry = store.entries["training_step.scale"]
    assert scale_entry.step_value is scale and scale_entry.step_live
    scale.fill_(0.75)
    with HostReads() as counted:
        assert replayed.file_into(store)
    assert counted.ops == {"mul": 1, "add": 1, "maximum": 1}, counted.ops
    assert scale_entry.step_value is scale
    read = store.metrics(on_step=True)["callback"]
    assert read["loss_step"].item() == 7.0 and read["scale"].item() == 0.75 and read["scale"] is not scale
    assert store.entries["training_step.norm"].epoch_value().item() == 5.0  # the max of 1.5, 5 and 1
    # an epoch's first value filed from a replay starts a max from a copy, not from the output
    store.reset()
    norm.fill_(4.0)
    assert replayed.file_into(store)
    norm.fill_(0.5)
    assert store.entries["training_step.norm"].epoch_value().item() == 4.0
    # an eager hook logs the key with other arguments of the same meaning: they are the entry's now
    store.log("training_step", "loss", torch.tensor(0.5), on_step=True, on_epoch=True, reduce_fx=torch.mean)
    assert not replayed.file_into(store)
    # an evaluation store whose loader changed names other entries
    val = ResultStore(training=False)
    val.start_batch(torch.zeros(2, 2), dataloader_idx=0)
    val.recording = True
    val.log("validation_step", "acc", torch.tensor(1.0))
    calls, val.pending, val.recording = list(val.pending), [], False
    replayed = _ReplayedCalls(calls)
    val._log(*calls[0])
    assert replayed.file_into(val)
    val.start_batch(torch.zeros(2, 2), dataloader_idx=1)
    assert not replayed.file_into(val)
    assert set(val.entries) == {"validation_step.acc/dataloader_idx_0"}
