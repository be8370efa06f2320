"""Instructions per training step of one `fasttrain bench` peer on the overhead workload, counted
by callgrind rather than timed, so that a shared machine's noise does not move the figure.

    python3 benchmarks/instructions_per_step.py fasttrain-eager

runs the peer under ``valgrind --tool=callgrind`` twice (a 100-step and a 600-step run after the
same 50-step warm-up) and prints the difference over 500: what one more step costs, the per-run
work (imports, set-up) cancelled. Needs valgrind; takes about two minutes a peer.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def run_peer(name: str, steps: int) -> None:
    import torch

    from fasttrain.bench.peers import make_peer
    from fasttrain.bench.runner import quiet
    from fasttrain.bench.workloads import make_workload

    torch.set_num_threads(1)
    workload = make_workload("overhead", device="cpu")
    workload.resize(steps + 50)
    with quiet():
        peer = make_peer(name, workload)
        peer.setup()
        peer.run(50)
        peer.run(steps)


def count(name: str, steps: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--run", name, str(steps)],
            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, check=True,
        )
    collected = re.findall(r"Collected : (\d+)", result.stderr)
    if not collected:
        raise RuntimeError(f"callgrind printed no total:\n{result.stderr[-2000:]}")
    return int(collected[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        run_peer(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peers", nargs="+", help="fasttrain bench peer names (bare, fasttrain-eager, ...)")
    args = parser.parse_args()
    for name in args.peers:
        per_step = (count(name, 600) - count(name, 100)) / 500
        print(f"{name}: {per_step / 1000:,.0f}k instructions per step")


if __name__ == "__main__":
    main()
