"""benchmarks/replay_overhead.py: the graphed engine's host work per step, with replays that cost
nothing, on the CPU."""

import importlib.util
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "replay_overhead.py"
    spec = importlib.util.spec_from_file_location("replay_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_graphed_peer_replays_its_timed_steps_and_the_engines_are_put_back():
    import fasttrain.engine as engines

    script = _script()
    before = engines.ENGINES["cudagraph"], engines.auto_engine_name
    script.FreeReplayEngine.graphs = []
    times = script.measure(["fasttrain-cudagraph", "bare"], steps=30, repeats=2, warmup=20)
    assert sorted(times) == ["bare", "fasttrain-cudagraph"]
    assert all(len(per_repeat) == 2 and min(per_repeat) > 0 for per_repeat in times.values())
    # the warm-up's capture, replayed by the timed steps of both repeats (each a new train())
    assert sum(graph.replays for graph in script.FreeReplayEngine.graphs) >= 2 * (30 - script.WARMUP_STEPS_PER_RUN)
    assert (engines.ENGINES["cudagraph"], engines.auto_engine_name) == before
    table = script.report(times)
    assert table.splitlines()[2].startswith("| fasttrain-cudagraph | ") and "| 1.00 [1.00-1.00] |" in table


def test_a_peer_that_leaves_the_graphed_engine_is_not_reported_as_replaying(monkeypatch):
    script = _script()
    # a capture that always fails: the engine falls back and nothing replays
    monkeypatch.setattr(script.FreeReplayEngine, "_record", lambda self, body: (_ for _ in ()).throw(RuntimeError("no capture")))
    with pytest.raises(RuntimeError, match="left the graphed engine"):
        script.measure(["fasttrain-cudagraph"], steps=30, repeats=1, warmup=20)


def test_per_run_costs_are_the_line_through_two_run_lengths():
    script = _script()
    script.FreeReplayEngine.graphs = []
    runs = script.measure_runs(["fasttrain-cudagraph"], [12, 40], repeats=2, warmup=20)
    assert sorted(runs["fasttrain-cudagraph"]) == [12, 40]
    assert all(len(ms) == 2 and min(ms) > 0 for ms in runs["fasttrain-cudagraph"].values())
    # a run of 1 ms besides its steps and 10 us per step: 1.12 ms for 12 steps, 1.4 ms for 40
    table = script.report_runs({"peer": {12: [1.12, 1.12], 40: [1.4, 1.4]}})
    header, _, row = table.splitlines()
    assert "ms per run of 12" in header and "ms per run of 40" in header
    assert row == "| peer | 1.1 [1.1-1.1] | 1.4 [1.4-1.4] | 1.0 [1.0-1.0] | 10.0 [10.0-10.0] |"
