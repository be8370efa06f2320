"""fasttrain's step engines against hand-written loops and pytorch-accelerated, on one GPU.

    python benchmarks/gpu_engines.py            # both workloads, all peers
    python benchmarks/gpu_engines.py --workloads mlp --steps 400 --repeats 7

Two workloads, each run side by side by every peer in one process (``fasttrain.bench``: same
seeded weights, same synthetic batches, interleaved timed repeats, steady state as the difference
of a short and a long training call, so setup, compilation and capture cancel out):

* ``mlp``: the overhead-bound case. A 3-layer MLP (256 wide) at batch 64 in fp32: each step is a
  few microseconds of GPU work, so what a step costs is Python, kernel launches and host syncs.
* ``gpt``: GPT-2 124M (12 layers, 768 wide, 1024 tokens, 50257 vocabulary) in bf16 on synthetic
  tokens at batch 8: compute-bound, where compiled kernels matter and launch overhead does not.

Peers: ``bare`` (a hand-written eager loop, the floor of eager overhead), ``pytorch-accelerated``
(when installed), ``compiled`` (a hand-written ``torch.compile`` loop), ``cudagraph`` (a
hand-written whole-step CUDA graph), and fasttrain's ``eager``, ``compiled`` and ``cudagraph``
engines with their default callbacks.

Prints one table per workload (steps/s, ratios, MFU) and the targets below, and writes
``benchmarks/results/<date>-<gpu>-engines.md`` with the GPU's name and the torch and triton
versions. Targets: on the MLP, fasttrain's graphed engine >= 1.5x the bare loop, >= 3x
pytorch-accelerated and within 5% of the hand-written graph loop; on the transformer >= 1.0x the
hand-written compiled loop.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from typing import Dict, List, Optional

import torch

from fasttrain.bench.hardware import describe_environment, peak_flops
from fasttrain.bench.report import summarize
from fasttrain.bench.runner import run_benchmark
from fasttrain.bench.workloads import make_workload

PEERS = [
    "bare",
    "pytorch-accelerated",
    "compiled",
    "cudagraph",
    "fasttrain-eager",
    "fasttrain-compiled",
    "fasttrain-cudagraph",
]

WORKLOADS = {
    "mlp": dict(name="mlp", size="small", batch_size=64, precision="fp32"),
    "gpt": dict(name="gpt", size="124m", batch_size=8, precision="bf16"),
}

#: (workload, peer, reference peer, minimum ratio of steps/s)
TARGETS = [
    ("mlp", "fasttrain-cudagraph", "bare", 1.5),
    ("mlp", "fasttrain-cudagraph", "pytorch-accelerated", 3.0),
    ("mlp", "fasttrain-cudagraph", "cudagraph", 0.95),
    ("gpt", "fasttrain-cudagraph", "compiled", 1.0),
    ("gpt", "fasttrain-compiled", "compiled", 1.0),
]

DEFAULT_STEPS = {"mlp": 500, "gpt": 30}
DEFAULT_WARMUP = {"mlp": 50, "gpt": 10}


def _fmt(value, spec=".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def _rate(row) -> Optional[float]:
    return row.get("steps_per_s_median") if row.get("status") == "ok" else None


def run_workload(key: str, steps: int, warmup: int, repeats: int, progress: bool) -> Dict[str, object]:
    spec = WORKLOADS[key]
    workload = make_workload(spec["name"], size=spec["size"], device="cuda", batch_size=spec["batch_size"], precision=spec["precision"])
    bench = run_benchmark(workload, PEERS, steps=steps, warmup=warmup, repeats=repeats, progress=progress)
    rows = summarize(bench, peak_flops(workload.device, spec["precision"]))
    return {"key": key, "bench": bench, "rows": {row["peer"]: row for row in rows}}


def ratio(rows: Dict[str, dict], peer: str, reference: str) -> Optional[float]:
    a, b = _rate(rows.get(peer, {})), _rate(rows.get(reference, {}))
    return a / b if a and b else None


def table(result: Dict[str, object]) -> List[str]:
    rows: Dict[str, dict] = result["rows"]
    lines = [
        "| peer | steps/s (median, min-max) | ms/step | x bare | x pt-acc | x hand compile | x hand graph | MFU | host syncs/step | recompiles | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for peer in PEERS:
        row = rows.get(peer)
        if row is None:
            continue
        if row["status"] != "ok":
            lines.append(f"| {peer} | {row['status']}: {row.get('reason') or ''} | | | | | | | | | |")
            continue
        mfu = row.get("mfu")
        lines.append(
            f"| {peer} | {_fmt(row['steps_per_s_median'], '.1f')} ({_fmt(row['steps_per_s_min'], '.1f')}-"
            f"{_fmt(row['steps_per_s_max'], '.1f')}) | {_fmt(row['ms_per_step_median'], '.3f')} | "
            f"{_fmt(ratio(rows, peer, 'bare'), '.2f')} | {_fmt(ratio(rows, peer, 'pytorch-accelerated'), '.2f')} | "
            f"{_fmt(ratio(rows, peer, 'compiled'), '.2f')} | {_fmt(ratio(rows, peer, 'cudagraph'), '.2f')} | "
            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {_fmt(row.get('host_syncs_per_step'), '.2f')} | "
            f"{row.get('recompiles_after_warmup')} | {row.get('notes') or ''} |"
        )
    return lines


def target_lines(results: Dict[str, Dict[str, object]]) -> List[str]:
    lines = ["| workload | peer | against | target | measured | met |", "|---|---|---|---|---|---|"]
    for key, peer, reference, minimum in TARGETS:
        if key not in results:
            continue
        measured = ratio(results[key]["rows"], peer, reference)
        met = "n/a" if measured is None else ("yes" if measured >= minimum else "NO")
        lines.append(f"| {key} | {peer} | {reference} | >= {minimum:.2f}x | {_fmt(measured, '.2f')}x | {met} |")
    return lines


def report(results: Dict[str, Dict[str, object]], env: Dict[str, object], settings: Dict[str, object]) -> str:
    out = [
        f"# Step engines on {env.get('device_name')}",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- GPU: {env.get('device_name')} (driver {env.get('driver')}, CUDA {env.get('cuda')})",
        f"- torch {env.get('torch')}, triton {env.get('triton')}, accelerate {env.get('accelerate')}, "
        f"fasttrain {env.get('fasttrain')}, pytorch-accelerated {env.get('pytorch-accelerated')}",
        f"- settings: {settings}",
        "- method: `fasttrain.bench` (interleaved repeats; steady state = difference of a short and a "
        "long training call, so setup, compilation and capture cancel). Ratios divide medians of "
        "this run. MFU uses the data-sheet dense peak of the GPU for the workload's precision.",
        "",
    ]
    for key, result in results.items():
        spec = WORKLOADS[key]
        out += [f"## {key}: {spec['size']}, batch {spec['batch_size']}, {spec['precision']}", ""]
        out += table(result) + [""]
    out += ["## Targets", ""] + target_lines(results) + [""]
    return "\n".join(out)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,gpt", help="comma-separated: mlp, gpt")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default per workload)")
    parser.add_argument("--warmup", type=int, default=None, help="steps in the short run (default per workload)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_engines.py needs a CUDA GPU; nothing measured.", file=sys.stderr)
        return 2
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    results = {}
    settings = {"repeats": args.repeats}
    for key in keys:
        steps = args.steps or DEFAULT_STEPS[key]
        warmup = args.warmup or DEFAULT_WARMUP[key]
        settings[key] = {"steps": steps, "warmup": warmup}
        results[key] = run_workload(key, steps, warmup, args.repeats, progress=not args.no_progress)
        print(f"\n{key}:")
        print("\n".join(table(results[key])))
    print("\ntargets:")
    print("\n".join(target_lines(results)))
    env = describe_environment("cuda")
    text = report(results, env, settings)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-{_slug(str(env.get('device_name')))}-engines.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
