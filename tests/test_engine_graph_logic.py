"""The graphed engine's logic on the CPU, with host stand-ins for CUDA streams and graphs.

Everything the engine decides is exercised: when it warms up and when it captures, which graph a
micro-step replays, the ring slots the host predicts for the losses and grad norms, the partial
last batch through the compiled path, evaluation graphs, fallbacks. What is replaced are the three
CUDA-specific methods: streams become no-ops, and a "capture" runs the step once to learn its
outputs and then undoes it (a real capture records without running), while a "replay" runs it.
A host read during the stand-in capture raises, as under ``torch.cuda.set_sync_debug_mode``.
Whether real capture works is for ``test_engine_cudagraph.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings

import pytest
import torch
from torch._dynamo.utils import counters, orig_code_map
from torch.utils._python_dispatch import TorchDispatchMode

from fasttrain import Trainer
from fasttrain.engine import ENGINES
from fasttrain.engine import long_lived
from fasttrain.engine.compile_events import compiles_so_far
from fasttrain.engine.cudagraph import CudaGraphEngine
from fasttrain.engine.hyperparams import inner_optimizer
from fasttrain.engine.snapshot import StepSnapshot
from fasttrain.engine.step_guards import run_by_design

from engine_cases import (
    Case,
    GraphBreakTrainer,
    HostReadingTrainer,
    MeanPool,
    RaggedCollate,
    Recorder,
    Run,
    assert_runs_match,
    fasttrain_warnings,
    mlp_case,
    run,
    vector_data,
)

AOT = {"backend": "aot_eager"}
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class HostGraph:
    """A recorded step; its replay runs the step's Python again. A real replay runs only the
    kernels the capture recorded, with the Python values the capture saw: where the step's Python
    would now take another path, dynamo compiles it again (its guards failed) or runs another of
    the variants it compiled before, and the stand-in says so rather than replaying what a device
    would not."""

    def __init__(self, body, compiled_code, grads=(), operations=None):
        self._body = body
        #: the compiled code objects the capture ran, in order (see _compiled_code_run)
        self.compiled_code = compiled_code
        #: the operations the capture issued, with their Python arguments (see _OperationsIssued);
        #: None: not checked
        self.operations = operations
        #: ``(parameter, gradient tensor)`` a training step's capture accumulated into
        self.captured_grads = grads
        self.replays = 0

    def replay(self):
        self.replays += 1
        for p, grad in self.captured_grads:
            if p.grad is not grad:
                raise StaleReplay(
                    "a replay found another gradient tensor (or None) where its capture accumulated: a "
                    "CUDA graph would write into the captured tensor, and the parameter's .grad would "
                    "not see it (no error on a device)"
                )
        before = compiles_so_far()
        issued = _OperationsIssued()
        try:
            with issued:
                ran = _compiled_code_run(self._body)[1]
        finally:
            if compiles_so_far() != before:
                raise StaleReplay(
                    "a replay compiled the step again: its Python reads values that changed since "
                    "the capture, which a CUDA graph would replay unchanged (no error on a device)"
                )
        if ran != self.compiled_code:
            raise StaleReplay(
                "a replay ran other compiled code than its capture (another variant dynamo compiled "
                "for other Python values): a CUDA graph would replay the captured one (no error on "
                "a device)"
            )
        if self.operations is not None and issued.operations != self.operations:
            raise StaleReplay(
                "a replay's Python issued other operations than its capture did (a branch or a number "
                "in eager code that changed since, first difference: "
                f"{_first_difference(self.operations, issued.operations)}): a CUDA graph would replay the "
                "captured ones (no error on a device)"
            )


def _compiled_code_run(body):
    """``body()``'s result, and the code objects dynamo compiled that it ran, in order."""
    ran = []

    def note(frame, event, arg):
        if event == "call" and frame.f_code in orig_code_map:
            ran.append(frame.f_code)

    previous = sys.getprofile()
    sys.setprofile(note)
    try:
        result = body()
    finally:
        sys.setprofile(previous)
    return result, ran


