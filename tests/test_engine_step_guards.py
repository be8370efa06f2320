"""The graphed engine checks dynamo's guards of the compiled code each graph was captured from
before replaying it (fasttrain/engine/step_guards.py): a step whose Python reads a value that
changed since its capture, to one whose compiled variant exists already (so nothing compiles), runs
compiled and is captured again, instead of replaying the captured value. CPU stand-ins for CUDA
graphs (test_engine_graph_logic), whose replays fail where they run other compiled code than the
capture did."""

from __future__ import annotations

import torch

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.engine.step_guards import ReplayGuards

from engine_cases import assert_runs_match, eager_and, mlp_case
from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: F401


class WeighsItsLoss(Trainer):
    """Scales the training and evaluation losses by ``loss_weight``, a float a callback sets."""

    loss_weight = 1.0

    def calculate_train_batch_loss(self, batch):
        output = super().calculate_train_batch_loss(batch)
        output["loss"] = output["loss"] * self.loss_weight
        return output

    def calculate_eval_batch_loss(self, batch):
        output = super().calculate_eval_batch_loss(batch)
        output["loss"] = output["loss"] * self.loss_weight
        return output


class AlternatingWeight(TrainerCallback):
    """Sets the trainer's loss weight at each epoch start, from a cycle of values."""

    def __init__(self, weights):
        self.weights = weights

    def on_train_epoch_start(self, trainer, **kwargs):
        epoch = trainer.run_history.current_epoch
        trainer.loss_weight = self.weights[(epoch - 1) % len(self.weights)]


class WeightPerStep(TrainerCallback):
    """Sets the trainer's loss weight before each training and evaluation step, from a cycle."""

    def __init__(self, weights):
        self.weights = weights
        self.steps = 0

    def _next(self, trainer):
        trainer.loss_weight = self.weights[self.steps % len(self.weights)]
        self.steps += 1

    def on_train_step_start(self, trainer, **kwargs):
        self._next(trainer)

    def on_eval_step_start(self, trainer, **kwargs):
        self._next(trainer)


def _replays() -> int:
    return sum(graph.replays for graph in HostGraphEngine.graphs)


def test_a_value_returning_to_one_seen_before_is_not_replayed_as_captured():
    # epochs 1 and 3 weigh 1.0, 2 and 4 weigh 0.5: from the third epoch on both variants are
    # compiled, so no capture compiles; where graphs from the epoch before are still held, the
    # guards of their variant fail at the first replay, and the engine captures again
    case = mlp_case(epochs=4, trainer_cls=WeighsItsLoss)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, callbacks=[AlternatingWeight((1.0, 0.5))])
    assert messages == []
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine == "cudagraph"
    assert engine._recaptures >= 1
    assert _replays() > 0
    assert_runs_match(eager, graphed)


def test_a_value_that_keeps_changing_moves_the_step_to_the_compiled_engine_with_the_guard_named():
    # three values in turn, one per step: after the first epoch each is compiled, and each
    # replay's guards fail; after MAX_RECAPTURES captures the steps run compiled
    case = mlp_case(epochs=5, trainer_cls=WeighsItsLoss)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, callbacks=[WeightPerStep((1.0, 0.5, 0.25))])
    engine = graphed.trainer._engine
    assert engine.active_engine == "compiled" and engine.active_eval_engine == "compiled"
    assert len(messages) == 2, messages
    for message, hook in zip(sorted(messages), ("calculate_eval_batch_loss", "calculate_train_batch_loss")):
        assert f"the '{hook}' hook cannot run in the 'cudagraph' engine" in message
        assert "trainer.loss_weight ==" in message and "4 times this run" in message, message
        assert "keep values such as the batch index" in message
    assert_runs_match(eager, graphed)


def _scaled(holder, x):
    return x * holder.k


class _Holder:
    k = 1


def _never_compiled():
    return None


def test_the_guards_of_the_variant_last_run_fail_for_another_value_and_name_it():
    holder, x = _Holder(), torch.ones(2)
    body = _scaled.__code__.replace()
    function = type(_scaled)(body, _scaled.__globals__, "_scaled")
    compiled = torch.compile(function, backend="eager", dynamic=False)
    for k in (1, 2, 1):
        holder.k = k
        compiled(holder, x)
    guards = ReplayGuards.taken([("hook", body, lambda: {"holder": holder, "x": x})])
    assert guards.failure() is None
    holder.k = 2  # compiled too, but not the variant the last call ran
    hook, guard = guards.failure()
    assert hook == "hook" and "holder'].k == 1" in guard
    # a function that never compiled has no guards to keep: nothing to check
    assert ReplayGuards.taken([("hook", _never_compiled.__code__, dict)]).failure() is None
