"""Gradients set to None between steps keep the graphed engine: a callback that clears them, and
an ``optimizer_zero_grad`` hook that calls ``zero_grad()`` (torch's default, set_to_none=True),
replay with eager's result, and what reads ``.grad`` between steps sees what eager shows it.

Runs the graphed engine's logic on the CPU with the host stand-ins of test_engine_graph_logic
(the same cases run on a GPU in test_engine_cuda_readiness)."""

from __future__ import annotations

import functools
import warnings

import torch

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback

from engine_cases import assert_runs_match, fasttrain_warnings, held_hyperparams, mlp_case, one_cycle, run
from test_engine_graph_logic import AOT, HostGraphEngine, eager_and_graphed, host_graphs  # noqa: F401


class ClearsGradientsMidWindow(TrainerCallback):
    """Sets every gradient to None after some non-update micro-steps: after the graphs exist, and
    right before the graphs are captured again in the second epoch."""

    def __init__(self):
        self.seen = 0

    def on_train_step_end(self, trainer, **kwargs):
        if self.seen in (4, 6, 8, 10):  # micro-steps 5, 7 (epoch 1), 10 and 12 (epoch 2) open windows
            trainer.optimizer.zero_grad(set_to_none=True)
        self.seen += 1


class SeesGradients(TrainerCallback):
    """Records, after every micro-step, whether the first parameter has a gradient."""

    def __init__(self):
        self.has_grad = []

    def on_train_step_end(self, trainer, **kwargs):
        self.has_grad.append(next(trainer.get_model().parameters()).grad is not None)


class ZeroGradToNone(Trainer):
    """A pytorch-accelerated user's own hook, as commonly written: torch's zero_grad() drops the
    gradients (set_to_none=True is its default)."""

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()


def _runs(trainer_cls, callbacks, epochs=2):
    """The MLP case (accumulation 2, clipping, a partial last batch) eagerly and graphed, each with
    fresh ``callbacks()`` before the recorder."""
    out = {}
    for engine in ("eager", "cudagraph"):
        class WithCallbacks(trainer_cls):
            def __init__(self, *args, callbacks=(), **kwargs):
                self.extra = callbacks_factory()
                super().__init__(*args, callbacks=[*self.extra, *callbacks], **kwargs)

        callbacks_factory = callbacks
        case = mlp_case(trainer_cls=WithCallbacks, epochs=epochs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[engine] = run(case, engine, AOT if engine != "eager" else None, eval_dataset=None)
        assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    return out["eager"], out["cudagraph"]


def test_gradients_a_callback_sets_to_none_between_replays_and_before_a_capture_match_eager():
    eager, graphed = _runs(Trainer, lambda: [ClearsGradientsMidWindow()])
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert sum(step.graph.replays for step in engine._train_graphs.values()) > 0
    assert_runs_match(eager, graphed)


def test_a_zero_grad_hook_that_drops_gradients_keeps_the_graphs_and_eagers_view_of_them():
    eager, graphed = _runs(ZeroGradToNone, lambda: [SeesGradients()])
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert engine._grads.cleared  # the hook's clearing was seen, and it runs after each replay
    assert sum(step.graph.replays for step in engine._train_graphs.values()) > 0
    assert_runs_match(eager, graphed)
    # after every update the hook left no gradient, mid-window the gradients are there: as eagerly
    seen_eager, seen_graphed = eager.trainer.extra[0].has_grad, graphed.trainer.extra[0].has_grad
    assert seen_graphed == seen_eager and False in seen_eager and True in seen_eager


def test_the_default_zero_grad_keeps_the_gradient_tensors():
    eager, graphed = _runs(Trainer, lambda: [SeesGradients()], epochs=1)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and not engine._grads.cleared
    assert_runs_match(eager, graphed)
    # fasttrain's own zeroing is the engine's (in place) under graphs, torch's set_to_none eagerly
    assert all(graphed.trainer.extra[0].has_grad)
    assert not all(eager.trainer.extra[0].has_grad)


def test_fused_adamw_is_captured_and_steps_as_eagers_fused_step():
    """torch's fused AdamW keeps its step counters on the device and takes a device learning rate
    (fasttrain holds it as one): the graphed engine captures it as it is (on the CPU, torch's
    fused kernel stands in for the CUDA one)."""
    # a one-cycle learning rate (a tensor the graphs read); the fused kernel takes betas as
    # floats, so the schedule leaves them alone
    schedule = functools.partial(one_cycle(), cycle_momentum=False)
    case = mlp_case(epochs=2, create_scheduler_fn=schedule)
    case.optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    eager, graphed = eager_and_graphed(case)
    engine = graphed.trainer._engine
    group = graphed.trainer.optimizer.param_groups[0]
    lr, betas = held_hyperparams(graphed.trainer)
    assert group["fused"] and isinstance(lr, torch.Tensor) and betas is None and not group["capturable"]
    assert type(group["lr"]) is float  # the group's own value outside the compiled calls
    assert sum(step.graph.replays for step in engine._train_graphs.values()) > 0
    assert_runs_match(eager, graphed)


def test_fused_adamw_whose_betas_a_scheduler_cycles_falls_back_once_and_steps_as_eager():
    """OneCycleLR cycles beta1 by default; the fused kernel takes betas as floats, which a graph
    would replay at their captured value. The graphed engine falls back with one warning saying
    what keeps the graphs, and the compiled engine it falls back to steps the fused kernel
    uncompiled, with each update's betas: eager's weights, and nothing recompiled for the betas."""
    case = mlp_case(epochs=2)  # one_cycle() with cycle_momentum=True
    case.optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    eager = run(case, "eager", eval_dataset=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(case, "cudagraph", AOT, eval_dataset=None)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1, messages
    assert "'betas'" in messages[0] and "cycle_momentum=False" in messages[0] and "fused=False" in messages[0]
    assert graphed.trainer._engine.active_engine == "compiled"
    assert_runs_match(eager, graphed)
