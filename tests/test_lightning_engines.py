"""The compiled engine on an unchanged LightningModule, and on modules whose hooks run inside the
update (gradient norms logged in ``on_before_optimizer_step``; a counter there, which leaves the
update uncompiled)."""

import warnings

import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from fasttrain.engine.compile_events import compiles_so_far  # noqa: E402
from fasttrain.lightning import Trainer  # noqa: E402
from test_lightning_graphed import LogsAMetric, _gradients  # noqa: E402
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


def val_loader():
    return loader(classification_data(n=16, seed=1), batch_size=8)


class _GraphCount(L.Callback):
    def __init__(self):
        self.per_epoch = []

    def on_train_epoch_end(self, trainer, module):
        self.per_epoch.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_compiled_engine_matches_lightning_and_stops_compiling_after_the_first_epoch():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    count = _GraphCount()
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2, callbacks=[count]),
        fasttrain_kwargs=dict(engine="compiled"),
    )
    assert ft.engine == "compiled"  # self.log inside training_step traced: no fallback
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm, fm)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics)
    # Lightning's run adds no graphs; fasttrain's compiles in its first epoch only
    graphs = count.per_epoch[2:]
    assert graphs[0] > 0 and graphs[-1] == graphs[0]


class KeepsItsOptimizer(Classifier):
    """Returns the same optimizer to every fit (torch's compiled optimizer step is specialised to
    the optimizer object, so a new one is compiled anew)."""

    def configure_optimizers(self):
        if not hasattr(self, "_optimizer"):
            self._optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return self._optimizer


def test_another_fit_of_the_same_module_compiles_nothing_again():
    # each fit builds its trainer; the compiled steps are kept with the module
    module = KeepsItsOptimizer()
    frames = []
    for _ in range(3):
        before = compiles_so_far()
        trainer = Trainer(max_epochs=1, engine="compiled", compile_options={"backend": "aot_eager"}, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader())
        assert trainer.engine == "compiled"
        frames.append(compiles_so_far() - before)
    assert frames[0] > 0 and frames[1:] == [0, 0], frames


def test_ten_fits_of_one_module_stay_compiled(dynamos_own_limits_from_empty_caches):
    """A module keeps its compiled functions across fits, and configure_optimizers makes a new
    optimizer for each: the frames of torch's optimizer step are compiled again for each one, and
    the ninth fit met dynamo's recompile limit there and ran eagerly, with a warning."""
    from test_engine_graph_logic import AOT

    module = Classifier()
    engines, ours = [], []
    for _ in range(10):
        trainer = Trainer(max_epochs=1, limit_train_batches=2, engine="compiled", compile_options=AOT, **QUIET)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_loader())
        engines.append(trainer._runner._engine.active_engine)
        ours += [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert ours == []
    assert engines == ["compiled"] * 10


class HostSideStep(Classifier):
    """Counts its optimizer steps in a Python int: a number the compiled update would be compiled
    for once per value."""

    def __init__(self):
        super().__init__()
        self.host_steps = 0

    def on_before_optimizer_step(self, optimizer):
        self.host_steps += 1


def test_a_counter_in_the_update_hook_leaves_the_update_uncompiled_with_one_warning():
    torch.manual_seed(0)
    reference = HostSideStep()
    module = HostSideStep()
    module.load_state_dict(reference.state_dict())
    torch.manual_seed(1)
    L.Trainer(max_epochs=2, **QUIET).fit(reference, train_loader())
    trainer = Trainer(max_epochs=2, engine="compiled", **QUIET)
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_loader())
    ours = [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    # at the counter's third value, not at dynamo's recompile limit
    assert len(ours) == 1 and "host_steps" in ours[0] and "in on_before_optimizer_step" in ours[0], ours
    assert "runs uncompiled" in ours[0]
    assert trainer.engine == "compiled" and trainer._runner._engine._eager_update
    assert module.host_steps == reference.host_steps == 12
    # compiled kernels round differently (about 1e-6 here, as for the plain module); an update
    # that lost a step of Adam's state would differ by about the learning rate
    assert_same_weights(reference, module, atol=1e-5)


class LogsGradientNorms(Classifier):
    """Logs its layers' gradient norms before each update, as Lightning's docs show."""

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self.net, norm_type=2))