def _argument(value):
    # what an operation's argument decides about the kernel a graph records: a tensor by its
    # kind (each step makes new ones), a Python value (a scale, a flag, a shape) by value
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_argument(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _argument(v)) for k, v in value.items())
    if isinstance(value, _NUMBERS_AND_SETTINGS):
        return value
    return type(value).__name__  # a function or graph a higher-order operator runs, an opaque object


_NUMBERS_AND_SETTINGS = (int, float, complex, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format)


class _OperationsIssued(TorchDispatchMode):
    """The aten operations run while it is active, each with its Python arguments: what a CUDA
    graph's capture records, the kernels and the numbers their launches were given."""

    # custom ops that mutate (the fused kernels) reach it as auto_functionalized calls
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.operations = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # dynamo compiles and runs compiled code while it is active (it skips the frames under
        # any other mode) and runs its own compiling without it
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.operations.append((func, _argument(args), tuple((k, _argument(v)) for k, v in sorted(kwargs.items()))))
        return func(*args, **kwargs)


# the stand-in's recording runs inside every capture, as a device's capture records kernels
run_by_design(_OperationsIssued.__torch_dispatch__, _OperationsIssued.ignore_compile_internals, _argument)


def _first_difference(captured: list, replayed: list) -> str:
    for i, (a, b) in enumerate(zip(captured, replayed)):
        if a != b:
            return f"operation {i}: captured {a}, now {b}"
    return f"captured {len(captured)} operations, now {len(replayed)}"


class StaleReplay(AssertionError):
    """A stand-in replay whose step no longer matches its capture (see :class:`HostGraph`)."""


@contextlib.contextmanager
def _host_reads_raise():
    # torch.Tensor's own attributes only: the methods it inherits are put back by deleting the
    # stand-in, so the class is left as it was found
    originals = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def refuse(self, *args, **kwargs):
        raise RuntimeError("called a synchronizing CUDA operation (host read during capture)")

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


class HostGraphEngine(CudaGraphEngine):
    graphs = []
    #: set while a training step is captured: its graph checks the gradient tensors at each replay
    _capturing_training = False
    #: calls of the allocator's empty_cache the engine made, and memory pools it started
    memory_returns = 0
    new_pools = 0
    long_lived_allocations = 0

    def _device_reason(self):
        return None

    def _create_stream_and_pool(self, device):
        self._stream = self._pool = None

    def _long_lived_allocations(self):
        # the default allocator: the moved tensors are copied, as on a device, into new memory
        HostGraphEngine.long_lived_allocations += 1
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _on_side_stream(self):
        yield

    def _return_cached_memory(self):
        HostGraphEngine.memory_returns += 1

    def _new_pool(self):
        HostGraphEngine.new_pools += 1
        self._pool = HostGraphEngine.new_pools

    def _capture_and_replay(self, *args, **kwargs):
        self._capturing_training, before = True, self._capturing_training
        try:
            return super()._capture_and_replay(*args, **kwargs)
        finally:
            self._capturing_training = before

    def _record(self, body):
        trainer = self.trainer
        rings = [r for r in (self._train_ring, self._eval_ring) if r is not None]
        extra = [t for r in rings for t in (r.losses.buffer, r.aux)] + list(self.ctx.mutated_flags())
        snapshot = StepSnapshot(trainer.model, inner_optimizer(trainer.optimizer), extra=extra)
        grads = ()
        if self._capturing_training:
            grads = tuple((p, p.grad) for p in trainer.model.parameters() if p.grad is not None)
        # a capture draws no random numbers from the generator (a replay advances it by what the
        # graph draws, where the step run eagerly would): dropout in the replays sees eager's stream
        rng = torch.get_rng_state()
        issued = _OperationsIssued()
        try:
            with _host_reads_raise(), issued:
                outputs, compiled_code = _compiled_code_run(body)
        finally:
            snapshot.restore()  # a capture records the step without running it, even one that fails
            torch.set_rng_state(rng)
        graph = HostGraph(body, compiled_code, grads, issued.operations)
        HostGraphEngine.graphs.append(graph)
        return graph, outputs


