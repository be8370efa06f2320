"""The host's work per step around a CUDA-graph replay, measured on the CPU.

On a GPU whose step is short (a small model, a small batch), a graphed step costs the host what
the trainer does around the replay: the replay guards, the batch copied into the graph's
buffers, the learning rate written, the loss ring, the callbacks, the loop. That is what decides
whether ``fasttrain.lightning`` keeps up with fasttrain's own Trainer on the graphed engine, and
it can be measured without a GPU: this script runs the graphed engine's own logic on the CPU with
a replay that does nothing (``FreeReplayEngine``; the capture runs the step once, as a warm-up
does), so each step's time is the host work alone.

The workload is the bench's ``overhead`` one (Linear 16-32-4, batch 16, fused AdamW, whole batches
from one ``__getitems__`` call); peers are the bench's. ``fasttrain-lightning`` is fitted on the
graphed engine as ``engine="auto"`` picks it on CUDA. Repeats are interleaved, the clock is the
process's CPU time, one thread.

    OMP_NUM_THREADS=1 python benchmarks/replay_overhead.py
    OMP_NUM_THREADS=1 python benchmarks/replay_overhead.py --peers fasttrain-cudagraph,fasttrain-lightning --steps 2000 --repeats 7

Each timed run is a new ``train()`` or ``fit()``, whose first few steps warm up and capture
again on the compiled path (a few microseconds a step over a repeat of 2000). The weights these
runs end with mean nothing (no replay updates them); the ratios are what the run is for:
``x first`` is the first peer's time per step over each peer's, per repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from typing import Dict, List

import torch

import fasttrain.engine as engines
from fasttrain.engine.cudagraph import CudaGraphEngine


#: the peers that run the graphed engine here (fasttrain-lightning's "auto" picks it, as on CUDA)
GRAPHED_PEERS = ("fasttrain-cudagraph", "fasttrain-lightning")


#: at most this many steps of a run warm up and capture before its steps replay
WARMUP_STEPS_PER_RUN = 10


class FreeGraph:
    """A captured step whose replay does nothing: what is left of a step is the host's work."""

    def __init__(self):
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class FreeReplayEngine(CudaGraphEngine):
    """The graphed engine on the CPU: its decisions, guards, buffers and rings as on a device;
    no stream, no memory pool, and replays that cost nothing."""

    graphs: List[FreeGraph] = []

    def _device_reason(self):
        return None

    def _create_stream_and_pool(self, device):
        self._stream = self._pool = None

    def _long_lived_allocations(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _on_side_stream(self):
        yield

    def _return_cached_memory(self) -> None:
        pass

    def _new_pool(self) -> None:
        self._pool = len(FreeReplayEngine.graphs) + 1

    def _record(self, body):
        graph = FreeGraph()
        FreeReplayEngine.graphs.append(graph)
        return graph, body()


@contextlib.contextmanager
def graphed_engine_on_the_cpu():
    """``engine="cudagraph"`` (and ``"auto"``) build a :class:`FreeReplayEngine` while inside."""
    saved_engine, saved_auto = engines.ENGINES["cudagraph"], engines.auto_engine_name
    engines.ENGINES["cudagraph"] = FreeReplayEngine
    engines.auto_engine_name = lambda device: "cudagraph"
    try:
        yield
    finally:
        engines.ENGINES["cudagraph"], engines.auto_engine_name = saved_engine, saved_auto


def measure(peer_names: List[str], steps: int, repeats: int, warmup: int = 100) -> Dict[str, List[float]]:
    """Microseconds of process CPU time per step, per repeat, for each peer (interleaved)."""
    from fasttrain.bench.peers import PEERS
    from fasttrain.bench.workloads import make_workload

    workload = make_workload("overhead", device="cpu")
    workload.resize(max(steps, warmup))
    times: Dict[str, List[float]] = {name: [] for name in peer_names}
    with graphed_engine_on_the_cpu():
        peers = {name: PEERS[name](workload) for name in peer_names}
        quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        with quiet[0], quiet[1]:
            for peer in peers.values():
                peer.setup()
                peer.run(warmup)  # compiles and captures
            replays_before = sum(graph.replays for graph in FreeReplayEngine.graphs)
            for _ in range(repeats):
                for name, peer in peers.items():
                    start = time.process_time()
                    peer.run(steps)
                    times[name].append((time.process_time() - start) / steps * 1e6)
        replays = sum(graph.replays for graph in FreeReplayEngine.graphs) - replays_before
        for peer in peers.values():
            peer.close()
    # each run is a new train() or fit(): its first steps warm up and capture again (compiled
    # steps, a few per run), the rest replay
    graphed = [name for name in peer_names if name in GRAPHED_PEERS]
    timed = len(graphed) * repeats * steps
    if graphed and replays < timed - len(graphed) * repeats * WARMUP_STEPS_PER_RUN:
        raise RuntimeError(
            f"only {replays} of {timed} timed steps replayed a graph: a fasttrain peer left the "
            "graphed engine, so its time is not the host's work around a replay"
        )
    return times


def report(times: Dict[str, List[float]]) -> str:
    names = list(times)
    first = names[0]
    lines = [f"| peer | host us/step | x {first} |", "| --- | --- | --- |"]
    for name in names:
        ratios = [a / b for a, b in zip(times[first], times[name])]
        us = times[name]
        lines.append(
            f"| {name} | {statistics.median(us):.1f} [{min(us):.1f}-{max(us):.1f}] | "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="fasttrain-cudagraph,fasttrain-lightning",
                        help="the bench's peer names, comma-separated; ratios are against the first")
    parser.add_argument("--steps", type=int, default=2000, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    times = measure([name.strip() for name in args.peers.split(",") if name.strip()], args.steps, args.repeats)
    print(f"torch {torch.__version__}, {args.repeats} interleaved repeats of {args.steps} steps, process CPU "
          "time, one thread; graph replays cost nothing (median [min-max])")
    print(report(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