@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_gradient_norms_logged_before_the_update_keep_it_compiled_with_lightnings_values(monkeypatch, engine):
    """The documented way to log gradient norms does not cost the compiled update, nor the graphs:
    the hook is traced with the update, and a replay files its logged values again as it does the
    training step's; later epochs compile nothing."""
    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ReplaysRunNoPython

    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)
    graphs = _GraphCount()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt, lm, ft, fm = fit_both(
            LogsGradientNorms, train_loader, val_loader, trainer_kwargs=dict(max_epochs=3),
            fasttrain_kwargs=dict(engine=engine, compile_options=AOT, callbacks=[graphs]), quiet=False,
        )
    assert [str(w.message) for w in caught if "fasttrain" in str(w.message)] == []
    assert ft.engine == engine
    assert not ft._runner._engine._eager_update
    if engine == "cudagraph":  # the update's graph replays, with the norms it logs
        assert set(ft._runner._engine._train_graphs) == {True}
        assert sum(graph.replays for graph in ReplaysRunNoPython.graphs) > 0
    assert graphs.per_epoch[1] == graphs.per_epoch[2], graphs.per_epoch
    assert ft.global_step == lt.global_step == 18
    assert "grad_2.0_norm/0.weight" in lt.logged_metrics
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)


class ClipsItsOwnWay(Classifier):
    """Clips by norm through Lightning's clip_gradients, at the value the Trainer was given, and
    the first layer's gradients by value besides (the kind of override Lightning's docs show);
    SGD, whose steps follow the gradients' scale (Adam's would hide a norm clip)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_value_(self.net[0].parameters(), 0.01)
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("engine", ["eager", "compiled", "cudagraph"])
def test_an_own_configure_gradient_clipping_clips_as_under_lightning(monkeypatch, engine):
    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ReplaysRunNoPython

    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)
    lt, lm, ft, fm = fit_both(
        ClipsItsOwnWay, train_loader, trainer_kwargs=dict(max_epochs=2, gradient_clip_val=0.05),
        fasttrain_kwargs=dict(engine=engine, compile_options=AOT),
    )
    assert ft.engine == engine and not getattr(ft._runner._engine, "_eager_update", False)
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm, fm, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudagraph_engine_on_cuda_matches_lightning():
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2, accelerator="gpu", devices=1),
        fasttrain_kwargs=dict(engine="cudagraph"),
    )
    assert ft.engine == "cudagraph"
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm.cpu(), fm.cpu(), atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("logs_from", ["module", "callback"])
def test_a_tied_causal_lm_logging_gradient_norms_is_captured_on_cuda_as_under_lightning(exact_cuda, logs_from):
    """The CPU test above with real graphs: dict batches, a final norm, tied weights, norm
    clipping, and the gradient norms logged in on_after_backward (compiled, its guards checked
    before each replay: graphed_hooks.py) and in on_before_optimizer_step (compiled with the
    update), filed after each replay; logged by the module or by a callback (aot_eager: what is
    checked is the capture and the replays, not Inductor's kernels, and it keeps the device run's
    test step short)."""
    from lightning_modules import LogsGradientNormsOfTheModule, TiedCausalLM, TiedCausalLMLoggingNorms, TokenDicts
    from test_engine_graph_logic import AOT

    module_cls, logging = (TiedCausalLMLoggingNorms, []) if logs_from == "module" else (
        TiedCausalLM, [LogsGradientNormsOfTheModule])
    lt, lm, ft, fm = fit_both(
        module_cls, lambda: loader(TokenDicts(), batch_size=8, shuffle=True),
        trainer_kwargs=dict(max_epochs=3, gradient_clip_val=0.5, accelerator="gpu", devices=1,
                            callbacks=[cls() for cls in logging]),
        fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT, callbacks=[cls() for cls in logging]),
    )
    assert ft.engine == "cudagraph" and set(ft._runner._engine._train_graphs) == {True}
    assert ft.global_step == lt.global_step == 15
    assert "grad_2.0_norm/emb.weight" in ft.logged_metrics and "tied_grad_norm" in ft.logged_metrics
    assert_same_weights(lm.cpu(), fm.cpu(), atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_module_clearing_gradients_to_none_itself_is_captured_on_cuda_as_under_lightning(exact_cuda):
    """The CPU test of test_lightning_graphed with real graphs: the module's optimizer_zero_grad
    sets the gradients to None at each window's start (accumulating 2), a callback of its own
    reads them around it; the hooks run before each replay and the captured gradients are bound
    again, zeroed."""
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ClearsGradientsItself, _assert_same_sightings

    lt, lm, ft, fm = fit_both(
        ClearsGradientsItself, train_loader,
        trainer_kwargs=dict(max_epochs=3, accumulate_grad_batches=2, accelerator="gpu", devices=1),
        fasttrain_kwargs=dict(engine="cudagraph", compile_options=AOT),
    )
    assert ft.engine == "cudagraph" and True in ft._runner._engine._train_graphs
    assert len(fm.seen) == len(lm.seen)
    _assert_same_sightings(lm.seen, fm.seen)
    assert_same_weights(lm.cpu(), fm.cpu(), atol=1e-5)


class ReadsGradientsAtBatchEdges(L.Callback):
    """Records, into the module's ``seen``, the gradients at each batch's start and end."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        module.seen.append(("start", batch_idx, _gradients(module)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.seen.append(("end", batch_idx, _gradients(module)))


