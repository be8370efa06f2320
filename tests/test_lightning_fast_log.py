"""``self.log`` in steps (fasttrain/lightning/fast_log.py): the same result as
``LightningModule.log`` for every kind of call, with the per-fit checks made once per fit, run
by the eager engine and traced by the compiled ones."""

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "lightning"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torchmetrics  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

import fasttrain.lightning.fast_log as fast_log_module  # noqa: E402
from fasttrain.lightning import Trainer  # noqa: E402
from fasttrain.lightning.fast_log import step_logger  # noqa: E402
from fasttrain.lightning.results import ResultStore  # noqa: E402
from lightning_modules import QUIET, Classifier, classification_data, loader  # noqa: E402

BATCH = (torch.randn(5, 6), torch.zeros(5, dtype=torch.long))
WITH_GRAD = torch.tensor(1.5, requires_grad=True) * 2

# (hook, name, value, options): the calls a step makes, and calls Lightning refuses
CASES = [
    ("training_step", "loss", torch.tensor(2.0), {}),
    ("training_step", "loss", torch.tensor(2.0), {"prog_bar": True}),
    ("training_step", "loss", torch.tensor(2.0), {"on_step": True, "on_epoch": True}),
    ("training_step", "loss", torch.tensor(2.0), {"on_step": False, "on_epoch": True, "reduce_fx": "max"}),
    ("training_step", "loss", torch.tensor(2.0), {"on_epoch": True, "reduce_fx": torch.sum}),
    ("training_step", "loss", torch.tensor(2.0), {"on_epoch": True, "batch_size": 3}),
    ("training_step", "loss", torch.tensor(2.0), {"logger": False, "sync_dist": True}),
    ("training_step", "loss", torch.tensor(2.0), {"logger": True}),  # no logger: Lightning warns
    ("training_step", "loss", torch.tensor([[2.0]]), {"on_epoch": True}),  # squeezed to 0-dim
    ("training_step", "count", torch.tensor(3), {"on_epoch": True}),  # an integer tensor
    ("training_step", "graph", WITH_GRAD, {"enable_graph": True}),
    ("training_step", "number", 0.25, {}),
    ("training_step", "loss", torch.tensor(2.0), {"on_step": 1}),
    ("training_step", "loss", torch.nn.Parameter(torch.tensor(2.0)), {}),
    ("training_step", "pair", torch.tensor([1.0, 2.0]), {}),  # more than one element
    ("training_step", "loss/dataloader_idx_0", torch.tensor(2.0), {}),
    ("training_step", "nested", {"a": {"b": torch.tensor(1.0)}}, {}),
    ("training_step", "text", "not a number", {}),
    ("validation_step", "val_loss", torch.tensor(2.0), {}),
    ("validation_step", "val_loss", torch.tensor(2.0), {"on_step": True}),
    ("on_train_epoch_end", "loss", torch.tensor(2.0), {}),
    ("on_train_epoch_end", "loss", torch.tensor(2.0), {"on_step": True}),  # not allowed there
    ("on_fit_start", "loss", torch.tensor(2.0), {}),  # a hook that cannot log
    (None, "loss", torch.tensor(2.0), {}),  # outside any hook
]


class WithMetric(Classifier):
    def __init__(self):
        super().__init__()
        self.mean = torchmetrics.MeanMetric()


def _attached():
    module = WithMetric()
    trainer = Trainer(**QUIET)
    module.trainer = trainer
    trainer._module = module
    trainer.state.fn = TrainerFn.FITTING
    trainer.training = True
    return module, trainer


def _snapshot(store: ResultStore) -> dict:
    out = {}
    for key, entry in store.entries.items():
        values = []
        for value in (entry.step_value, entry.total):
            values.append(None if value is None else (value.dtype, value.shape, value.tolist(), value.requires_grad))
        out[key] = (entry.on_step, entry.on_epoch, entry.reduce, entry.prog_bar, entry.logger, entry.enable_graph,
                    entry.sync is not None, entry.metric, entry.count, tuple(values))
    return out


def _run(make_log, fx, name, value, options):
    module, trainer = _attached()
    store = trainer._train_results = ResultStore(training=True)
    store.start_batch(BATCH)
    log = make_log(module, trainer)
    module._current_fx_name = fx
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if name == "mean":
                module.mean.update(value)
                value = module.mean
            log(name, value, **options)
            error = None
        except Exception as exc:  # noqa: BLE001 - the error itself is compared
            error = (type(exc), str(exc))
    entries = _snapshot(store)
    if isinstance(value, torch.Tensor):
        # the store holds a copy: changing the logged tensor afterwards changes nothing there
        with torch.no_grad():
            value.add_(100)
        assert _snapshot(store) == entries
        with torch.no_grad():
            value.sub_(100)
    return {
        "error": error,
        "entries": entries,
        "current_fx": trainer._logger_connector._current_fx,
        "warnings": [str(w.message) for w in caught],
    }


