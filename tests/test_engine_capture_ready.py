"""What exists before a capture: no compilation and no device allocation may happen inside one.

Runs the graphed engine's logic on the CPU with the host stand-ins of test_engine_graph_logic.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from test_engine_graph_logic import AOT, HostGraphEngine, host_graphs  # noqa: F401
from engine_cases import CountsCaptureFrames, fasttrain_warnings, mlp_case, run
from fasttrain import Trainer


class CountingCaptures(CountsCaptureFrames, HostGraphEngine):
    pass


@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_nothing_compiles_during_capture_or_after_the_first_epoch(monkeypatch, nonfinite):
    from fasttrain.engine import ENGINES, masked_step

    monkeypatch.setitem(ENGINES, "cudagraph", CountingCaptures)
    # "skip" as on a GPU: the first update checks on the host, later ones mask on the device
    monkeypatch.setattr(masked_step, "host_read_is_free", lambda device: False)
    CountingCaptures.frames_in_captures = []
    # 70 samples / 8: a partial last batch of 6; accumulation 2
    case = mlp_case(epochs=3, trainer_cls=functools.partial(Trainer, nonfinite=nonfinite))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(case, "cudagraph", AOT)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    # non-update, update and evaluation graphs, captured again after the partial batches' first
    # runs, and the partial batches' own (training, evaluation): 3 + 3 + 2
    assert CountingCaptures.frames_in_captures == [0] * 8
    after = graphed.recorder.counts_after_epoch
    assert after[0] == after[1] == after[2], after


@pytest.mark.parametrize("engine", ["compiled", "cudagraph"])
def test_the_first_updates_host_check_logs_no_graph_break(monkeypatch, engine):
    # nonfinite="skip" reads the flag on the host until the optimizer state exists; inside the
    # compiled update that read is a deliberate split of the graph, not one for the user to fix
    import logging

    from fasttrain.engine import ENGINES, masked_step
    from log_records import torch_log_records

    monkeypatch.setitem(ENGINES, "cudagraph", CountingCaptures)
    monkeypatch.setattr(masked_step, "host_read_is_free", lambda device: False)
    CountingCaptures.frames_in_captures = []
    case = mlp_case(epochs=1, trainer_cls=functools.partial(Trainer, nonfinite="skip"))
    with warnings.catch_warnings(record=True) as caught, torch_log_records(logging.WARNING) as records:
        warnings.simplefilter("always")
        result = run(case, engine, AOT, eval_dataset=None)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    assert result.trainer.active_engine == engine
    assert [r.getMessage() for r in records if "graph break" in r.getMessage().lower()] == []


def test_the_clipping_and_skip_flags_exist_before_the_first_update():
    from fasttrain.engine.clipping import GradientClipper
    from fasttrain.nonfinite import NonFiniteGuard

    model = torch.nn.Linear(3, 2)
    clipper = GradientClipper(model.parameters(), clip_norm=1.0)
    assert clipper.found_inf is not None and clipper.found_inf.tolist() == [0.0]
    guard = NonFiniteGuard("skip", torch.optim.SGD(model.parameters(), lr=0.1))
    assert guard.found_inf is not None and guard.pending_skips is not None
    flag = guard.found_inf
    model(torch.ones(1, 3)).sum().backward()
    guard.clip(clipper)
    guard.clip(clipper)
    # one flag object for the whole run: the compiled update guards on what it reads
    assert guard.found_inf is flag and clipper.found_inf is flag


def _strided_collate(samples):
    # each batch's features are every other column of a wider buffer: a strided, non-contiguous view
    xs = torch.stack([s[0] for s in samples])
    wide = torch.zeros(xs.size(0), 2 * xs.size(1))
    wide[:, ::2] = xs
    return wide[:, ::2], torch.stack([s[1] for s in samples])


def test_strided_batches_are_captured_without_tracing_again(monkeypatch):
    from fasttrain.engine import ENGINES

    monkeypatch.setitem(ENGINES, "cudagraph", CountingCaptures)
    CountingCaptures.frames_in_captures = []
    case = mlp_case(epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run(case, "eager", collate_fn=_strided_collate)
        graphed = run(case, "cudagraph", AOT, collate_fn=_strided_collate)
    assert not fasttrain_warnings(caught), fasttrain_warnings(caught)
    engine = graphed.trainer._engine
    assert engine.active_engine == "cudagraph" and set(engine._train_graphs) == {False, True}
    assert engine._static.tree[0].stride() == (16, 2) and engine._last_static.tree[0].stride() == (16, 2)
    # every capture (the graphs of both batch shapes, captured again after the partial batch's
    # first run) found its step compiled
    assert len(CountingCaptures.frames_in_captures) >= 5 and set(CountingCaptures.frames_in_captures) == {0}
    for key in eager.state:
        torch.testing.assert_close(graphed.state[key], eager.state[key], rtol=1e-4, atol=1e-5)


def test_expanded_batches_are_not_captured(monkeypatch):
    from fasttrain.engine import ENGINES

    monkeypatch.setitem(ENGINES, "cudagraph", CountingCaptures)
    CountingCaptures.frames_in_captures = []

    def expanded_collate(samples):
        xs = torch.stack([s[0] for s in samples])
        return xs[:1].expand_as(xs), torch.stack([s[1] for s in samples])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = run(mlp_case(epochs=1), "cudagraph", AOT, collate_fn=expanded_collate, eval_dataset=None)
    messages = fasttrain_warnings(caught)
    assert len(messages) == 1 and "overlap in memory" in messages[0] and "contiguous" in messages[0]
    assert graphed.trainer._engine.active_engine == "compiled"
    assert CountingCaptures.frames_in_captures == []