class SeesGradientsAtBatchEdges(Classifier):
    def __init__(self):
        super().__init__()
        self.seen = []

    def configure_callbacks(self):
        return [ReadsGradientsAtBatchEdges()]


@pytest.mark.parametrize("engine", ["eager", "compiled", "cudagraph"])
@pytest.mark.parametrize("accumulate, validates", [(1, False), (2, False), (2, True)],
                         ids=["1", "2", "2-validating-mid-epoch"])
def test_a_callback_reading_gradients_between_batches_sees_lightnings(monkeypatch, engine, accumulate, validates):
    """Lightning clears the gradients at a window's first batch, between training_step and the
    backward: a callback sees the last backward's gradients at a batch's end and at the next
    batch's start, not None or zeros (and None after a validation, which releases them).
    fasttrain.lightning clears them at the same place, on every engine (the graphed one before
    the step, in place)."""
    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ReplaysRunNoPython, _assert_same_sightings

    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)
    extra = dict(val_check_interval=0.5) if validates else {}
    lt, lm, ft, fm = fit_both(
        SeesGradientsAtBatchEdges, train_loader, val_loader if validates else None,
        trainer_kwargs=dict(max_epochs=2, accumulate_grad_batches=accumulate, **extra),
        fasttrain_kwargs=dict(engine=engine, compile_options=AOT),
    )
    assert ft.engine == engine
    assert len(fm.seen) == len(lm.seen) == 24
    # after the first batch, None only where a validation released the gradients: the one at
    # the first epoch's end (Lightning keeps them through the one in the middle of a window)
    released = [(name, i) for name, i, grads in lm.seen[1:] if all(g is None for g in grads)]
    assert released == ([("start", 0)] if validates else []), released
    _assert_same_sightings(lm.seen, fm.seen)
    assert_same_weights(lm, fm, atol=1e-5)


