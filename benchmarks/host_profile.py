"""Where a bench peer's host time goes, per step: Python's profiler over the peer's training calls.

On a GPU whose graphed step takes microseconds, a step costs what its Python costs: the loop, the
hooks, the logging, moving the batch. This runs each peer of ``fasttrain bench`` as the bench
does (set-up, then ``run(W)`` to compile and capture) and profiles ``run(W)`` and ``run(W + N)``:
their difference, over N, is what one steady step costs, each training call's fixed costs (a
Lightning peer fits again in every call: set-up, warm-up, capture) cancelled. Also timed without
the profiler, the same way, since profiling slows Python calls.

    python3 benchmarks/host_profile.py --device cuda --workload mlp --size small --batch-size 64 \\
        --peers fasttrain-cudagraph,fasttrain-lightning --out FOLDER

Writes ``FOLDER/host_profile.md``: per peer, microseconds per step (unprofiled and profiled), the
functions that take the most of a step by their own time, and the fasttrain and Lightning
functions by their time with what they call.

``--free-replays`` (CPU only) runs the graphed engine's own logic with replays that do nothing
(``benchmarks/replay_overhead.py``), as ``engine="auto"`` picks it on CUDA: what is left of a
replayed step is the host's work around the replay, by function, without a GPU::

    OMP_NUM_THREADS=1 python3 benchmarks/host_profile.py --device cpu --free-replays --workload overhead \
        --peers fasttrain-cudagraph,fasttrain-lightning --steps 2000 --warmup 20
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

#: functions listed per table
TOP = 25


def _stats(profile: cProfile.Profile) -> Dict[tuple, Tuple[int, float, float]]:
    """``(file, line, function)``: ``(calls, own seconds, cumulative seconds)``."""
    return {key: (nc, tt, ct) for key, (_cc, nc, tt, ct, _callers) in pstats.Stats(profile).stats.items()}


def per_step(short: dict, long: dict, steps: int) -> Dict[tuple, Tuple[float, float, float]]:
    """What ``run(W + N)`` spent beyond ``run(W)``, over N: calls, own microseconds and cumulative
    microseconds per step, per function."""
    out = {}
    for key in long.keys() | short.keys():
        nc, tt, ct = long.get(key, (0, 0.0, 0.0))
        nc0, tt0, ct0 = short.get(key, (0, 0.0, 0.0))
        out[key] = ((nc - nc0) / steps, (tt - tt0) * 1e6 / steps, (ct - ct0) * 1e6 / steps)
    return out


def _where(key: tuple) -> str:
    filename, line, name = key
    if filename == "~":  # a C function
        return name
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep, "lib" + os.sep + "python"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    else:
        filename = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return f"{name} ({filename}:{line})"


def _ours(key: tuple) -> bool:
    path = key[0].replace(os.sep, "/")
    return "/fasttrain/" in path or "/lightning/" in path


def table(rows: Dict[tuple, Tuple[float, float, float]], by: int, keep=lambda key: True) -> List[str]:
    chosen = sorted((k for k in rows if keep(k) and rows[k][by] > 0), key=lambda k: -rows[k][by])[:TOP]
    lines = ["| function | calls/step | own µs/step | with callees µs/step |", "|---|---:|---:|---:|"]
    for key in chosen:
        calls, own, cumulative = rows[key]
        lines.append(f"| `{_where(key)}` | {calls:.2f} | {own:.1f} | {cumulative:.1f} |")
    return lines


def _timed(peer, steps: int) -> float:
    start = time.perf_counter()
    peer.run(steps)  # ends with the bench's device sync
    return time.perf_counter() - start


def profile_peer(peer, warmup: int, steps: int) -> Tuple[float, float, Dict[tuple, Tuple[float, float, float]]]:
    """``(unprofiled µs/step, profiled µs/step, per-function costs per step)`` of a set-up peer."""
    peer.run(warmup)  # compile, capture: what a first call pays
    peer.run(warmup + steps)  # and what only a longer call reaches first (an epoch's end, a last batch)
    plain = (_timed(peer, warmup + steps) - _timed(peer, warmup)) * 1e6 / steps
    return (plain, *profiled_steps(peer, warmup, steps))


def profiled_steps(peer, warmup: int, steps: int) -> Tuple[float, Dict[tuple, Tuple[float, float, float]]]:
    """``(profiled µs/step, per-function costs per step)``: Python's profiler over ``run(W)`` and
    ``run(W + N)`` of a warmed-up peer, the difference over N."""
    profiles = []
    for n in (warmup, warmup + steps):
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        try:
            peer.run(n)
        finally:
            profile.disable()
        profiles.append((time.perf_counter() - start, _stats(profile)))
    (t_short, short), (t_long, long) = profiles
    return (t_long - t_short) * 1e6 / steps, per_step(short, long, steps)


def report(results: List[Tuple[str, Optional[str], float, float, dict]], header: List[str]) -> str:
    lines = ["# Host time per step, by function (benchmarks/host_profile.py)", "", *header, ""]
    for name, failure, plain, profiled, rows in results:
        lines += [f"### {name}", ""]
        if failure is not None:
            lines += [f"not profiled: {failure}", ""]
            continue
        lines += [f"{plain:.1f} µs per step unprofiled, {profiled:.1f} µs profiled (the profiler slows each Python call).",
                  "", "By own time:", "", *table(rows, 1), "",
                  "fasttrain's and Lightning's functions, by time with what they call:", "", *table(rows, 2, _ours), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from fasttrain.bench.peers import PEERS, PeerUnavailable
    from fasttrain.bench.runner import quiet
    from fasttrain.bench.workloads import make_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--size", default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--peers", default="fasttrain-cudagraph,fasttrain-lightning",
                        help="comma-separated bench peers (fasttrain bench --help lists them)")
    parser.add_argument("--steps", type=int, default=300, help="steps profiled beyond the warm-up call's")
    parser.add_argument("--warmup", type=int, default=8, help="steps of the short call and of each call's warm-up")
    parser.add_argument("--out", default=None, help="folder for host_profile.md (default: print only)")
    parser.add_argument("--free-replays", action="store_true",
                        help="CPU only: the graphed engine with replays that cost nothing (replay_overhead.py)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if args.free_replays and args.device != "cpu":
        parser.error("--free-replays stands in for the graphed engine's replays on the CPU; use --device cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; use --device cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)
    workload = make_workload(args.workload, size=args.size, device=args.device, batch_size=args.batch_size,
                             precision=args.precision)
    workload.resize(args.warmup + args.steps)
    results = []
    engines = contextlib.nullcontext()
    if args.free_replays:
        from replay_overhead import graphed_engine_on_the_cpu

        engines = graphed_engine_on_the_cpu()
    with engines:
        for name in names:
            peer = PEERS[name](workload)
            try:
                with quiet():  # the peers' progress bars and prints, as the bench silences them
                    peer.setup()
                    measured = profile_peer(peer, args.warmup, args.steps)
                results.append((name, None, *measured))
            except PeerUnavailable as exc:
                results.append((name, str(exc), 0.0, 0.0, {}))
            finally:
                peer.close()
    header = [f"- {args.workload} {workload.size}, batch {workload.batch_size}, on {args.device}, "
              f"torch {torch.__version__}; each peer: run({args.warmup + args.steps}) minus run({args.warmup}), "
              f"over {args.steps} steps"]
    if args.free_replays:
        header.append("- the graphed engine's replays cost nothing here (benchmarks/replay_overhead.py): a "
                      "replayed step's time is the host's work around the replay")
    text = report(results, header)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.md"), "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