def _lightning_log(module, trainer):
    return lambda *args, **kwargs: L.LightningModule.log(module, *args, **kwargs)


@pytest.mark.parametrize("fx,name,value,options", CASES + [("training_step", "mean", torch.tensor(4.0), {})])
def test_fast_log_files_what_lightning_log_files(fx, name, value, options):
    expected = _run(_lightning_log, fx, name, value, options)
    got = _run(step_logger, fx, name, value, options)
    if expected["entries"]:
        # metric objects differ between the two runs' modules; compare what they hold
        for entries in (expected["entries"], got["entries"]):
            for key, row in entries.items():
                metric = row[7]
                entries[key] = row[:7] + (None if metric is None else float(metric.compute()),) + row[8:]
    assert got == expected


def test_a_module_that_defines_log_keeps_it():
    seen = []

    class OwnLog(Classifier):
        def log(self, name, value, *args, **kwargs):
            seen.append(name)
            super().log(name, value, *args, **kwargs)

    module = OwnLog()
    assert step_logger(module, Trainer(**QUIET)) is None
    trainer = Trainer(max_epochs=1, limit_train_batches=3, **QUIET)
    trainer.fit(module, loader(classification_data(), batch_size=8))
    assert seen == ["train_loss", "train_max"] * 3
    assert float(trainer.callback_metrics["train_loss_step"]) > 0


def test_eager_fit_checks_the_step_signature_once_and_never_falls_back(monkeypatch):
    """Every step logs (three tensors in training, three in validation); the dataloader_iter
    signature check runs once per fit and ``LightningModule.log`` itself never runs."""
    signature_checks, fallbacks = [], []
    real_check = fast_log_module.is_param_in_hook_signature
    real_log = L.LightningModule.log

    def counting_check(*args, **kwargs):
        signature_checks.append(args[1])
        return real_check(*args, **kwargs)

    def counting_log(self, name, *args, **kwargs):
        fallbacks.append(name)
        return real_log(self, name, *args, **kwargs)

    monkeypatch.setattr(fast_log_module, "is_param_in_hook_signature", counting_check)
    monkeypatch.setattr(L.LightningModule, "log", counting_log)
    module = Classifier()
    trainer = Trainer(max_epochs=2, engine="eager", **QUIET)
    trainer.fit(module, loader(classification_data(), batch_size=8), loader(classification_data(n=12), batch_size=6))
    assert trainer.global_step == 12
    assert signature_checks == ["dataloader_iter"]
    assert fallbacks == []
    assert "log" not in module.__dict__  # the module is left as it was
    metrics = trainer.callback_metrics
    assert {"train_loss", "train_loss_step", "train_loss_epoch", "train_max", "val_loss", "val_acc"} <= set(metrics)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_a_failing_step_leaves_the_module_without_the_fast_log(engine):
    from test_engine_graph_logic import AOT

    class Failing(Classifier):
        def training_step(self, batch, batch_idx):
            assert "log" in self.__dict__  # the fast log is in place in the step
            self.log("before", torch.tensor(1.0))
            raise RuntimeError("bad batch")

    module = Failing()
    trainer = Trainer(max_epochs=1, engine=engine, compile_options=AOT, **QUIET)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(module, loader(classification_data(), batch_size=8))
    assert "log" not in module.__dict__


