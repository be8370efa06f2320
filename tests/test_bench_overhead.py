"""`fasttrain bench --workload overhead`: the host-overhead workload, how every peer is fed, and a
short run of it on the CPU clock (benchmarks/README.md, "The overhead workload")."""

import json
import os
import sys

import pytest
import torch

from fasttrain.bench.peers import make_peer
from fasttrain.bench.runner import quiet
from fasttrain.bench.workloads import (
    MLP,
    SyntheticBatches,
    default_batch_size,
    make_workload,
    passthrough_collate,
)
from fasttrain.cli import _SCHEDULES, main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import host_profile  # noqa: E402

# every peer that runs on a CPU without compiling (the compiled ones are fed by the same loaders)
CPU_PEERS = ["bare", "pytorch-accelerated", "fasttrain-eager", "lightning", "fasttrain-lightning"]


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    """The trainers initialise accelerate's process-wide state; clear it for later tests."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def test_the_model_is_linear_16_32_4_at_batch_16_on_either_device():
    for device in ("cpu", "cuda"):
        assert default_batch_size("overhead", device) == 16
    assert ("overhead", "cpu") in _SCHEDULES and ("overhead", "cuda") in _SCHEDULES
    wl = make_workload("overhead", device="cpu")
    model = wl.make_model()
    assert isinstance(model, MLP)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(16, 32), (32, 4)]
    assert wl.describe()["params"] == 16 * 32 + 32 + 32 * 4 + 4
    assert wl.batch_size == 16 and wl.collate_fn is passthrough_collate
    # a whole batch is one slice of the pool: a view, not a gather
    x, y = wl.dataset.__getitems__(list(range(16)))
    assert x.shape == (16, 16) and y.shape == (16,) and x._base is wl.dataset.inputs
    assert int(y.max()) < 4


def test_the_overhead_workload_steps_with_fused_adamw_and_the_others_with_torchs_default():
    overhead, mlp = make_workload("overhead", device="cpu"), make_workload("mlp", device="cpu")
    optimizer = overhead.make_optimizer(overhead.make_model())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert overhead.make_optimizer(overhead.make_model(), capturable=True).defaults["capturable"] is True
    assert overhead.describe()["optimizer"] == "AdamW(fused=True)"
    plain = mlp.make_optimizer(mlp.make_model())
    assert not plain.defaults["fused"] and mlp.describe()["optimizer"] == "AdamW"


def test_the_language_models_step_with_fused_adamw_on_cuda_only(monkeypatch):
    # the workload is built without a GPU: only pinning the batches needs one
    monkeypatch.setattr("fasttrain.bench.workloads._pinned", lambda t, device: t)
    on_cuda = make_workload("gpt", size="tiny", device="cuda")
    assert on_cuda.optimizer_options == {"fused": True}
    assert on_cuda.describe()["optimizer"] == "AdamW(fused=True)"
    on_cpu = make_workload("gpt", size="tiny", device="cpu")
    assert on_cpu.optimizer_options == {} and on_cpu.describe()["optimizer"] == "AdamW"
    assert make_workload("mlp", device="cuda").optimizer_options == {}


def test_every_peer_fetches_a_batch_with_one_getitems_call(monkeypatch):
    calls = {"batches": 0, "samples": 0}
    items, item = SyntheticBatches.__getitems__, SyntheticBatches.__getitem__

    def batches(self, indices):
        calls["batches"] += 1
        return items(self, indices)

    def sample(self, index):
        calls["samples"] += 1
        return item(self, index)

    monkeypatch.setattr(SyntheticBatches, "__getitems__", batches)
    monkeypatch.setattr(SyntheticBatches, "__getitem__", sample)
    wl = make_workload("overhead", device="cpu")
    wl.resize(8)
    for name in CPU_PEERS:
        peer = make_peer(name, wl)
        with quiet():
            peer.setup()
            calls.update(batches=0, samples=0)
            peer.run(5)
        peer.close()
        # accelerate's loader (pytorch-accelerated) looks one batch ahead to find the last one
        assert calls["samples"] == 0, name
        assert calls["batches"] in (5, 6), (name, calls)


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    threads = torch.get_num_threads()
    try:
        rc = main([
            "bench", "--workload", "overhead", "--device", "cpu", "--steps", "30", "--warmup", "2",
            "--repeats", "2", "--peers", ",".join(CPU_PEERS), "--out", str(out), "--no-progress",
        ])
    finally:
        torch.set_num_threads(threads)
    return rc, out


def test_a_short_run_times_every_peer_on_the_process_cpu_clock(overhead_run):
    rc, out = overhead_run
    assert rc == 0
    data = json.loads((out / "overhead-tiny.json").read_text())
    assert data["workload"]["workload"] == "overhead" and data["workload"]["batch_size"] == 16
    assert data["settings"]["clock"] == "cpu" and data["settings"]["threads"] == 1
    peers = {p["name"]: p for p in data["peers"]}
    assert list(peers) == CPU_PEERS
    for name in CPU_PEERS:
        assert peers[name]["status"] == "ok", (name, peers[name]["reason"])
        assert len(peers[name]["step_times"]) + peers[name]["invalid_repeats"] == 2
    # no host read inside a step: 30 steps hold no flush (every 50 updates), the epoch-end one
    # cancels in the difference of the two runs
    for name in ("bare", "fasttrain-eager", "fasttrain-lightning"):
        assert peers[name]["host_syncs_per_step"] == 0, (name, peers[name]["sync_sites"])
    assert peers["fasttrain-eager"]["engine"] == "eager"
    # pytorch-accelerated reads its loss with .item() every step
    assert peers["pytorch-accelerated"]["sync_methods"]["item"] == 1


def test_the_table_pairs_fasttrain_lightning_with_lightning_and_fasttrain_eager(overhead_run):
    _, out = overhead_run
    text = (out / "overhead-tiny.md").read_text()
    data = json.loads((out / "overhead-tiny.json").read_text())
    times = {p["name"]: p["step_times"] for p in data["peers"]}
    for ref in ("lightning", "fasttrain-eager"):
        lines = [line for line in text.splitlines() if line.startswith(f"- fasttrain-lightning / {ref}: ")]
        if not (times["fasttrain-lightning"] and times[ref]):
            # a peer whose every repeat timed negative on this short run (noise larger than its
            # steps; counted as invalid repeats) has no throughput to pair
            assert lines == []
            continue
        assert len(lines) == 1
        ratios = sorted(b / p for p, b in zip(times["fasttrain-lightning"], times[ref]))
        if len(ratios) == 2:  # both repeats valid: the median of two is their mean
            assert lines[0].endswith(f"{sum(ratios) / 2:.2f} [{ratios[0]:.2f}-{ratios[1]:.2f}]"), lines[0]


def python_calls_per_step(peer) -> float:
    """Python function calls per training step of a set-up ``peer``: the difference of a 120-step
    and a 20-step run over 100, so that what a run costs once cancels
    (benchmarks/host_profile.py). tqdm's clock stands still meanwhile: a progress bar redraws
    when 0.1 s have passed, so the count would otherwise grow with the machine's slowness (the
    profiled steps are slow, slower still on a busy machine), not with the work of a step; the
    bars' redraws asked for (new values shown) still count."""
    from unittest import mock

    import tqdm.std

    frozen = tqdm.std.time()
    with mock.patch.object(tqdm.std, "time", lambda: frozen):
        peer.run(5)
        _, rows = host_profile.profiled_steps(peer, 20, 100)
    return sum(calls for calls, _, _ in rows.values())


