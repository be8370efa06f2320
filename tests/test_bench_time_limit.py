"""`fasttrain bench --time-limit`: a run sized to end inside the time a GPU machine lends a step."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import fasttrain.bench.runner as R
from fasttrain.bench.peers import make_peer
from fasttrain.bench.time_limit import (
    MIN_REPEATS, MIN_STEPS, MIN_WARMUP, TimeLimit, fit_schedule, step_work, steps_that_fit,
)
from fasttrain.bench.workloads import make_workload


def test_fit_cuts_repeats_then_steps_then_the_last_repeat():
    # 10 peers at 2 ms a step (4 ms at the spread), 40% of 100 s: 40 s of step work
    assert fit_schedule(0.002, 10, 100.0, steps=100, warmup=10, repeats=3) == (100, 10, 3)  # 10*430*4ms = 17 s
    steps, warmup, repeats = fit_schedule(0.002, 10, 100.0, steps=500, warmup=50, repeats=5)
    assert (steps, warmup, repeats) == (250, 25, MIN_REPEATS)  # repeats first, then steps with warm-up
    assert 10 * step_work(steps, warmup, repeats) * 2 * 0.002 <= 40.0
    assert fit_schedule(0.1, 10, 100.0, steps=40, warmup=10, repeats=3) == (MIN_STEPS, MIN_WARMUP, 1)  # the smallest
    assert fit_schedule(1e-6, 10, 100.0, steps=40, warmup=10, repeats=3) == (40, 10, 3)  # nothing to cut


def test_a_cut_leaves_the_warm_up_a_fresh_run_captures_its_graphs_in():
    # the H200's MLP: the bare loop's 1.6 ms a step, 4 peers, 40 s; 2,000 steps after 50 were
    # cut to 250 after 6, and a Lightning fit's capture fell into the measured steps
    steps, warmup, repeats = fit_schedule(0.0016, 4, 40.0, steps=2000, warmup=50, repeats=3)
    assert steps < 2000 and warmup == MIN_WARMUP >= 8
    # never more warm-up than asked for
    assert fit_schedule(0.1, 10, 100.0, steps=40, warmup=3, repeats=3) == (MIN_STEPS, 3, 1)


def test_steps_that_fit_one_repeat():
    # two peers: 1 ms and 3 ms a step, from pairs of 100 steps; 2 s left -> 2/1.2/0.004 - 2*10 steps
    assert steps_that_fit([(0.1, 100), (0.3, 100)], warmup=10, steps=1000, seconds=2.0) == 396
    assert steps_that_fit([(0.1, 100)], warmup=10, steps=50, seconds=100.0) == 50  # never more than asked
    assert steps_that_fit([(10.0, 100)], warmup=10, steps=50, seconds=1.0) == 1


def test_time_limit_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        TimeLimit(0)


class _SlowSetup:
    """A peer whose set-up never ends on its own (a compile longer than the step's time)."""

    name = "slow"

    def __init__(self, workload):
        self.workload, self.device, self.notes, self.closed = workload, workload.device, [], False

    def setup(self):
        time.sleep(3600)

    def run(self, num_steps):
        raise AssertionError("never set up")

    def close(self):
        self.closed = True


def test_a_set_up_past_its_time_is_stopped_and_the_peers_set_up_are_timed(monkeypatch):
    made = {}

    def fake_make_peer(name, workload):
        made[name] = _SlowSetup(workload) if name == "lightning" else make_peer(name, workload)
        return made[name]

    monkeypatch.setattr(R, "make_peer", fake_make_peer)
    workload = make_workload("mlp", size="tiny", device="cpu", batch_size=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command sets it on a CPU: a shared host's cores stay free
    try:
        start = time.monotonic()
        bench = R.run_benchmark(
            workload, ["bare", "lightning", "fasttrain-eager"], steps=20, warmup=2, repeats=100000,
            progress=False, gpu_metrics=False, time_limit=TimeLimit(15.0),
        )
        elapsed = time.monotonic() - start
    finally:
        torch.set_num_threads(threads)
    assert elapsed < 15.0 + 2.0  # the limit, and the last repeat's margin at most
    peers = {p.name: p for p in bench.peers}
    assert peers["lightning"].status == "skipped" and "set-up ran past" in peers["lightning"].reason
    assert made["lightning"].closed
    assert peers["fasttrain-eager"].status == "skipped" and "left no room" in peers["fasttrain-eager"].reason
    assert peers["bare"].status == "ok" and len(peers["bare"].step_times) == bench.completed_repeats >= 1
    assert not bench.interrupted and bench.settings["repeats"] == bench.completed_repeats
    assert any("another would not fit" in n for n in bench.settings["time_limit_notes"])


@pytest.mark.skipif(sys.platform == "win32", reason="SIGALRM is POSIX")
def test_the_command_ends_inside_its_time_limit_with_the_repeats_that_fit(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fasttrain", "bench", "--steps", "30", "--warmup", "2", "--repeats", "100000",
         "--peers", "bare,fasttrain-eager", "--time-limit", "30", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # counted from the process's start; what is left is writing the results and exiting
    assert elapsed < 30 + 10, elapsed
    data = json.loads((out / "mlp-tiny.json").read_text())
    completed = data["completed_repeats"]
    assert 1 <= completed < 100000 and data["settings"]["time_limit"] == 30
    for peer in data["peers"]:
        assert peer["status"] == "ok" and len(peer["step_times"]) + peer["invalid_repeats"] == completed
    notes = data["settings"]["time_limit_notes"]
    assert notes and notes[0].startswith("--time-limit 30 s:") and "(asked 30, 2, 100000)" in notes[0]
    assert notes[0] in proc.stdout and notes[0] in (out / "mlp-tiny.md").read_text()
