"""Replay safety: what a hook or callback changes between replays is noticed on the host, and the
step is either given back the tensors it was captured with or captured again."""

from __future__ import annotations

import warnings

import pytest
import torch

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine import ENGINES
from fasttrain.engine.replay_guard import CaptureRecord

from engine_cases import Recorder, Run, fasttrain_warnings, mlp_case
from test_engine_graph_logic import AOT, HostGraph, HostGraphEngine, host_graphs  # noqa: F401


def _stepped(optimizer_cls=torch.optim.AdamW):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_nothing_changed_is_nothing_to_report():
    model, optimizer = _stepped()
    record = CaptureRecord(model, optimizer)
    assert record.structure_change(optimizer) is None and not record.grads_rebound()
    assert record.model_change(model) is None


def test_gradients_set_to_none_or_replaced_are_put_back_with_the_meant_value():
    model, optimizer = _stepped()
    record = CaptureRecord(model, optimizer)
    captured = [p.grad for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    first = model[0].weight
    first.grad = torch.full_like(first, 3.0)
    assert record.grads_rebound()
    assert record.restore_grads() is None
    assert all(p.grad is g for p, g in zip(model.parameters(), captured))
    assert torch.equal(first.grad, torch.full_like(first, 3.0))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in list(model.parameters())[1:])
    assert not record.grads_rebound()


def test_gradients_put_back_take_one_foreach_call_not_one_per_parameter():
    """A module's own zero_grad(set_to_none=True) before every window leaves every gradient to
    bind again: zeroed together (one kernel per dtype on a device), copies together, and a known
    zero left as it is."""
    from host_reads import HostReads

    model, optimizer = _stepped()
    params = list(model.parameters())
    record = CaptureRecord(model, optimizer)
    captured = [p.grad for p in params]
    with torch.no_grad():
        captured[3].fill_(5.0)  # the update graph zeroed it in a real run: here left as it is
    optimizer.zero_grad(set_to_none=True)
    params[1].grad = torch.full_like(params[1], 2.0)
    params[2].grad = torch.full_like(params[2], 3.0)
    with HostReads() as counted:
        assert record.restore_grads(known_zero=frozenset({id(params[3])})) is None
    assert counted.ops == {"_foreach_zero_": 1, "_foreach_copy_": 1} and counted.reads == 0
    assert all(p.grad is g for p, g in zip(params, captured))
    assert torch.equal(params[0].grad, torch.zeros_like(params[0]))
    assert torch.equal(params[1].grad, torch.full_like(params[1], 2.0))
    assert torch.equal(params[2].grad, torch.full_like(params[2], 3.0))
    assert torch.equal(params[3].grad, torch.full_like(params[3], 5.0))


def test_a_gradient_the_graph_never_had_is_refused():
    model, optimizer = _stepped()
    model[1].bias.grad = None
    record = CaptureRecord(model, optimizer)
    model[1].bias.grad = torch.zeros_like(model[1].bias)
    assert "had none" in record.restore_grads()


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda m, o: m[0].weight.requires_grad_(False), "requires_grad"),
        (lambda m, o: o.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]}), "groups"),
        (lambda m, o: o.param_groups[0].__setitem__("params", list(o.param_groups[0]["params"])), "parameter list"),
        (lambda m, o: o.state.clear(), "optimizer state"),
        (lambda m, o: o.state.__setitem__(m[1].bias, {}), "optimizer state"),
        (lambda m, o: setattr(o, "state", type(o.state)()), "optimizer state was replaced"),
        # two parameters' entries swapped: the same entries, bound to the other tensors
        (lambda m, o: o.state.update({m[0].bias: o.state[m[1].bias], m[1].bias: o.state[m[0].bias]}), "optimizer state"),
        # an entry for a tensor that had none (a defaultdict read creates one)
        (lambda m, o: o.state[torch.nn.Parameter(torch.ones(1))], "optimizer state"),
    ],
)
def test_structure_changes_are_named(change, expected):
    model, optimizer = _stepped()
    record = CaptureRecord(model, optimizer)
    change(model, optimizer)
    assert expected in record.structure_change(optimizer)


def test_another_optimizer_and_replaced_model_parameters_are_named():
    model, optimizer = _stepped()
    record = CaptureRecord(model, optimizer)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "optimizer was replaced (a SGD" in record.structure_change(other)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    assert "parameters were replaced" in record.model_change(model)


