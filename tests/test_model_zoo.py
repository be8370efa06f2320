"""The model zoo: models of the families users train, through the pytorch-accelerated API and
through fasttrain.lightning, eager and compiled.

For each model: the eager engine equals a hand-written loop (1e-6 relative on the weights); the
compiled engine (Inductor) equals eager (1e-4 relative on the weights after four updates with
accumulation 2 and clipping by norm); the engine that ran is named, training and evaluation; the
graphs and graph breaks of each forward hook are counted and bounded; nothing compiles after the
first epoch (training and evaluation). The models are built from small configs (nothing is
downloaded) and are a few thousand parameters; the time goes to Inductor's compiles (20 minutes
for the zoo on 2 CPU cores shared with other work, which is most of it; docs/engines.md).

torchvision and timm are not in the zoo: torchvision's wheels on PyPI for Linux are built against
CUDA torch (its extension needs libtorch_cuda.so, so ``import torchvision`` fails with the CPU
build of torch 2.13, ``torchvision::nms does not exist``), and timm imports torchvision. The
tests for them skip with that reason where they are not importable, and run where they are.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from zoo_models import ZOO, hf_trainer_class, missing, model_output_loss

EPOCHS, BATCH, ACCUMULATION, CLIP, LR = 2, 4, 2, 1.0, 0.05
TRAIN_HOOK, EVAL_HOOK = "calculate_train_batch_loss", "calculate_eval_batch_loss"
#: the graph breaks each model's forward hooks may have (dynamo's count): none, since logger
#: calls are left out of the trace
MAX_BREAKS = {"gpt2": 0, "llama": 0, "bert": 0, "vit": 0, "t5": 0}
#: transformers' T5 builds a DynamicCache in each forward (its decoder's use_cache is on by
#: default), whose config's deep copy the dynamo of torch 2.11 cannot trace (2.12 can): 9 breaks,
#: warned about, and the pieces still compiled and captured
OLD_DYNAMO = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)
if OLD_DYNAMO:
    MAX_BREAKS["t5"] = 9

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _entry(name):
    entry = ZOO[name]
    reason = missing(entry.package)
    if reason:
        pytest.skip(reason)
    return entry


def _batches(samples):
    return [torch.utils.data.default_collate(samples[i:i + BATCH]) for i in range(0, len(samples), BATCH)]


def optimizer_for(model):
    # SGD with momentum: an update proportional to the gradient keeps rounding differences as
    # small as they are. Adam divides by the gradient's own size, so the sign of a gradient
    # element near zero (a few ulp, reassociated differently by Inductor) moves a weight by the
    # whole learning rate either way: 2e-4 relative for GPT-2 after four updates at lr=1e-3.
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _relative_difference(weights, expected):
    """The largest difference of a parameter relative to its largest magnitude, taken as at least
    1e-4: a parameter whose exact gradient is zero (attention's key bias: softmax ignores a shift
    shared by all keys) starts at zero and holds only rounding noise (1e-15), which would make any
    relative measure of it meaningless."""
    return max(((weights[n] - v).abs().max() / v.abs().max().clamp_min(1e-4)).item() for n, v in expected.items())


def hand_written_loop(entry):
    """What a user writes without a trainer: accumulation, clipping by norm, SGD."""
    model = entry.make()
    model.train()
    optimizer = optimizer_for(model)
    batches = _batches(entry.data(16))
    for _ in range(EPOCHS):
        for index, batch in enumerate(batches):
            loss, _ = model_output_loss(model, batch)
            (loss / ACCUMULATION).backward()
            if (index + 1) % ACCUMULATION == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                optimizer.zero_grad()
    return _weights(model)


_HAND = {}


def hand_weights(entry):
    if entry.name not in _HAND:
        _HAND[entry.name] = hand_written_loop(entry)
    return _HAND[entry.name]


# ----------------------------------------------------------------------------- accelerated API
def _graphs_per_epoch():
    from fasttrain.callbacks import TrainerCallback

    class GraphsPerEpoch(TrainerCallback):
        def __init__(self):
            self.counts = []

        def on_eval_epoch_end(self, trainer, **kwargs):
            self.counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    return GraphsPerEpoch()


def train_accelerated(entry, engine, compile_options=None):
    model = entry.make()
    graphs = _graphs_per_epoch()
    trainer = hf_trainer_class()(model, None, optimizer_for(model), callbacks=[graphs],
                                 engine=engine, compile_options=compile_options)
    trainer.train(entry.data(16), num_epochs=EPOCHS, eval_dataset=entry.data(8, seed=5), per_device_batch_size=BATCH,
                  gradient_accumulation_steps=ACCUMULATION, gradient_clip_norm=CLIP,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
                  eval_dataloader_kwargs={"num_workers": 0})
    return _weights(model), trainer, graphs.counts


def _assert_compiled_run(name, engine, report, graphs_per_epoch, compiled, eager):
    assert engine == "compiled"
    # both hooks ran compiled: a hook that fell back to eager has no entry
    assert set(report) == {TRAIN_HOOK, EVAL_HOOK}, report
    for hook in (TRAIN_HOOK, EVAL_HOOK):
        assert report[hook].breaks <= MAX_BREAKS[name], (hook, report[hook])
        assert report[hook].graphs == 1 + report[hook].breaks or report[hook].breaks > 0, (hook, report[hook])
    # nothing compiled after the first epoch (its training and evaluation)
    assert len(graphs_per_epoch) == EPOCHS and graphs_per_epoch[-1] == graphs_per_epoch[0], graphs_per_epoch
    difference = _relative_difference(compiled, eager)
    print(f"\n{name}: engine {engine}, graphs "
          f"{report[TRAIN_HOOK].graphs}/{report[EVAL_HOOK].graphs}, breaks {report[TRAIN_HOOK].breaks}/"
          f"{report[EVAL_HOOK].breaks}, compiled vs eager {difference:.2e}")
    assert difference < 1e-4, difference


@pytest.mark.parametrize("name", list(ZOO))
def test_accelerated_api(name):
    entry = _entry(name)
    eager, eager_trainer, _ = train_accelerated(entry, "eager")
    assert eager_trainer.active_engine == "eager" and eager_trainer.compiled_graphs == {}
    assert _relative_difference(eager, hand_weights(entry)) < 1e-6
    compiled, trainer, graphs_per_epoch = train_accelerated(entry, "compiled")
    assert trainer.active_eval_engine == "compiled"
    _assert_compiled_run(name, trainer.active_engine, trainer.compiled_graphs, graphs_per_epoch, compiled, eager)


# ----------------------------------------------------------------------------- the graphed engine
def _eager_and_graphed(monkeypatch, train, entry, engine_class):
    """``train(entry, engine[, compile_options])`` eagerly, then with ``engine="cudagraph"``
    building ``engine_class``: the graphed engine's own logic (warm-up, capture decisions, the
    host-read and Python-state refusals, replay guards) with host stand-ins for streams and graphs
    (test_engine_graph_logic.py). Returns both runs' results, fasttrain's warnings of the graphed
    run, and how many steps it replayed."""
    import warnings

    from fasttrain.engine import ENGINES
    from test_engine_graph_logic import AOT, HostGraphEngine

    eager = train(entry, "eager")
    monkeypatch.setitem(ENGINES, "cudagraph", engine_class)
    before = sum(graph.replays for graph in HostGraphEngine.graphs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = train(entry, "cudagraph", AOT)
    replays = sum(graph.replays for graph in HostGraphEngine.graphs) - before
    return eager, graphed, [str(w.message) for w in caught if "fasttrain" in str(w.message)], replays


def _assert_graphed_run(name, engines, graphs_per_epoch, replays, ours, graphed, eager):
    if MAX_BREAKS[name]:  # the breaks are warned about (one warning per hook), nothing else
        assert len(ours) == 2 and all("cannot be traced as one graph" in m for m in ours), ours
    else:
        assert ours == [], ours  # no fallback, nothing refused
    assert engines == ("cudagraph", "cudagraph")  # training and evaluation
    # 8 training and 4 evaluation steps; the first epoch warms up and captures, the second replays
    assert replays >= 4, replays
    assert len(graphs_per_epoch) == EPOCHS and graphs_per_epoch[-1] == graphs_per_epoch[0], graphs_per_epoch
    # aot_eager runs the traced graph's own ops: a few ulp from eager, where a step replayed stale
    # or an update applied twice differs in the second digit
    assert _relative_difference(graphed, eager) < 1e-5


@pytest.mark.parametrize("name", list(ZOO))
def test_accelerated_api_on_the_graphed_engines_logic(monkeypatch, name):
    """Each family would be captured whole (no host read in its forward, no Python state changed)
    and its replays give eager's weights."""
    from test_engine_graph_logic import HostGraphEngine

    eager, graphed, ours, replays = _eager_and_graphed(monkeypatch, train_accelerated, _entry(name), HostGraphEngine)
    (eager_weights, _, _), (weights, trainer, graphs_per_epoch) = eager, graphed
    _assert_graphed_run(name, (trainer.active_engine, trainer.active_eval_engine), graphs_per_epoch, replays, ours,
                        weights, eager_weights)