@pytest.fixture(autouse=True)
def host_graphs(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    HostGraphEngine.graphs = []
    HostGraphEngine.memory_returns = HostGraphEngine.new_pools = HostGraphEngine.long_lived_allocations = 0
    # every gradient and state tensor of these small models moves before a new pool, as the
    # large ones of a real model do: each stand-in run checks the moved copies train on as before
    monkeypatch.setattr(long_lived, "SMALL_BLOCK_LIMIT", -1)
    monkeypatch.setitem(ENGINES, "cudagraph", HostGraphEngine)
    yield
    torch._dynamo.reset()


def eager_and_graphed(case, evaluate=False, **overrides):
    """``case`` run eagerly and on the graphed engine (with evaluation only if ``evaluate``),
    with no fasttrain warning; the graphed run kept both training graphs (and its evaluation
    graph)."""
    if not evaluate:
        overrides["eval_dataset"] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", **overrides)
        graphed = run(case, "cudagraph", AOT, **overrides)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    if evaluate:
        assert engine.active_eval_engine == "cudagraph" and engine._eval_graph is not None
    return eager, graphed


def test_graphed_steps_match_eager_and_replay_from_the_ring():
    eager, graphed = eager_and_graphed(mlp_case(), evaluate=True)
    engine = graphed.trainer._engine
    # 70 samples / 8 = 9 batches (the last of 6) x 3 epochs. Epoch 1: 4 warm-up steps (two of
    # them updates), steps 4-7 replayed, then the partial batch's first run, before which every
    # graph is dropped. Epochs 2 and 3: the 8 full batches replay graphs captured again at once
    # (the last epoch's graphs count these 16), the partial batch a graph of its own, captured in
    # epoch 2 and replayed in both. Evaluation alike: 2 warm-up batches, 6 replays, the partial
    # batch's first run, then 8 + 1 replays in each later epoch.
    assert sum(step.graph.replays for step in engine._train_graphs.values()) == 16
    assert set(engine._last_graphs) == {True}  # the epoch's last batch updates
    assert engine._last_graphs[True].graph.replays == 2
    assert engine._eval_graph.graph.replays == 16 and engine._eval_last_graph.graph.replays == 2
    # train graphs: 2 + 2 + 1, eval graphs: 1 + 1 + 1; memory handed back before each first run
    assert len(HostGraphEngine.graphs) == 8 and HostGraphEngine.memory_returns == 2
    # a pool for the first capture and for the first after each release: the allocator refuses
    # to share a pool whose graphs were all freed
    assert HostGraphEngine.new_pools == 3
    assert_runs_match(eager, graphed)


@pytest.mark.parametrize("trainer_cls", [Trainer, HostReadingTrainer], ids=["captured", "refused"])
def test_the_cyclic_collector_is_paused_in_every_capture_and_only_there(monkeypatch, trainer_cls):
    # garbage collected inside a capture may free CUDA graphs, which invalidates the capture
    collecting = []
    record = HostGraphEngine._record

    def recording(self, body):
        collecting.append(gc.isenabled())
        return record(self, body)

    monkeypatch.setattr(HostGraphEngine, "_record", recording)
    assert gc.isenabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed = run(mlp_case(trainer_cls, epochs=2), "cudagraph", AOT)
    engine = graphed.trainer._engine
    if trainer_cls is Trainer:  # training and evaluation graphs, at both shapes
        assert engine.active_engine == engine.active_eval_engine == "cudagraph"
        assert len(collecting) == len(HostGraphEngine.graphs) == 8
    else:  # the training capture raised: the collector runs again after it, as before it
        assert engine.active_engine == "compiled" and len(collecting) > len(HostGraphEngine.graphs)
    assert collecting and not any(collecting)
    assert gc.isenabled()


def test_the_partial_batch_runs_first_with_no_graph_held_then_replays_its_own(monkeypatch):
    held_at_partial_runs = []
    warmup_step = HostGraphEngine._warmup_step

    def recording_warmup(self, batch, update, signature):
        if len(batch[0]) == 6:  # the partial batch
            held_at_partial_runs.append(self._graphs_held())
        return warmup_step(self, batch, update, signature)

    monkeypatch.setattr(HostGraphEngine, "_warmup_step", recording_warmup)
    case = mlp_case(epochs=4)
    eager = run(case, "eager")
    graphed = run(case, "cudagraph", AOT)
    engine = graphed.trainer._engine
    assert held_at_partial_runs == [False]  # one compiled run, with every graph dropped first
    assert engine._last_static.tree[0].shape[0] == 6 and engine._static.tree[0].shape[0] == 8
    assert engine._last_graphs[True].graph.replays == 3  # epochs 2-4
    assert engine.active_engine == "cudagraph"
    assert_runs_match(eager, graphed)


def test_host_read_in_a_captured_hook_falls_back_to_compiled_once():
    case = mlp_case(HostReadingTrainer, epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager")
        graphed = run(case, "cudagraph", AOT)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1 and "'optimizer_step'" in messages[0] and "'compiled'" in messages[0], messages
    assert graphed.trainer.active_engine == "compiled"
    assert graphed.trainer.active_eval_engine == "cudagraph"
    assert_runs_match(eager, graphed)


def test_a_hook_with_graph_breaks_is_captured_whole():
    # the decision for graph breaks: a CUDA graph records kernels, not dynamo graphs, so the
    # step compiled in pieces is captured whole; only the ladder's warning is given
    case = mlp_case(GraphBreakTrainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager")
        graphed = run(case, "cudagraph", AOT)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 2, messages  # one per hook
    assert all("graph breaks" in m and "'cudagraph'" in m for m in messages), messages
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "cudagraph"
    assert set(engine._train_graphs) == {False, True} and engine._eval_graph is not None
    graphs = graphed.trainer.compiled_graphs
    # the pieces around the break (the training one also the accumulation scaling after it)
    assert graphs["calculate_train_batch_loss"].graphs >= 2 and graphs["calculate_eval_batch_loss"].graphs >= 2
    assert_runs_match(eager, graphed)


def test_a_graph_break_that_reads_the_host_falls_back_to_compiled():
    from test_engines import BranchOnItemTrainer, sgd_case

    eager = run(sgd_case(BranchOnItemTrainer), "eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(sgd_case(BranchOnItemTrainer), "cudagraph", AOT)
    messages = fasttrain_warnings(caught)
    # the ladder's warning, then the capture that meets the .item() between the pieces
    assert len(messages) == 2, messages
    assert "graph breaks" in messages[0]
    assert "'calculate_train_batch_loss'" in messages[1] and "falls back to the 'compiled'" in messages[1]
    assert graphed.trainer.active_engine == "compiled" and graphed.trainer.active_eval_engine == "cudagraph"
    assert_runs_match(eager, graphed)


def test_changing_shapes_fall_back_to_compiled_once():
    case = Case(model=MeanPool, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05), data=vector_data, epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(case, "cudagraph", {**AOT, "dynamic": None}, collate_fn=RaggedCollate(), eval_dataset=None)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1 and "dynamic shapes" in messages[0], messages
    assert graphed.trainer.active_engine == "compiled"


def test_a_swapped_in_model_is_evaluated_off_graph(tmp_path):
    from fasttrain.callbacks import ModelEmaCallback

    def make(engine):
        case = mlp_case(epochs=3)
        torch.manual_seed(0)
        model = case.model()
        trainer = Trainer(
            model, case.loss, case.optimizer(model), engine=engine, log_every_n_steps=3,
            compile_options=AOT, callbacks=[ModelEmaCallback(decay=0.5, save_path=str(tmp_path / f"{engine}.pt"))],
        )
        data = case.data()
        trainer.train(
            data, 3, eval_dataset=data, per_device_batch_size=8, gradient_accumulation_steps=2,
            train_dataloader_kwargs={"shuffle": False, "num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0},
        )
        return trainer

    eager, graphed = make("eager"), make("cudagraph")
    assert graphed.active_eval_engine == "cudagraph" and graphed._engine._eval_graph is not None
    for name in ("eval_loss_epoch", "ema_model_eval_loss_epoch"):
        torch.testing.assert_close(
            torch.tensor(graphed.run_history.get_metric_values(name)),
            torch.tensor(eager.run_history.get_metric_values(name)),
            rtol=1e-4, atol=1e-5,
        )


def test_freezing_a_layer_at_an_epoch_start_recaptures():
    from fasttrain.callbacks import TrainerCallback

    class FreezeFirstLayer(TrainerCallback):
        def on_train_epoch_start(self, trainer, **kwargs):
            if trainer.run_history.current_epoch == 2:
                for p in trainer.get_model().net[0].parameters():
                    p.requires_grad_(False)

    # the callback must be in the trainer's list: build the runs by hand
    results = {}
    for engine in ("eager", "cudagraph"):
        torch.manual_seed(0)
        case = mlp_case(epochs=3)
        model = case.model()
        recorder = Recorder()
        trainer = Trainer(
            model, case.loss, case.optimizer(model), engine=engine, log_every_n_steps=3,
            compile_options=AOT, callbacks=[FreezeFirstLayer(), recorder],
        )
        data = case.data()
        trainer.train(
            data, 3, per_device_batch_size=8, gradient_accumulation_steps=2, gradient_clip_norm=0.5,
            train_dataloader_kwargs={"shuffle": False, "num_workers": 0},
        )
        state = {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()}
        results[engine] = Run(recorder, trainer, state)
    graphed = results["cudagraph"].trainer._engine
    assert graphed.active_engine == "cudagraph" and set(graphed._train_graphs) == {False, True}
    first = results["cudagraph"].trainer.get_model().net[0]
    assert all(p.grad is None for p in first.parameters())  # skipped by AdamW, as in eager
    assert_runs_match(results["eager"], results["cudagraph"])


class ScalesTheLossFromTheThirdEpoch(Trainer):
    """A backward_step override whose Python reads the epoch: eager code around the backward."""

    def backward_step(self, loss):
        scale = 1.0 if self.run_history.current_epoch < 3 else 0.5
        super().backward_step(loss * scale)


def test_the_stand_in_replay_refuses_what_eager_python_now_issues_otherwise():
    # a real graph replays the kernels of its capture, with the numbers their launches got: a
    # replay whose Python would now launch another kernel, or the same one with another number,
    # is one the device would get wrong without an error
    x = torch.ones(3)
    scale = [1.0]

    def body():
        return x * scale[0]

    captured = _OperationsIssued()
    with captured:
        body()
    graph = HostGraph(body, [], (), captured.operations)
    graph.replay()
    scale[0] = 0.5
    with pytest.raises(StaleReplay, match="issued other operations than its capture"):
        graph.replay()


def test_a_backward_step_override_keeps_the_graphed_engine_at_setup():
    # its Python runs uncompiled inside the captured step: the third epoch's scale would replay
    # as the second epoch's capture saw it (the stand-in's replay refused that before)
    case = mlp_case(ScalesTheLossFromTheThirdEpoch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", eval_dataset=None)
        graphed = run(case, "cudagraph", AOT, eval_dataset=None)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1 and "the trainer's own backward_step" in messages[0], messages
    assert "'compiled'" in messages[0] and "calculate_train_batch_loss" in messages[0]
    assert graphed.trainer.active_engine == "compiled" and HostGraphEngine.graphs == []
    assert_runs_match(eager, graphed)


class ScalesTheLossFromTheThirdEpochInTheForward(Trainer):
    """The same scale where the warning above points: in the compiled forward."""

    def calculate_train_batch_loss(self, batch):
        batch_output = super().calculate_train_batch_loss(batch)
        scale = 1.0 if self.run_history.current_epoch < 3 else 0.5
        return {**batch_output, "loss": batch_output["loss"] * scale}


def test_the_same_scale_in_calculate_train_batch_loss_keeps_the_graphs():
    # its Python is compiled: the epoch is a guard checked before each replay, and the third
    # epoch's scale has the steps captured again, with no warning
    case = mlp_case(ScalesTheLossFromTheThirdEpochInTheForward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", eval_dataset=None)
        graphed = run(case, "cudagraph", AOT, eval_dataset=None)
    assert fasttrain_warnings(caught) == []
    assert graphed.trainer.active_engine == "cudagraph"
    assert sum(graph.replays for graph in HostGraphEngine.graphs) > 0
    assert_runs_match(eager, graphed)