# ------------------------------------------------------------------ in the engine (CPU stand-ins)
class StrictHostGraph(HostGraph):
    """A stand-in graph that, like a real one, can only write the gradient tensors and optimizer
    state it was captured with: a replay on anything else fails instead of silently working."""

    def __init__(self, recorded: HostGraph, optimizer):
        super().__init__(recorded._body, recorded.compiled_code, recorded.captured_grads)
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads = [p.grad for p in self.params]
        self.state = [optimizer.state.get(p) for p in self.params]

    def replay(self):
        assert all(p.grad is g for p, g in zip(self.params, self.grads)), "replay on rebound gradients"
        assert all(self.optimizer.state.get(p) is s for p, s in zip(self.params, self.state)), "stale state"
        super().replay()


class StrictEngine(HostGraphEngine):
    def _capture(self, body):
        graph, outputs = super()._capture(body)
        from fasttrain.engine.hyperparams import inner_optimizer

        return StrictHostGraph(graph, inner_optimizer(self.trainer.optimizer)), outputs


class ClearGradientsAt(TrainerCallback):
    """Sets the gradients to None after the given micro-steps (mid-window with accumulation 2)."""

    def __init__(self, steps):
        self.steps, self.seen = set(steps), 0

    def on_train_step_end(self, trainer, **kwargs):
        if self.seen in self.steps:
            trainer.optimizer.zero_grad(set_to_none=True)
        self.seen += 1


class ResetAdamStateAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.seen = step, 0

    def on_train_step_end(self, trainer, **kwargs):
        if self.seen == self.step:
            getattr(trainer.optimizer, "optimizer", trainer.optimizer).state.clear()
        self.seen += 1


def _run(engine, callback, epochs=3):
    torch.manual_seed(0)
    case = mlp_case(epochs=epochs)
    model = case.model()
    recorder = Recorder()
    trainer = Trainer(model, case.loss, case.optimizer(model), engine=engine, log_every_n_steps=3,
                      compile_options=AOT, callbacks=[callback, recorder])
    data = case.data()
    trainer.train(data, epochs, per_device_batch_size=8, gradient_accumulation_steps=2, gradient_clip_norm=0.5,
                  train_dataloader_kwargs={"shuffle": False, "num_workers": 0})
    return Run(recorder, trainer, {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()})


@pytest.mark.parametrize(
    "make_callback, recaptures",
    [
        # steps 6 and 12 end non-update micro-steps (replays): the window's gradient is dropped
        (lambda: ClearGradientsAt({6, 12}), 0),
        # Adam starts over at step 13, between replays, as eager's lazily created state does:
        # the graphs are captured again
        (lambda: ResetAdamStateAt(13), 1),
        # at step 9, after the partial batch released the graphs and before the update is
        # captured again: that capture would compile the state's creation, so the engine warms
        # up again first (compile_events.py) and captures once the state exists, no recapture
        (lambda: ResetAdamStateAt(9), 0),
    ],
    ids=["zero-grad-set-to-none", "optimizer-state-reset", "optimizer-state-reset-before-capture"],
)
def test_changes_between_replays_match_eager(monkeypatch, make_callback, recaptures):
    from engine_cases import assert_runs_match

    monkeypatch.setitem(ENGINES, "cudagraph", StrictEngine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = _run("eager", make_callback())
        graphed = _run("cudagraph", make_callback())
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine._recaptures == recaptures
    assert set(engine._train_graphs) == {False, True}
    assert sum(g.graph.replays for g in engine._train_graphs.values()) > 0
    assert_runs_match(eager, graphed)


def test_a_change_at_every_step_stops_capturing_with_one_warning(monkeypatch):
    class FlipRequiresGrad(TrainerCallback):
        # after every update (odd micro-steps with accumulation 2), so each graph meets a change
        seen = 0

        def on_train_step_end(self, trainer, **kwargs):
            if self.seen % 2:
                bias = trainer.get_model().net[-1].bias
                bias.requires_grad_(not bias.requires_grad)
            self.seen += 1

    from fasttrain.engine import cudagraph

    monkeypatch.setitem(ENGINES, "cudagraph", StrictEngine)
    monkeypatch.setattr(cudagraph, "MAX_RECAPTURES", 1)  # 3 in a real run: fewer steps here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = _run("cudagraph", FlipRequiresGrad(), epochs=2)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1 and "requires_grad changed" in messages[0] and "2 times" in messages[0], messages
    assert "'compiled'" in messages[0]
    assert graphed.trainer.active_engine == "compiled"