class HalvesEveryStep(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_the_learning_rate_monitor_keeps_each_steps_rate_on_the_compiled_engine(tmp_path):
    # the compiled engine reads the learning rate as a device tensor; the monitor appends
    # group["lr"] itself, outside the compiled calls, where the groups hold the scheduler's floats
    # (a tensor written in place there left every entry showing the last rate)
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    kept, copy_warnings = {}, {}
    for name, trainer_cls, extra in (("lightning", L.Trainer, {}),
                                     ("fasttrain", Trainer, dict(engine="compiled", compile_options={"backend": "aot_eager"}))):
        monitor = LearningRateMonitor(logging_interval="step")
        kwargs = dict(QUIET, logger=CSVLogger(tmp_path / name), log_every_n_steps=1, callbacks=[monitor])
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = trainer_cls(max_epochs=1, **kwargs, **extra)
            trainer.fit(HalvesEveryStep(), train_loader())
        kept[name] = monitor.lrs["lr-Adam"]
        copy_warnings[name] = [str(w.message) for w in caught if "copy construct from a tensor" in str(w.message)]
    assert trainer.engine == "compiled"
    assert kept["fasttrain"] == kept["lightning"], kept
    assert kept["lightning"][:3] == [0.01, 0.005, 0.0025]
    assert copy_warnings == {"lightning": [], "fasttrain": []}


class UpdatesAMetric(LogsAMetric):
    """A torchmetrics metric called in the training and validation steps, as Lightning's
    documentation shows: its Python counters change at every call."""

    def __init__(self):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.val_acc = MulticlassAccuracy(num_classes=3)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self(x), y)
        self.log("val_acc", self.val_acc)


def test_a_metric_called_in_the_steps_runs_outside_the_graphs_and_the_steps_stay_compiled(
        dynamos_own_limits_from_empty_caches):
    # traced into the step, the metric's counters compiled it again at every batch until
    # dynamo's limit (8): twelve batches an epoch passed it, and the rest of the fit ran eagerly
    pytest.importorskip("torchmetrics")
    lt, lm, ft, fm = fit_both(
        UpdatesAMetric, lambda: loader(classification_data(n=96), batch_size=8), val_factory=val_loader,
        trainer_kwargs=dict(max_epochs=3), fasttrain_kwargs=dict(engine="compiled", compile_options={"backend": "aot_eager"}),
    )
    assert ft.engine == "compiled" and ft._runner._engine.active_eval_engine == "compiled"
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-6)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-6)
    # the wrappers are gone after the fit: the metrics are the user's as they were
    assert "forward" not in fm.accuracy.__dict__ and not hasattr(fm.accuracy.update, "_torchdynamo_disable")
    # the graph breaks at the metric calls are fasttrain's own: no warning about them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(max_epochs=1, engine="compiled", compile_options={"backend": "aot_eager"}, **QUIET)
        trainer.fit(UpdatesAMetric(), train_loader(), val_loader())
    assert not [str(w.message) for w in caught if "fasttrain" in str(w.message)]
    assert trainer.engine == "compiled" and trainer._runner.compile_options == {"backend": "aot_eager"}


class UnfreezesAfterTheFirstEpoch(L.Callback):
    """Trains only the head in the first epoch, then the whole network (a finetuning schedule)."""

    def on_fit_start(self, trainer, module):
        module.net[0].requires_grad_(False)

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 1:
            module.net[0].requires_grad_(True)


def test_a_layer_unfrozen_at_an_epoch_start_trains_on_the_compiled_engine_as_under_lightning():
    # torch 2.11 traced the step again for no change of requires_grad: the unfrozen layer got no
    # gradient and kept its weights (engine/trainable.py)
    torch.manual_seed(0)
    initial = Classifier().net[0].weight.detach().clone()
    lt, lm, ft, fm = fit_both(
        Classifier, train_loader,
        trainer_kwargs=dict(max_epochs=3, callbacks=[UnfreezesAfterTheFirstEpoch()]),
        fasttrain_kwargs=dict(engine="compiled", compile_options={"backend": "aot_eager"}),
    )
    assert ft.engine == "compiled"
    assert not torch.allclose(fm.net[0].weight, initial)
    assert_same_weights(lm, fm, atol=1e-5)


