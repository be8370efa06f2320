"""benchmarks/host_profile.py: a bench peer's host time per step, by function."""

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import host_profile as H  # noqa: E402


def test_a_step_costs_what_the_long_call_spent_beyond_the_short_one():
    short = {("a.py", 1, "f"): (8, 0.008, 0.010), ("~", 0, "<built-in method x>"): (3, 0.003, 0.003)}
    long = {("a.py", 1, "f"): (108, 0.108, 0.210), ("~", 0, "<built-in method x>"): (3, 0.003, 0.003),
            ("b.py", 2, "g"): (50, 0.050, 0.050)}
    rows = H.per_step(short, long, 100)
    assert rows[("a.py", 1, "f")] == pytest.approx((1.0, 1000.0, 2000.0))  # calls, own and with callees µs
    assert rows[("~", 0, "<built-in method x>")] == (0.0, 0.0, 0.0)  # the fixed costs cancel
    assert rows[("b.py", 2, "g")] == pytest.approx((0.5, 500.0, 500.0))
    lines = H.table(rows, 1)
    assert lines[2] == "| `f (a.py:1)` | 1.00 | 1000.0 | 2000.0 |" and len(lines) == 4  # x's zero row left out


def test_cpu_run_reports_each_peers_steady_step(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert H.main(["--device", "cpu", "--workload", "overhead", "--peers", "bare,fasttrain-eager",
                       "--steps", "30", "--warmup", "4", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "host_profile.md").read_text()
    assert "run(34) minus run(4), over 30 steps" in text
    bare, fasttrain = text.split("### bare")[1].split("### fasttrain-eager")
    for section in (bare, fasttrain):
        plain, profiled = map(float, re.search(r"([\d.]+) µs per step unprofiled, ([\d.]+) µs profiled", section).groups())
        assert plain > 0 and profiled > 0
        # one backward per step, in every peer
        assert re.search(r"\| `<method 'run_backward' of 'torch._C._EngineBase' objects>` \| 1\.00 \|", section)
    assert "| `train_epoch (fasttrain/loops.py:" in fasttrain and "fasttrain/loops.py" not in bare


def test_free_replays_profile_the_host_work_around_a_graphed_step(tmp_path):
    """On the CPU the graphed engine's replays can cost nothing (replay_overhead.py): what is left
    of a step is the host's work around the replay, here fasttrain-cudagraph's, which replays a
    graph at every profiled step and so runs no backward of its own there."""
    threads = torch.get_num_threads()
    try:
        assert H.main(["--device", "cpu", "--free-replays", "--workload", "overhead", "--peers",
                       "fasttrain-cudagraph", "--steps", "40", "--warmup", "20", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "host_profile.md").read_text()
    assert "replays cost nothing here" in text
    section = text.split("### fasttrain-cudagraph")[1]
    assert re.search(r"\| `_replay \(fasttrain/engine/cudagraph.py:\d+\)` \| 1\.00 \|", section)
    # no backward per step (a call's warm-up runs some, the same in the short and the long call)
    backward = re.search(r"run_backward' of 'torch._C._EngineBase' objects>` \| ([\d.]+) \|", section)
    assert backward is None or float(backward.group(1)) < 0.5


def test_free_replays_are_refused_off_the_cpu(capsys):
    with pytest.raises(SystemExit):
        H.main(["--device", "cuda", "--free-replays"])
    assert "--free-replays stands in for the graphed engine's replays on the CPU" in capsys.readouterr().err
