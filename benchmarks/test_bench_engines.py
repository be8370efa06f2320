"""pytest-benchmark suites: training steps of every peer on the tiny workloads.

Run with ``python3 -m pytest benchmarks/ --benchmark-only`` (the default test run collects only
``tests/``). Each benchmark round is one training call of ``FASTTRAIN_BENCH_STEPS`` steps (32 by
default) after a warm-up call. A round includes what a training call pays once (a DataLoader
iterator, ``train()``'s setup, epoch-end work), which for a Trainer on a tiny model can exceed the
steps themselves. So each test also times one-step and full calls, interleaved, and records in
``extra_info`` ``ms_per_step`` = (fastest full call - fastest one-step call) / (steps - 1): the
time of one step inside a running loop, the quantity ``fasttrain bench`` compares, and
``ms_per_call_fixed``, what remains of the one-step call. Compare peers with ``fasttrain bench``;
use this suite to track one peer over time. On a shared CPU host, add
``--benchmark-timer time.process_time`` so the rounds ignore time spent descheduled.
"""

import os

import pytest
import torch

from fasttrain.bench.peers import PEERS, PeerUnavailable, make_peer
from fasttrain.bench.runner import CLOCKS, quiet
from fasttrain.bench.workloads import make_workload

STEPS = int(os.environ.get("FASTTRAIN_BENCH_STEPS", "32"))
ROUNDS = 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKLOADS = {
    "mlp": {"size": "tiny", "batch_size": 64},
    "convnet": {"size": "tiny", "batch_size": 64},
    "gpt": {"size": "tiny", "batch_size": 8},
    "hf-gpt2": {"size": "tiny", "batch_size": 8},
}


# Process CPU time on single-threaded CPU runs, as `fasttrain bench` does (see runner.CLOCKS):
# it ignores the time the process sits descheduled on a shared host.
CLOCK_NAME = "cpu" if DEVICE == "cpu" else "wall"


def _timed(peer, steps: int) -> float:
    clock = CLOCKS[CLOCK_NAME]
    t0 = clock()
    peer.run(steps)  # ends with a device sync, like every run
    return clock() - t0


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """One intra-op thread on the CPU, as ``fasttrain bench`` uses: small machines oversubscribe."""
    threads = torch.get_num_threads()
    if DEVICE == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("peer_name", list(PEERS))
@pytest.mark.parametrize("workload_name", list(WORKLOADS))
def test_train_steps(benchmark, workload_name, peer_name):
    workload = make_workload(workload_name, device=DEVICE, **WORKLOADS[workload_name])
    workload.resize(STEPS)
    peer = make_peer(peer_name, workload)
    try:
        with quiet():
            peer.setup()
            peer.run(STEPS)  # warm-up: compilation, graph capture, allocator growth
    except PeerUnavailable as exc:
        peer.close()
        pytest.skip(f"{peer_name}: {exc}")
    except Exception as exc:  # an engine not implemented yet is reported as a skip, like the CLI does
        peer.close()
        pytest.skip(f"{peer_name} unavailable: {type(exc).__name__}: {exc}")

    def one_call():
        with quiet():
            peer.run(STEPS)

    benchmark.group = f"{workload_name}-tiny on {DEVICE}, {STEPS} steps per round"
    benchmark.extra_info.update(steps_per_round=STEPS, items_per_step=workload.items_per_step, device=DEVICE)
    try:
        benchmark.pedantic(one_call, rounds=ROUNDS, warmup_rounds=1, iterations=1)
        if STEPS > 1:
            # One-step and full calls, interleaved, on the clock `fasttrain bench` would use;
            # minima, because on a shared host interference only ever adds time.
            short, full = [], []
            with quiet():
                for _ in range(ROUNDS):
                    short.append(_timed(peer, 1))
                    full.append(_timed(peer, STEPS))
            per_step = (min(full) - min(short)) / (STEPS - 1)
            benchmark.extra_info.update(
                ms_per_step=round(per_step * 1000.0, 4),
                ms_per_call_fixed=round((min(short) - per_step) * 1000.0, 4),
                clock=CLOCK_NAME,
            )
    finally:
        peer.close()