def test_python_calls_per_step_stay_close_to_fasttrains_own_trainer():
    """The bench's CPU overhead workload, counted rather than timed: the Python function calls
    of one more training step under fasttrain.lightning (a LightningModule that logs its loss to
    the progress bar) against fasttrain's own Trainer on the same model and data. The per-fit
    work cancels in the difference of two fits. Measured without a progress bar: about 18 more
    calls per step (there were about 150 before self.log and the fit loop decided their per-fit
    checks once; Lightning makes about 3,400 more than fasttrain's Trainer). The bench's peer
    keeps the default bar, a Lightning callback whose hooks run every batch: about 7 calls per
    step more, its redraws at most every 0.1 s left out of the count (tqdm's clock stands still
    while counting, see python_calls_per_step: counted with the clock, they made the figure grow
    with the machine's slowness, 73 on a quiet machine and 145 on a busy one)."""
    import functools

    from fasttrain.bench.peers import make_peer
    from test_bench_overhead import python_calls_per_step
    from fasttrain.bench.runner import quiet
    from fasttrain.bench.workloads import make_workload

    workload = make_workload("mlp", device="cpu")
    workload.resize(130)
    per_step = {}
    with quiet():
        for name, bar in (("fasttrain-eager", None), ("fasttrain-lightning", True), ("fasttrain-lightning", False)):
            peer = make_peer(name, workload)
            peer.setup()
            if bar is False:
                trainer_class = peer._trainer_class()
                peer._trainer_class = lambda: functools.partial(trainer_class, enable_progress_bar=False)
            per_step[name, bar] = python_calls_per_step(peer)
            peer.close()
    eager = per_step["fasttrain-eager", None]
    assert eager > 100  # the counting sees the steps
    assert per_step["fasttrain-lightning", False] - eager < 40, per_step
    assert per_step["fasttrain-lightning", True] - per_step["fasttrain-lightning", False] < 100, per_step


@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_compiled_steps_trace_the_fast_log_and_log_what_lightning_logs(monkeypatch, engine):
    """The compiled and graphed engines trace a step with the fast log in place. Traced,
    ``LightningModule.log`` adds its signature inspection and collection walks to the guards that
    dynamo checks before every call of the compiled step and the graphed engine before every
    replay (about 120 of the 420 guards of the bench's Lightning step). The values logged are
    Lightning's, the module is left as it was, and a second fit of the same module runs the
    training step's compiled variant again (a new fit's log is another function object)."""
    from fasttrain.engine import ENGINES
    from fasttrain.engine.compiled_functions import TRAIN_HOOK
    from fasttrain.engine.step_guards import compiled_variants
    from lightning_modules import assert_same_metrics, fit_both, train_loader, val_loader
    from test_engine_graph_logic import AOT
    from test_lightning_graphed import ReplaysRunNoPython

    monkeypatch.setitem(ENGINES, "cudagraph", ReplaysRunNoPython)
    options = dict(engine=engine, compile_options=AOT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lt, _, ft, module = fit_both(Classifier, train_loader, val_loader, trainer_kwargs=dict(max_epochs=2),
                                     fasttrain_kwargs=options)
        assert ft.engine == engine
        assert "log" not in module.__dict__
        assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
        assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)
        code = ft._runner._engine._functions.codes[TRAIN_HOOK]
        variants = compiled_variants(code)
        assert len(variants) == 1
        guards = str(variants[0].guard_manager)
        # what only LightningModule.log reads: its defaults, the step's signature, the walks
        for lightning_only in ("is_param_in_hook_signature", "apply_to_collection", "'log'].__defaults__"):
            assert lightning_only not in guards
        again = Trainer(max_epochs=3, **QUIET, **options)
        again.fit(module, train_loader(), val_loader())
    assert again.global_step == 3 * ft.global_step // 2
    assert again._runner._engine._functions.codes[TRAIN_HOOK] is code
    assert len(compiled_variants(code)) == 1
    assert "log" not in module.__dict__


class LogsAroundBackward(Classifier):
    """Logs in training_step and in the hooks around backward."""

    def on_before_backward(self, loss):
        self.log("loss_before_backward", loss * 2, on_step=True, on_epoch=True)

    def on_after_backward(self):
        self.log("grad_sum", sum(p.grad.abs().sum() for p in self.parameters()))


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_values_logged_around_backward_are_lightnings(engine):
    """On the compiled engine the fast log is in place around the engine's whole call, backward
    included: the hooks around backward log under their own names (with their own levels), the
    values Lightning logs. (The graphed engine leaves a module that overrides them to the
    compiled one.)"""
    from lightning_modules import assert_same_metrics, assert_same_weights, fit_both, train_loader
    from test_engine_graph_logic import AOT

    lt, lm, ft, fm = fit_both(LogsAroundBackward, train_loader, trainer_kwargs=dict(max_epochs=2),
                              fasttrain_kwargs=dict(engine=engine, compile_options=AOT))
    assert ft.engine == engine, ft.engine
    assert ft.global_step == lt.global_step == 12
    assert_same_weights(lm, fm, atol=1e-5)
    assert {"loss_before_backward_step", "loss_before_backward_epoch", "grad_sum"} <= set(lt.callback_metrics)
    assert_same_metrics(lt.callback_metrics, ft.callback_metrics, atol=1e-5)
    assert_same_metrics(lt.logged_metrics, ft.logged_metrics, atol=1e-5)
