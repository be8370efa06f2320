"""pytorch-accelerated's scripts (``differential_scripts``) under fasttrain's compiled and graphed
engines, against the original.

test_differential.py compares the original with fasttrain's default engine (eager on the CPU);
here the same scripts run through the compiled step and through the graphed engine with the CPU
stand-ins for CUDA graphs (test_engine_graph_logic: a capture runs nothing and draws no random
numbers, a replay runs the recorded step). Losses and weights agree to compile's rounding; events,
update counts and the learning rates the groups show agree exactly.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

pytest.importorskip("pytorch_accelerated")

import differential_scripts as ds  # noqa: E402
from test_differential import assert_history_close  # noqa: E402
from test_engine_graph_logic import HostGraphEngine, host_graphs  # noqa: E402,F401


ENGINE_KWARGS = {
    "compiled": {"engine": "compiled", "compile_options": {"backend": "aot_eager"}},
    # the graphed engine with the CPU stand-ins for CUDA graphs (test_engine_graph_logic)
    "cudagraph": {"engine": "cudagraph", "compile_options": {"backend": "aot_eager"}},
}
SCRIPTS_UNDER_COMPILE = {
    # name: (script, accumulation the original's train_loss_epoch is divided by)
    "plain": (ds.script_plain, 1),  # shuffled, with dropout
    "accumulation": (ds.script_accumulation, 3),
    "clip-value": (ds.script_clip_value, 1),
    "max-steps-mid-accumulation": (lambda lib: ds.script_max_steps(lib, accumulation=3), 3),
    "evaluate": (ds.script_evaluate, 1),
    "custom-event": (ds.script_custom_event, 1),
}


def _with_engine(lib, engine: str):
    # the graphed engine refuses to capture a step that changes a Python counter (the recording
    # trainer's count of optimizer_step calls): see the test of that below
    return dataclasses.replace(
        lib, trainer_kwargs={**lib.trainer_kwargs, **ENGINE_KWARGS[engine]}, counts_optimizer_steps=engine != "cudagraph"
    )


@pytest.mark.parametrize("engine", sorted(ENGINE_KWARGS))
@pytest.mark.parametrize("script", sorted(SCRIPTS_UNDER_COMPILE))
def test_the_scripts_match_the_original_under_the_compiled_and_graphed_engines(original, ours, script, engine):
    # the same scripts through fasttrain's compiled (or captured and replayed) step: run history
    # (losses to compile's rounding), events, update counts, learning rates and weights as under
    # pytorch-accelerated, with no fallback
    run, accumulation = SCRIPTS_UNDER_COMPILE[script]
    a = run(original)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = run(_with_engine(ours, engine))
    assert not [str(w.message) for w in caught if "fasttrain:" in str(w.message)]
    ds.weights_close(a.weights, b.weights, rtol=1e-4, atol=1e-6)
    history_a = dict(a.history)
    if "train_loss_epoch" in history_a:
        history_a["train_loss_epoch"] = [v * accumulation for v in history_a["train_loss_epoch"]]
    assert_history_close(history_a, b.history, rel=1e-4)
    assert a.events == b.events
    assert a.extra["lrs"] == b.extra["lrs"]
    if engine == "cudagraph":
        assert sum(graph.replays for graph in HostGraphEngine.graphs) > 0  # the steps were replayed
    else:
        assert a.extra["num_optimizer_steps"] == b.extra["num_optimizer_steps"]


@pytest.mark.parametrize("engine", sorted(ENGINE_KWARGS))
def test_finetuning_matches_the_original_under_the_compiled_and_graphed_engines(original, ours, engine):
    a = ds.script_finetuning(original, fresh_trainer_for_second_phase=True)
    b = ds.script_finetuning(_with_engine(ours, engine))
    # unfreezing adds a parameter group between the runs: the second phase's update holds it
    ds.weights_close(a.weights, b.weights, rtol=1e-4, atol=1e-6)
    assert b.history["eval_loss_epoch"][2:] == pytest.approx(a.history["eval_loss_epoch"], rel=1e-4)


def test_a_trainer_counting_its_optimizer_steps_is_not_replayed_with_a_stuck_count(original, ours):
    # a replay runs no Python: a counter the hooks change would stop at its value at the
    # capture (on a device; the stand-in's replay runs the hooks again and counts each capture
    # twice). The graphed engine refuses such a capture, says which attribute, and the compiled
    # engine counts every update, as the original does
    a = ds.script_accumulation(original)
    graphed = dataclasses.replace(ours, trainer_kwargs={**ours.trainer_kwargs, **ENGINE_KWARGS["cudagraph"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = ds.script_accumulation(graphed)
    ours_warnings = [str(w.message) for w in caught if "fasttrain:" in str(w.message)]
    assert len(ours_warnings) == 1, ours_warnings
    assert "RecordingTrainer.num_optimizer_steps (int: " in ours_warnings[0], ours_warnings
    assert "keep such state in a callback" in ours_warnings[0] and "'compiled' engine" in ours_warnings[0]
    assert b.extra["num_optimizer_steps"] == a.extra["num_optimizer_steps"] == 9  # 3 epochs of 3 updates
    ds.weights_close(a.weights, b.weights, rtol=1e-4, atol=1e-6)
    assert a.events == b.events

