"""The CUDA-graphed engine's readiness on a GPU: compile modes, held chunk tables, nothing
compiled during capture, many trainers, replay safety, the masked skip.

Skipped without CUDA; the same decisions are tested on the CPU with host stand-ins in
test_engine_compile_modes, test_kernels_chunk_tables, test_engine_capture_ready,
test_engine_many_trainers, test_engine_replay_guard and test_engine_masked_skip.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine import ENGINES, CudaGraphEngine, recompile_limit
from fasttrain.kernels import _multi_tensor as multi_tensor

from engine_cases import (
    MLP, Case, CountsCaptureFrames, assert_runs_match, eager_and, fasttrain_warnings, mlp_case, run, vector_data,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("exact_cuda"),
]


def _graphed_without_warnings(case, compile_options=None, **overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", device="cuda", **overrides)
        graphed = run(case, "cudagraph", compile_options, device="cuda", **overrides)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    return eager, graphed


def _eager_and_graphed_with(callback_cls):
    """Two epochs of the MLP case on the GPU, eager and graphed, each trainer with a fresh
    ``callback_cls()`` as its only callback (``run`` would add a recorder and evaluation)."""
    trainers = {}
    for engine in ("eager", "cudagraph"):
        torch.manual_seed(0)
        case = mlp_case(epochs=2)
        model = case.model().cuda()
        trainer = Trainer(model, case.loss, case.optimizer(model), engine=engine, log_every_n_steps=3,
                          callbacks=[callback_cls()])
        trainer.train(case.data(), 2, per_device_batch_size=8, gradient_accumulation_steps=2, gradient_clip_norm=0.5,
                      train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
        trainers[engine] = trainer
    return trainers["eager"], trainers["cudagraph"]


def _assert_same_parameters(eager, graphed):
    for a, b in zip(eager.get_model().parameters(), graphed.get_model().parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


# item 3 -------------------------------------------------------------------------------------
def test_reduce_overhead_runs_the_engines_own_graphs():
    eager, graphed = _graphed_without_warnings(mlp_case(), {"mode": "reduce-overhead"})
    assert graphed.trainer._engine.settings.mode is None
    assert_runs_match(eager, graphed)


# item 4 -------------------------------------------------------------------------------------
class FloodTableCache(TrainerCallback):
    """After the graphs exist, builds more chunk tables than the cache keeps and churns memory,
    so that an evicted table's memory would be reused before the next replay."""

    def __init__(self):
        self.keep = []
        self.seen = 0

    def on_train_step_end(self, trainer, **kwargs):
        self.seen += 1
        if self.seen == 10:
            for i in range(multi_tensor._TABLE_CACHE_SIZE + 8):
                grads = [torch.ones(1000 + i, device="cuda")]
                multi_tensor.chunk_table(grads, multi_tensor.DEFAULT_CHUNK)
            self.keep = [torch.full((4096,), 7.0, device="cuda") for _ in range(64)]


def test_evicted_chunk_tables_stay_alive_for_the_graphs():
    eager, graphed = _eager_and_graphed_with(FloodTableCache)
    assert graphed.active_engine == "cudagraph"
    assert any(captured.tables for captured in graphed._engine._train_graphs.values())
    _assert_same_parameters(eager, graphed)


# item 5 -------------------------------------------------------------------------------------
class CountingCaptures(CountsCaptureFrames, CudaGraphEngine):
    pass


@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_nothing_compiles_during_capture(monkeypatch, nonfinite):
    monkeypatch.setitem(ENGINES, "cudagraph", CountingCaptures)
    CountingCaptures.frames_in_captures = []
    case = mlp_case(trainer_cls=functools.partial(Trainer, nonfinite=nonfinite))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(case, "cudagraph", device="cuda")
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    # as on the CPU (test_engine_capture_ready): non-update, update and evaluation graphs, captured
    # again after the partial batches' first runs, and the partial batches' own: 3 + 3 + 2
    assert CountingCaptures.frames_in_captures == [0] * 8
    counts = graphed.recorder.counts_after_epoch
    assert counts[0] == counts[-1], counts