@pytest.mark.parametrize(
    "engine, variant, runs",
    [("compiled", "plain", "compiled"), ("compiled", "logs-norms", "compiled"),
     ("cudagraph", "plain", "cudagraph"), ("cudagraph", "logs-norms", "cudagraph"),
     ("compiled", "clears-to-none", "compiled"), ("cudagraph", "clears-to-none", "cudagraph"),
     ("compiled", "callback-logs-norms", "compiled"), ("cudagraph", "callback-logs-norms", "cudagraph")],
)
def test_a_tied_causal_lm_on_dict_batches_trains_as_under_lightning(monkeypatch, engine, variant, runs):
    """The compiled and graphed paths on a module shaped like users' (dict batches, final norm,
    head tied to the embedding, norm clipping, a per-step schedule), with and without the hooks
    that log gradient norms (after the backward, before the update; the module's, or a
    callback's), and with its own optimizer_zero_grad setting the gradients to None at each
    window's start (accumulating 2): Lightning's weights and logged values, and nothing compiled
    after the first epoch."""
    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ReplaysRunNoPython

    from lightning_modules import LogsGradientNormsOfTheModule, TiedCausalLM, TiedCausalLMLoggingNorms, TokenDicts

    class TiedCausalLMClearingToNone(TiedCausalLM):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            optimizer.zero_grad(set_to_none=True)

    module_cls = {"plain": TiedCausalLM, "logs-norms": TiedCausalLMLoggingNorms,
                  "clears-to-none": TiedCausalLMClearingToNone, "callback-logs-norms": TiedCausalLM}[variant]
    logging = [LogsGradientNormsOfTheModule] if variant == "callback-logs-norms" else []
    accumulate = 2 if variant == "clears-to-none" else 1
    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)
    graphs = _GraphCount()
    lt, lm, ft, fm = fit_both(
        module_cls, lambda: loader(TokenDicts(), batch_size=8, shuffle=True),
        trainer_kwargs=dict(max_epochs=3, gradient_clip_val=0.5, accumulate_grad_batches=accumulate,
                            callbacks=[cls() for cls in logging]),
        fasttrain_kwargs=dict(engine=engine, compile_options=AOT, callbacks=[graphs, *[cls() for cls in logging]]),
    )
    assert ft.engine == runs
    assert fm.head.weight is fm.emb.weight  # still tied
    assert graphs.per_epoch[1] == graphs.per_epoch[2], graphs.per_epoch
    assert ft.global_step == lt.global_step == (15 if accumulate == 1 else 9)
    assert ("grad_2.0_norm/emb.weight" in lt.logged_metrics) == variant.endswith("logs-norms")
    if runs == "cudagraph":
        assert set(ft._runner._engine._train_graphs) == ({True} if accumulate == 1 else {False, True})
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)


class LogsMoreFromTheSecondEpoch(LogsGradientNorms):
    """Logs gradient norms before each update, and from the second epoch on one more value in its
    training step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch > 0:
            self.log("late", loss * 2)
        return loss


def test_the_update_compiles_once_whatever_the_training_step_logs():
    """The update's hooks log to a list of their own: how many values the training step logged
    before them is nothing the compiled update depends on (it compiled again when that changed)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from fasttrain.engine.compiled_functions import UPDATE
    from test_engine_graph_logic import AOT

    lt, lm, ft, fm = fit_both(
        LogsMoreFromTheSecondEpoch, train_loader, trainer_kwargs=dict(max_epochs=3),
        fasttrain_kwargs=dict(engine="compiled", compile_options=AOT),
    )
    engine = ft._runner._engine
    assert ft.engine == "compiled" and not engine._eager_update
    assert len(_debug_get_cache_entry_list(engine._functions.codes[UPDATE])) == 1
    assert_same_weights(lm, fm, atol=1e-5)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
