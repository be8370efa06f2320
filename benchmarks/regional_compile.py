"""First-step compile time: regional compilation vs whole-model compile on a 12-block transformer.

    OMP_NUM_THREADS=1 python benchmarks/regional_compile.py [--blocks 12] [--out FILE]

Each variant runs in its own process with its own, empty Inductor cache, so neither profits from
the other's compiled kernels. A step is forward + backward + SGD step; the first step includes
compilation, the second shows the steady state. The losses of the first three steps must match
(fp32, 1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, blocks: int = 12, dim: int = 64, features: int = 16):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=(1, 2))


def _run_variant(variant: str, blocks: int) -> dict:
    from fasttrain.regional import compile_regions

    torch.manual_seed(0)
    model = TinyTransformer(blocks)
    data = [(torch.randn(4, 8, 16), torch.randn(4)) for _ in range(3)]
    if variant == "whole":
        forward = torch.compile(model)
    elif variant == "regional":
        compile_regions(model)
        forward = model
    else:
        forward = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times, losses = [], []
    for x, y in data:
        start = time.perf_counter()
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    from torch._dynamo.utils import compile_times, counters

    # where the first step's time went: seconds per compile phase, summed over its calls
    table = dict(line.rsplit(", ", 1) for line in compile_times(repr="str", aggregate=True).splitlines()
                 if ", " in line)
    phases = {name: round(float(table[name]), 2) for name in table
              if name in ("_compile.compile_inner", "create_aot_dispatcher_function", "compile_fx_inner",
                          "compile_fx.<locals>.bw_compiler", "GraphLowering.compile_to_module",
                          "OutputGraph.call_user_compiler")}
    return {"variant": variant, "step_s": times, "losses": losses, "phases_s": phases,
            "graphs": counters["stats"]["unique_graphs"]}


def _in_fresh_process(variant: str, blocks: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--blocks", str(blocks)],
            env=env, check=True, capture_output=True, text=True,
        ).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.strip().splitlines()[-1])
    # CPU seconds of the whole process (start-up, compile workers it waited for, 3 steps): on a
    # shared machine wall time also counts other people's work, CPU time does not
    result["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--variant", choices=["eager", "whole", "regional"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write a markdown result here")
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(_run_variant(args.variant, args.blocks)))
        return
    results = {v: _in_fresh_process(v, args.blocks) for v in ("eager", "whole", "regional")}
    whole, regional = results["whole"], results["regional"]
    ratio = whole["step_s"][0] / regional["step_s"][0]
    cpu_ratio = (whole["process_cpu_s"] - results["eager"]["process_cpu_s"]) / (
        regional["process_cpu_s"] - results["eager"]["process_cpu_s"])
    same = max(abs(a - b) for a, b in zip(whole["losses"], regional["losses"]))
    lines = [
        f"# Regional vs whole-model compile, {args.blocks}-block transformer (CPU)",
        "",
        f"- command: `OMP_NUM_THREADS=1 python benchmarks/regional_compile.py --blocks {args.blocks}`",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        "- each variant in a fresh process with an empty Inductor cache; step = forward + backward + SGD",
        "",
        "| variant | first step (s) | second step (s) | process CPU (s) | graphs | losses (3 steps) | compile phases (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in ("eager", "whole", "regional"):
        r = results[v]
        lines.append(f"| {v} | {r['step_s'][0]:.2f} | {r['step_s'][1]:.4f} | {r['process_cpu_s']:.1f} | {r['graphs']} | "
                     f"{', '.join(f'{l:.7f}' for l in r['losses'])} | {r['phases_s']} |")
    lines += ["", f"First-step ratio whole / regional: **{ratio:.2f}x** wall, **{cpu_ratio:.2f}x** in CPU time "
              "beyond the eager process's; "
              f"largest loss difference whole vs regional: {same:.2e}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
