"""The tensors that outlive the graphed engine's captures (gradients, optimizer state, static batch
buffers) are allocated apart from the warm-up's activations (fasttrain/engine/long_lived.py), and
training on the moved copies gives eager's weights.

On the CPU the stand-in's allocation context is the default allocator: what these tests check is
which tensors are made inside it, that the moved copies are bound everywhere the originals were,
and that nothing is compiled again for them. Whether the warm-up's segments then go back before
the graphs' pool is taken is for the device (test_engine_cuda_second_pass's memory tests)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from fasttrain.engine import ENGINES, cudagraph, graph_eval, long_lived
from fasttrain.engine.graph_buffers import StaticBatch
from fasttrain.engine.long_lived import LongLivedTensors

from engine_cases import assert_runs_match, mlp_case
from test_engine_graph_logic import HostGraphEngine, eager_and_graphed, host_graphs  # noqa: F401

#: the allocator's limit, read before host_graphs lowers it for the stand-in runs
ALLOCATOR_LIMIT = long_lived.SMALL_BLOCK_LIMIT


class PlacementRecordingEngine(HostGraphEngine):
    """Records the tensors that came into being inside the long-lived allocation context: the
    optimizer's state, the gradients and the static batch buffers found at its exit that were not
    there at its entry."""

    made_inside: list = []
    inside = False

    def _held(self):
        optimizer = self.trainer.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)
        held = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        held += [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        held += list(self._grads.kept.values())
        return held

    @contextlib.contextmanager
    def _long_lived_allocations(self):
        held_before = self._held()  # kept alive, so that no tensor made inside takes one's id
        before = {id(t) for t in held_before}
        PlacementRecordingEngine.inside = True
        try:
            yield
        finally:
            PlacementRecordingEngine.inside = False
        PlacementRecordingEngine.made_inside += [t for t in self._held() if id(t) not in before]


class PlacedStaticBatch(StaticBatch):
    def __init__(self, batch):
        super().__init__(batch)
        self.made_in_long_lived_context = PlacementRecordingEngine.inside


@pytest.fixture
def recording(monkeypatch):
    PlacementRecordingEngine.made_inside = []
    monkeypatch.setitem(ENGINES, "cudagraph", PlacementRecordingEngine)
    monkeypatch.setattr(cudagraph, "StaticBatch", PlacedStaticBatch)  # training's
    monkeypatch.setattr(graph_eval, "StaticBatch", PlacedStaticBatch)  # evaluation's


def test_state_gradients_and_static_buffers_are_made_in_the_long_lived_context_and_train_as_eager(recording):
    eager, graphed = eager_and_graphed(mlp_case(), evaluate=True)
    engine = graphed.trainer._engine
    inside = {id(t) for t in PlacementRecordingEngine.made_inside}
    optimizer = graphed.trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
    assert state and all(id(t) in inside for t in state)  # exp_avg, exp_avg_sq: made by the first update
    assert [g is not None and id(g) in inside for g in grads] == [True] * len(grads), [(g is None, tuple(g.shape) if g is not None else None) for g in grads]  # moved before the first pool
    statics = [engine._static, engine._last_static, engine._eval_static, engine._eval_last_static]
    assert all(static is not None and static.made_in_long_lived_context for static in statics)
    assert_runs_match(eager, graphed)


def _big(n=(1 << 20) // 4 + 1):
    return torch.zeros(n)


@pytest.fixture
def allocator_limit(monkeypatch):
    monkeypatch.setattr(long_lived, "SMALL_BLOCK_LIMIT", ALLOCATOR_LIMIT)


def test_move_copies_large_whole_gradients_once_and_binds_them_everywhere(allocator_limit):
    params = [torch.nn.Parameter(_big()), torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(_big())]
    params[0].grad = torch.full_like(params[0], 2.0)
    params[1].grad = torch.ones(4)  # small: from the allocator's small segments, left as it is
    dropped = torch.full_like(params[2], 3.0)  # a gradient a hook set to None, kept by the engine
    kept = {params[0]: params[0].grad, params[2]: dropped}
    small_grad, original = params[1].grad, params[0].grad
    mover = LongLivedTensors()
    assert mover.move(params, kept) == 2
    assert params[0].grad is not original and torch.equal(params[0].grad, torch.full_like(params[0], 2.0))
    assert kept[params[0]] is params[0].grad  # the kept gradient is the bound one
    assert kept[params[2]] is not dropped and torch.equal(kept[params[2]], dropped) and params[2].grad is None
    assert params[1].grad is small_grad
    moved = (params[0].grad, kept[params[2]])
    assert mover.move(params, kept) == 0  # each is moved once
    assert (params[0].grad, kept[params[2]]) == moved


def test_views_and_shared_storages_are_not_copied_apart(allocator_limit):
    base = torch.zeros(2, (1 << 20) // 4 + 1)
    p = torch.nn.Parameter(torch.zeros(base.shape[1]))
    p.grad = base[1]  # a view: copying it alone would cut it from its storage
    assert LongLivedTensors().move([p], {}) == 0
    assert p.grad._base is base


def test_the_small_block_limit_is_the_allocators(allocator_limit):
    assert ALLOCATOR_LIMIT == 1 << 20
    assert not long_lived._movable(torch.zeros((1 << 20) // 4))  # exactly 1 MiB: a small block
    assert long_lived._movable(torch.zeros((1 << 20) // 4 + 1))