def test_fasttrains_eager_step_makes_no_more_python_calls_than_the_bare_loop():
    """The workload counted rather than timed: Python function calls per training step of
    fasttrain's Trainer, default callbacks and progress bar included, against the hand-written
    loop. The hooks, the loss kept for the flush and the bar cost about 16 calls a step; clearing
    gradients without torch's ``zero_grad`` wrapper (a dynamo-disabling frame and a profiler
    range, about 34 calls) more than pays for them. Before that, fasttrain made 16 more calls a
    step than the loop."""
    workload = make_workload("overhead", device="cpu")
    workload.resize(130)
    per_step = {}
    with quiet():
        for name in ("bare", "fasttrain-eager"):
            peer = make_peer(name, workload)
            peer.setup()
            per_step[name] = python_calls_per_step(peer)
            peer.close()
    assert per_step["bare"] > 100, per_step  # the counting sees the steps
    assert per_step["fasttrain-eager"] <= per_step["bare"], per_step


def test_the_instruction_counter_runs_a_peer_the_way_it_is_counted(monkeypatch):
    """benchmarks/instructions_per_step.py: what callgrind runs, run here without it (the count
    itself takes minutes a peer: benchmarks/README.md quotes it)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "instructions_per_step.py"
    spec = importlib.util.spec_from_file_location("instructions_per_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran = []
    real = SyntheticBatches.__getitems__

    def counting(self, indices):
        ran.append(len(indices))
        return real(self, indices)

    monkeypatch.setattr(SyntheticBatches, "__getitems__", counting)
    module.run_peer("bare", 7)
    assert ran == [16] * (50 + 7)  # the warm-up's batches, then the counted ones
