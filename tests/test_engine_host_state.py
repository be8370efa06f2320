"""HostStateWatch (fasttrain/engine/host_state.py): the Python state a captured step changes,
which a replay would not change again, found and put back; and the graphed engine refusing such
captures for PA trainers' hooks and for the model, with the CPU stand-ins for CUDA graphs."""

from __future__ import annotations

import collections

import torch

from fasttrain import Trainer
from fasttrain.engine.host_state import HostStateWatch

from engine_cases import MLP, assert_runs_match, eager_and, mlp_case
from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: F401


class Owner:
    def __init__(self):
        self.count = 3
        self.kept = [1, 2]
        self.table = collections.defaultdict(list, a=[1])
        self.seen = {"x"}
        self.output = torch.zeros(2)


def test_nothing_changed_is_none_and_each_kind_of_change_is_named():
    owner = Owner()
    assert HostStateWatch([(owner, "Owner")]).changed() is None
    for change, expected in (
        (lambda o: setattr(o, "count", o.count + 1), "Owner.count (int: 3 -> 4)"),
        (lambda o: o.kept.append(3), "Owner.kept (a list changed in place: 2 -> 3 items)"),
        (lambda o: o.table.__setitem__("b", []), "Owner.table (a defaultdict changed in place: 1 -> 2 items)"),
        (lambda o: setattr(o, "count", None), "Owner.count (NoneType: 3 -> None)"),
        (lambda o: setattr(o, "new", 1), "Owner.new (set for the first time, to 1)"),
        (lambda o: delattr(o, "seen"), "Owner.seen (deleted)"),
    ):
        owner = Owner()
        watch = HostStateWatch([(owner, "Owner")])
        change(owner)
        assert watch.changed() == expected


def test_tensors_and_containers_assigned_anew_are_what_a_replay_shows_too():
    # they hold the graph's outputs, which each replay overwrites: the attribute shows the
    # latest step, as in eager
    owner = Owner()
    watch = HostStateWatch([(owner, "Owner")])
    owner.output = torch.ones(2)
    owner.kept = [torch.ones(1)] * 5
    owner.latest = torch.ones(1)
    owner.table["a"] = [2]  # same length
    assert watch.changed() is None


def test_restore_puts_values_and_container_contents_back():
    owner = Owner()
    kept, table, output = owner.kept, owner.table, owner.output
    watch = HostStateWatch([(owner, "Owner")])
    owner.count += 5
    owner.kept.append(9)
    owner.table["b"].append(2)
    owner.seen = set()
    owner.output = torch.ones(2)
    owner.extra = "x"
    watch.restore()
    assert owner.count == 3 and owner.kept is kept and owner.kept == [1, 2]
    assert owner.table is table and dict(owner.table) == {"a": [1]} and owner.seen == {"x"}
    assert owner.output is output and not hasattr(owner, "extra")
    assert watch.changed() is None


class CollectsPredictions(Trainer):
    """Keeps every evaluation batch's predictions in a list from inside the hook."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.predictions = []

    def calculate_eval_batch_loss(self, batch):
        output = super().calculate_eval_batch_loss(batch)
        self.predictions.append(output["model_outputs"].argmax(-1))
        return output


def test_predictions_appended_in_the_evaluation_hook_are_all_kept_as_in_eager():
    # a replayed evaluation graph would append nothing: the capture is refused, evaluation runs
    # compiled, and the list holds every batch's predictions
    case = mlp_case(epochs=2, trainer_cls=CollectsPredictions)
    eager, graphed, messages = eager_and(case, "cudagraph", AOT)
    assert "CollectsPredictions.predictions (a list changed in place" in messages[0], messages
    engine = graphed.trainer._engine
    # the list's length is a guard too: each call compiles anew, and at dynamo's limit the
    # evaluation runs eagerly (the second warning)
    assert engine.active_engine == "cudagraph" and engine.active_eval_engine in ("compiled", "eager")
    assert len(graphed.trainer.predictions) == len(eager.trainer.predictions) == 2 * 9
    for ours, theirs in zip(graphed.trainer.predictions, eager.trainer.predictions):
        assert torch.equal(ours, theirs)
    assert_runs_match(eager, graphed)


class CountsCalls(MLP):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_a_model_counting_its_forward_calls_counts_every_step_as_in_eager():
    case = mlp_case(epochs=2)
    case.model = CountsCalls
    eager, graphed, messages = eager_and(case, "cudagraph", AOT, eval_dataset=None)
    assert "CountsCalls.calls (int: " in messages[0], messages
    # an integer attribute of a module is compiled in as a constant: each value compiles anew,
    # and at dynamo's limit the steps run eagerly
    assert graphed.trainer.active_engine in ("compiled", "eager")
    assert graphed.trainer.get_model().calls == eager.trainer.get_model().calls == 2 * 9
    assert_runs_match(eager, graphed)
