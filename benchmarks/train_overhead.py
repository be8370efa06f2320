"""Whole ``train()`` calls against a bare PyTorch loop over the same steps, side by side.

Unlike ``fasttrain bench``, which subtracts two calls to cancel per-call costs, this times whole
calls, set-up included: what a user waits for when calling ``train()`` for a few hundred steps.
The workload is the bench's overhead-bound MLP (tiny, batch 64, AdamW) with fasttrain's default
callbacks. Calls alternate (bare, fasttrain, bare, ...) so machine noise hits both alike; the
clock is process CPU time with one thread, which ignores time spent descheduled on a shared
host. Prints per-repeat ratios (bare time / fasttrain time; above 1 means fasttrain is faster)
and their min / median / max.

    OMP_NUM_THREADS=1 python benchmarks/train_overhead.py --steps 800 --repeats 15
    OMP_NUM_THREADS=1 python benchmarks/train_overhead.py --profile   # cProfile of one call
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time

import torch

from fasttrain.bench.peers import BareLoop, FasttrainPeer
from fasttrain.bench.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--engine", default="eager")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="process CPU time (ignores time descheduled on a shared host) or wall time")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one fasttrain call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = make_workload("mlp", device="cpu")
    workload.resize(args.steps)
    bare = BareLoop(workload)
    fast = type("Peer", (FasttrainPeer,), {"engine": args.engine})(workload)
    for peer in (bare, fast):
        peer.setup()
        peer.run(args.steps)  # warm-up: first-call costs (imports, allocator growth)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        fast.run(args.steps)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
        return
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    ratios, bare_s, fast_s = [], [], []
    for _ in range(args.repeats):
        times = []
        for peer in (bare, fast):
            gc.collect()
            t0 = clock()
            peer.run(args.steps)
            times.append(clock() - t0)
        bare_s.append(times[0])
        fast_s.append(times[1])
        ratios.append(times[0] / times[1])
    print(f"{args.steps} steps, {args.repeats} interleaved repeats, engine={args.engine}, {args.clock} clock")
    print(f"bare loop      s/call: median {statistics.median(bare_s):.3f} [{min(bare_s):.3f}-{max(bare_s):.3f}]")
    print(f"fasttrain      s/call: median {statistics.median(fast_s):.3f} [{min(fast_s):.3f}-{max(fast_s):.3f}]")
    print(f"x bare (per repeat):   median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
