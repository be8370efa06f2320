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
    OMP_NUM_THREADS=1 python benchmarks/replay_overhead.py --steps 1000 --per-run 20 --repeats 5

Each timed run is a new ``train()`` or ``fit()``, whose first few steps warm up and capture
again on the compiled path (a few microseconds a step over a repeat of 2000). The weights these
runs end with mean nothing (no replay updates them); the ratios are what the run is for:
``x first`` is the first peer's time per step over each peer's, per repeat.

``--per-run SHORT`` times runs of ``SHORT`` steps beside those of ``--steps`` and reports, per peer,
what a run costs besides its steps (the line through the two lengths' times): a ``fit()``'s own
work, the warm-up and capture each run repeats. A short timed run (the GPU bench's, cut to its
time limit) pays it over few steps.
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
    runs = measure_runs(peer_names, [steps], repeats, warmup)
    return {name: [ms * 1e3 / steps for ms in per_steps[steps]] for name, per_steps in runs.items()}


def measure_runs(
    peer_names: List[str], step_counts: List[int], repeats: int, warmup: int = 100
) -> Dict[str, Dict[int, List[float]]]:
    """Milliseconds of process CPU time per run of each length in ``step_counts``, per repeat,
    for each peer; repeats interleaved, and within a repeat each peer runs each length in turn."""
    from fasttrain.bench.peers import PEERS
    from fasttrain.bench.workloads import make_workload

    workload = make_workload("overhead", device="cpu")
    workload.resize(max(max(step_counts), warmup))
    times: Dict[str, Dict[int, List[float]]] = {name: {n: [] for n in step_counts} for name in peer_names}
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
                    for steps in step_counts:
                        start = time.process_time()
                        peer.run(steps)
                        times[name][steps].append((time.process_time() - start) * 1e3)
        replays = sum(graph.replays for graph in FreeReplayEngine.graphs) - replays_before
        for peer in peers.values():
            peer.close()
    # each run is a new train() or fit(): its first steps warm up and capture again (compiled
    # steps, a few per run), the rest replay
    graphed = [name for name in peer_names if name in GRAPHED_PEERS]
    runs = len(graphed) * repeats * len(step_counts)
    timed = len(graphed) * repeats * sum(step_counts)
    if graphed and replays < timed - runs * WARMUP_STEPS_PER_RUN:
        raise RuntimeError(
            f"only {replays} of {timed} timed steps replayed a graph: a fasttrain peer left the "
            "graphed engine, so its time is not the host's work around a replay"
        )
    return times


def report_runs(runs: Dict[str, Dict[int, List[float]]]) -> str:
    """Per peer, from runs of a short and a long length: the cost of a run besides its steps
    (set-up, a Lightning fit's own work, the warm-up and capture each run repeats) and the cost
    of a step, as the line through the two lengths' times of each repeat (median [min-max])."""
    names = list(runs)
    short, long = sorted(runs[names[0]])[:2]
    lines = [
        f"| peer | ms per run of {short} | ms per run of {long} | ms per run besides its steps | us per step |",
        "| --- | --- | --- | --- | --- |",
    ]

    def cell(values):
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    for name in names:
        pairs = list(zip(runs[name][short], runs[name][long]))
        per_step = [(b - a) / (long - short) for a, b in pairs]  # ms
        fixed = [a - slope * short for (a, _), slope in zip(pairs, per_step)]
        lines.append(
            f"| {name} | {cell(runs[name][short])} | {cell(runs[name][long])} | {cell(fixed)} | "
            f"{cell([ms * 1e3 for ms in per_step])} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--per-run", type=int, default=None, metavar="SHORT",
                        help="also time runs of SHORT steps beside those of --steps, and report each peer's "
                             "cost per run besides its steps (a fit's own work, the warm-up and capture)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = [name.strip() for name in args.peers.split(",") if name.strip()]
    if args.per_run is not None:
        if not 0 < args.per_run < args.steps:
            parser.error("--per-run takes a step count above 0 and below --steps")
        runs = measure_runs(names, [args.per_run, args.steps], args.repeats)
        print(f"torch {torch.__version__}, {args.repeats} interleaved repeats of runs of {args.per_run} and "
              f"{args.steps} steps, process CPU time, one thread; graph replays cost nothing (median [min-max])")
        print(report_runs(runs))
        return 0
    times = measure(names, args.steps, args.repeats)
    print(f"torch {torch.__version__}, {args.repeats} interleaved repeats of {args.steps} steps, process CPU "
          "time, one thread; graph replays cost nothing (median [min-max])")
    print(report(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