# ----------------------------------------------------------------------------- fasttrain.lightning
def train_lightning(entry, engine, compile_options=None):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install fasttrain[dev])")
    import lightning as L

    from fasttrain.lightning import Trainer

    class ZooModule(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return model_output_loss(self.model, batch)[0]

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", model_output_loss(self.model, batch)[0])

        def configure_optimizers(self):
            return optimizer_for(self)

    class GraphsPerEpoch(L.Callback):
        def __init__(self):
            self.counts = []

        def on_validation_epoch_end(self, trainer, module):
            if not trainer.sanity_checking:
                self.counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    module = ZooModule(entry.make())
    graphs = GraphsPerEpoch()
    trainer = Trainer(max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATION, gradient_clip_val=CLIP,
                      engine=engine, compile_options=compile_options, callbacks=[graphs], num_sanity_val_steps=0,
                      enable_progress_bar=False,
                      enable_model_summary=False, logger=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(entry.data(16), batch_size=BATCH, shuffle=False)
    val_loader = torch.utils.data.DataLoader(entry.data(8, seed=5), batch_size=BATCH)
    trainer.fit(module, loader, val_loader)
    return _weights(module.model), trainer, graphs.counts


@pytest.mark.parametrize("name", list(ZOO))
def test_lightning(name):
    entry = _entry(name)
    eager, eager_trainer, _ = train_lightning(entry, "eager")
    assert eager_trainer.engine == "eager"
    assert _relative_difference(eager, hand_weights(entry)) < 1e-6
    compiled, trainer, graphs_per_epoch = train_lightning(entry, "compiled")
    _assert_compiled_run(name, trainer.engine, trainer.compiled_graphs, graphs_per_epoch, compiled, eager)


@pytest.mark.parametrize("name", list(ZOO))
def test_lightning_on_the_graphed_engines_logic(monkeypatch, name):
    """The same under fasttrain.lightning, replays dropping the step's Python as a real one does:
    the validation loss logged in the replayed steps is eager's too."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install fasttrain[dev])")
    from test_lightning_graphed import ReplaysRunNoPython

    eager, graphed, ours, replays = _eager_and_graphed(monkeypatch, train_lightning, _entry(name), ReplaysRunNoPython)
    (eager_weights, eager_trainer, _), (weights, trainer, graphs_per_epoch) = eager, graphed
    engines = (trainer.engine, trainer._runner._engine.active_eval_engine)
    _assert_graphed_run(name, engines, graphs_per_epoch, replays, ours, weights, eager_weights)
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], eager_trainer.callback_metrics["val_loss"],
                               rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- torchvision, timm
def _importable(module):
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure is the reason to skip
        return f"{module} cannot be imported with this torch ({type(error).__name__}: {error})"
    return None


@pytest.mark.parametrize("module,build", [
    ("torchvision", lambda: importlib.import_module("torchvision").models.resnet18(num_classes=3)),
    ("timm", lambda: importlib.import_module("timm").create_model("resnet10t", pretrained=False, num_classes=3)),
])
def test_vision_libraries(module, build):
    reason = _importable(module)
    if reason:
        pytest.skip(reason)
    from fasttrain.trainer import Trainer

    def train(engine):
        torch.manual_seed(0)
        model = build()
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(16, 3, 32, 32, generator=generator),
                                              torch.randint(0, 3, (16,), generator=generator))
        graphs = _graphs_per_epoch()
        trainer = Trainer(model, torch.nn.CrossEntropyLoss(), optimizer_for(model),
                          callbacks=[graphs], engine=engine)
        trainer.train(data, num_epochs=EPOCHS, eval_dataset=data, per_device_batch_size=BATCH,
                      gradient_accumulation_steps=ACCUMULATION, gradient_clip_norm=CLIP,
                      train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
                      eval_dataloader_kwargs={"num_workers": 0})
        return _weights(model), trainer, graphs.counts

    eager, _, _ = train("eager")
    compiled, trainer, graphs_per_epoch = train("compiled")
    MAX_BREAKS.setdefault(module, 0)
    _assert_compiled_run(module, trainer.active_engine, trainer.compiled_graphs, graphs_per_epoch, compiled, eager)