# item 6 -------------------------------------------------------------------------------------
def test_ten_compiled_trainers_in_one_process():
    hits = recompile_limit.hit_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            torch.manual_seed(i)
            model = MLP().cuda()
            trainer = Trainer(model, torch.nn.functional.cross_entropy, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              engine="compiled", callbacks=[])
            trainer.train(vector_data(n=16), 1, per_device_batch_size=8, gradient_clip_norm=1.0,
                          train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
            assert trainer.active_engine == "compiled"
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    assert recompile_limit.hit_count() == hits, recompile_limit.new_hits(hits)


# item 7 -------------------------------------------------------------------------------------
class ClearGradientsMidWindow(TrainerCallback):
    def __init__(self):
        self.seen = 0

    def on_train_step_end(self, trainer, **kwargs):
        if self.seen in (8, 14):  # non-update micro-steps, after capture
            trainer.optimizer.zero_grad(set_to_none=True)
        self.seen += 1


def test_gradients_set_to_none_between_replays_match_eager():
    eager, graphed = _eager_and_graphed_with(ClearGradientsMidWindow)
    assert graphed.active_engine == "cudagraph"
    _assert_same_parameters(eager, graphed)


# item 8 -------------------------------------------------------------------------------------
def _poisoned():
    x, y = vector_data().tensors
    x = x.clone()
    x[45, 2] = float("nan")
    return TensorDataset(x, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_skip_is_captured_for_sgd_and_adamw(optimizer):
    make = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    }[optimizer]
    case = Case(model=MLP, optimizer=make, data=_poisoned, epochs=2,
                train_kwargs=dict(gradient_accumulation_steps=2, gradient_clip_norm=0.5),
                trainer_cls=functools.partial(Trainer, nonfinite="skip"))
    eager, graphed = _graphed_without_warnings(case, eval_dataset=None)
    assert graphed.trainer.skipped_updates == eager.trainer.skipped_updates == 2
    assert sum(map(math.isnan, graphed.recorder.train)) == 2
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


# the graphed engine for what users run (fused AdamW, a zero_grad() that drops gradients) ------
def test_fused_adamw_is_captured_and_matches_eagers_fused_step():
    from engine_cases import one_cycle

    case = mlp_case(create_scheduler_fn=functools.partial(one_cycle(), cycle_momentum=False))
    case.optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    eager, graphed = _graphed_without_warnings(case)
    assert graphed.trainer.optimizer.param_groups[0]["fused"]
    assert_runs_match(eager, graphed)


class ZeroGradToNone(Trainer):
    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()  # torch's default: set_to_none=True


def test_a_zero_grad_hook_that_drops_gradients_is_captured_and_matches_eager():
    eager, graphed = _graphed_without_warnings(mlp_case(trainer_cls=ZeroGradToNone))
    assert graphed.trainer._engine._grads.cleared
    assert_runs_match(eager, graphed)


def test_a_hook_reading_a_per_step_value_is_not_replayed_stale_on_a_device(dynamos_own_limits):
    # a real replay runs no Python: captured with the counter's value of that step, the graph
    # would scale every later loss alike (the CPU twin: test_engine_step_values.py)
    from test_engine_step_values import ScalesByStep

    case = mlp_case(epochs=2, trainer_cls=ScalesByStep)
    eager, graphed, ours = eager_and(case, "cudagraph", device="cuda", eval_dataset=None)
    assert graphed.trainer.active_engine != "cudagraph", ours
    assert ours and "ctx.trainer.step_count ==" in ours[0], ours
    assert_runs_match(eager, graphed)


class CountsUpdates(Trainer):
    """Counts its optimizer_step calls on itself, inside the compiled update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = 0

    def optimizer_step(self):
        self.updates += 1
        super().optimizer_step()


def test_a_counter_changed_inside_the_step_is_not_left_at_its_captured_value_on_a_device():
    # a real replay runs no Python: the counter would stop at its value at the capture (the CPU
    # twin: test_differential_engines.py); the capture is refused and every update counts
    case = mlp_case(epochs=2, trainer_cls=CountsUpdates)
    eager, graphed, ours = eager_and(case, "cudagraph", device="cuda", eval_dataset=None)
    assert len(ours) == 1 and "CountsUpdates.updates (int: " in ours[0], ours
    assert graphed.trainer.active_engine == "compiled"
    assert graphed.trainer.updates == eager.trainer.updates == 2 * 5
    assert_runs_match(eager, graphed)


def test_a_value_back_at_one_compiled_before_is_not_replayed_as_captured_on_a_device():
    # a loss weight set per epoch, 1.0 and 0.5 in turn: from the third epoch on both variants are
    # compiled and no capture compiles; the graphs' guards fail at the first replay after a change
    # and the step is captured again (the CPU twin: test_engine_step_guards.py)
    from test_engine_step_guards import AlternatingWeight, WeighsItsLoss

    case = mlp_case(epochs=4, trainer_cls=WeighsItsLoss)
    eager, graphed, ours = eager_and(case, "cudagraph", device="cuda", callbacks=[AlternatingWeight((1.0, 0.5))])
    assert ours == []
    assert graphed.trainer.active_engine == "cudagraph" and graphed.trainer._engine._recaptures >= 1
    assert_runs_match(eager, graphed)


@pytest.mark.parametrize("kind", ["annealed-float", "mixup"])
def test_a_float_that_keeps_changing_stays_compiled_with_inductor_on_a_device(dynamos_own_limits, kind):
    # the CPU twins: test_engine_symbolic_ints.py; here inductor compiles CUDA kernels and the
    # symbolic float reaches them as a scalar argument
    from test_engine_step_guards import WeighsItsLoss
    from test_engine_symbolic_ints import AnnealsTheWeight, Mixup, SeedsTheDraws

    trainer_cls, callback = (WeighsItsLoss, AnnealsTheWeight()) if kind == "annealed-float" else (Mixup, SeedsTheDraws())
    torch._dynamo.reset()
    case = mlp_case(epochs=2, trainer_cls=trainer_cls)
    eager, compiled, ours = eager_and(case, "compiled", device="cuda", callbacks=[callback], eval_dataset=None)
    assert compiled.trainer.active_engine == "compiled", ours
    assert not any("recompile_limit" in message for message in ours), ours
    assert_runs_match(eager, compiled)
