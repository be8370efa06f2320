"""A run under ``torchrun --max-restarts 1`` that loses a process (SIGKILL) restarts itself and
ends bit for bit where a run never interrupted ends: two gloo processes on the CPU, DDP and FSDP2
(DCP states), every start the same ``train(..., resume_from="latest")``
(tests/dist/restart_worker.py).

The kill comes at a pseudo-random training step after the first periodic state (drawn from
``KILL_SEED``), inside a save (after the staging folder is complete, before it takes the state's
name), or before any state exists. Each test prints what the restart cost: the moments of the
restarted start (the script began, imports done, Trainer built, state loaded and training begun,
first training step done) in seconds after the kill.
"""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch

from launching import run_restartable

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "dist" / "restart_worker.py"
#: one launch: two starts of two processes, each training for a few seconds
LAUNCH_TIMEOUT_S = 240
#: torchrun's wait for the processes it stops before it kills them (not configurable for a
#: restart): a survivor that leaves sooner left on its own, at its next collective
TORCHRUN_STOP_GRACE_S = 30
KILL_SEED = 28
#: 12 training steps, a state every 3 (after the saves of step 3, 6, 9 and 12)
STEPS, SAVE_EVERY = 12, 3


def _launch(out: Path, mode: str, scenario: str, kill_step: int = 0, kill_rank: int = 0) -> types.SimpleNamespace:
    out.mkdir(parents=True, exist_ok=True)
    restarts = 0 if scenario == "none" else 1
    seconds = run_restartable(WORKER, out, mode, scenario, kill_step, kill_rank, max_restarts=restarts,
                              timeout_s=LAUNCH_TIMEOUT_S, what=f"torchrun --max-restarts {restarts} ({mode}, {scenario})",
                              planned=None if scenario == "none" else "killed.pt")
    killed = out / "killed.pt"
    return types.SimpleNamespace(
        ranks=[torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)],
        killed=torch.load(killed, weights_only=False) if killed.exists() else None,
        seconds=seconds,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each mode, launched the first time a test asks for it."""
    runs = {}

    def get(mode: str):
        if mode not in runs:
            runs[mode] = _launch(tmp_path_factory.mktemp(f"reference_{mode}"), mode, "none")
            print(f"\nuninterrupted {mode} launch: {runs[mode].seconds:.1f}s")
        return runs[mode]

    return get


def _assert_restarted_and_equal(run, expected_resume, reference_run, mode: str) -> None:
    for rank, (got, expected) in enumerate(zip(run.ranks, reference_run.ranks)):
        assert got["attempt"] == 1, rank  # torchrun started the pair once more, by itself
        assert got["resumed_from"] == expected_resume, rank
        assert got["sharded"] == (mode == "fsdp2")
        assert got["num_updates"] == expected["num_updates"] == 6
        assert got["weights"].keys() == expected["weights"].keys()
        for name, value in expected["weights"].items():
            assert torch.equal(got["weights"][name], value), (rank, name)
        assert len(got["optimizer"]) == len(expected["optimizer"]) == 4
        for i, (a, b) in enumerate(zip(got["optimizer"], expected["optimizer"])):
            assert a.keys() == b.keys() == {"exp_avg", "exp_avg_sq", "step"}, (rank, i)
            for key in b:
                assert torch.equal(a[key], b[key]), (rank, i, key)
    # the restarted processes started their process group from a store of their own, not the
    # one of the first start, whose addresses are stale
    assert {r["store_port"] for r in run.ranks} == {run.ranks[0]["store_port"]} != {run.killed["store_port"]}
    # the process-group timeout given through Trainer(accelerator_kwargs=...) is the group's
    assert [r["process_group_timeout"].total_seconds() for r in run.ranks] == [120, 120]
    # the survivor failed at its next collective; torchrun did not have to kill it
    killed = run.killed["time"]
    restarted = min(r["times"]["started"] for r in run.ranks) - killed
    assert 0 < restarted < TORCHRUN_STOP_GRACE_S
    # the moments of the restarted start, from the kill: the slower process's
    moments = {name: max(r["times"][name] for r in run.ranks) - killed for name in run.ranks[0]["times"]}
    print(
        f"\nrestart cost ({mode}), seconds after the kill: "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in moments.items())
        + f"; launch {run.seconds:.1f}s"
    )


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_process_killed_after_a_state_restarts_the_job_which_ends_equal_to_the_uninterrupted_run(
    tmp_path, reference, mode
):
    draw = random.Random(f"{KILL_SEED}-{mode}")
    kill_step, kill_rank = draw.randint(SAVE_EVERY + 1, STEPS - 1), draw.randint(0, 1)
    print(f"\n{mode}: process {kill_rank} killed after step {kill_step}")
    run = _launch(tmp_path, mode, "after_step", kill_step, kill_rank)
    assert run.killed["rank"] == kill_rank
    newest = SAVE_EVERY * (kill_step // SAVE_EVERY)
    _assert_restarted_and_equal(run, str(tmp_path / "states" / f"step_{newest}"), reference(mode), mode)
    # the rotation (two states kept) went on across the restart
    assert run.ranks[0]["states"] == ["step_12", "step_9"]


@pytest.mark.parametrize("mode", ["fsdp2"])
def test_a_kill_during_a_save_resumes_from_the_state_before_it(tmp_path, reference, mode):
    run = _launch(tmp_path, mode, "during_save")
    # the save of step 6 had written every file and its manifest, and was killed before the
    # staging folder took the state's name: a state that is not there, never chosen
    assert {"manifest.json", "trainer_state.pt", "rng_state_0.pt", "rng_state_1.pt", "dcp"} <= set(run.killed["staging"])
    assert run.killed["rank"] == 0
    _assert_restarted_and_equal(run, str(tmp_path / "states" / "step_3"), reference(mode), mode)


@pytest.mark.parametrize("mode", ["ddp"])
def test_a_kill_before_any_state_starts_again_from_scratch_and_equals_the_uninterrupted_run(tmp_path, reference, mode):
    kill_rank = random.Random(f"{KILL_SEED}-{mode}-early").randint(0, 1)
    run = _launch(tmp_path, mode, "after_step", SAVE_EVERY - 1, kill_rank)
    assert run.killed["rank"] == kill_rank
    _assert_restarted_and_equal(run, None, reference(mode), mode)


def test_a_failure_to_choose_the_state_is_raised_on_every_process(reference):
    """The first process chooses the state and tells the others: when it fails (here its listing
    raises), the others are told so and raise too, instead of waiting for an answer."""
    errors = [rank["decision_errors"] for rank in reference("ddp").ranks]
    assert errors[0][0] == "PermissionError"
    assert errors[1] == ["CheckpointError", f"Choosing the state to resume from failed on process 0: PermissionError: {errors[0][1]}"]
