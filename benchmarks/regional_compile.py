"""First-step compile time: regional compilation vs whole-model compile on a 12-block transformer.

    OMP_NUM_THREADS=1 python benchmarks/regional_compile.py [--blocks 12] [--model gpt2|mha] [--out FILE]

Variants: ``eager`` (no compile, the baseline process cost), ``whole`` (``torch.compile(model)``),
``whole-cpp-wrapper`` (the same with Inductor's C++ wrapper), ``regional``
(``compile_regions(model)``, blocks compiled, the rest eager: ``engine="eager"``; on the CPU its
blocks use the C++ wrapper), ``regional-python-wrapper`` (the same with the Python wrapper) and
``whole+regions`` (``compile_regions(model)`` then ``torch.compile(model)``: the whole-model trace
breaks at each block, which runs its own compiled graph, as under ``engine="compiled"``).

Each variant runs in its own process with its own, empty Inductor cache, so none profits from
another's compiled kernels, and with ``TORCHINDUCTOR_COMPILE_THREADS=1``, so that every C++
compile runs in a child the measured process waits for (a compile worker pool's CPU time would
not be counted). A step is forward + backward + SGD step; the first step includes compilation.
The losses of the first three steps must match (fp32, 1e-6).
"""

from __future__ import annotations

import argparse
import glob
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

VARIANTS = ("eager", "whole", "whole-cpp-wrapper", "regional", "regional-python-wrapper", "whole+regions")


class Block(nn.Module):
    """GPT-2 block: pre-norm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.ln2(x))


class MHABlock(nn.Module):
    """The earlier benchmark block (no causal mask): pre-norm nn.MultiheadAttention and an MLP."""

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
    """Token embedding + learned positions, ``blocks`` blocks, final LayerNorm, LM head."""

    def __init__(self, blocks: int = 12, dim: int = 64, vocab: int = 128, seq: int = 32, block=Block):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(block(dim) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _run_variant(variant: str, blocks: int, model_name: str) -> dict:
    from fasttrain.regional import compile_regions, cpp_wrapper_options

    torch.manual_seed(0)
    model = TinyTransformer(blocks, block=Block if model_name == "gpt2" else MHABlock)
    data = [torch.randint(0, 128, (4, 33)) for _ in range(3)]
    forward = model
    if variant in ("regional", "whole+regions"):
        compile_regions(model)
    if variant == "regional-python-wrapper":
        compile_regions(model, options={"cpp_wrapper": False})
    if variant in ("whole", "whole+regions"):
        forward = torch.compile(model)
    if variant == "whole-cpp-wrapper":
        forward = torch.compile(model, options=cpp_wrapper_options())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(tokens):
        logits = forward(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    times, losses = [], []
    for tokens in data:
        start = time.perf_counter()
        loss = step(tokens)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    # after the compile: the steady step, median of five 10-step windows (its CPU time is taken
    # out of the process's, which measures the compile)
    cpu_before = time.process_time()
    windows = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            step(data[0])
        windows.append((time.perf_counter() - start) / 10)
    steady_cpu_s = time.process_time() - cpu_before
    from torch._dynamo.utils import compile_times, counters

    # where the first step's time went: seconds per compile phase, summed over its calls
    table = dict(line.rsplit(", ", 1) for line in compile_times(repr="str", aggregate=True).splitlines()
                 if ", " in line)
    phases = {name: round(float(table[name]), 2) for name in table
              if name in ("_compile.compile_inner", "create_aot_dispatcher_function",
                          "compile_fx.<locals>.bw_compiler", "GraphLowering.compile_to_module",
                          "compile_file")}
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"variant": variant, "step_s": times, "losses": losses, "phases_s": phases,
            "graphs": counters["stats"]["unique_graphs"],
            "steady_step_ms": sorted(windows)[2] * 1e3, "steady_cpu_s": steady_cpu_s,
            "own_cpu_s": own.ru_utime + own.ru_stime - steady_cpu_s}


def _warm_up_toolchain(cpp_wrapper: bool = False) -> None:
    """Compile one unrelated one-op function: Inductor probes the CPU's vector instruction sets
    (a few small C++ programs, kept in the Inductor cache) and builds its precompiled header
    (with ``cpp_wrapper``, also the C++ wrapper's)."""
    from fasttrain.regional import cpp_wrapper_options

    options = cpp_wrapper_options() if cpp_wrapper else None
    torch.compile(lambda x: (x + 1).sin(), options=options)(torch.ones(8))


def _child(args: list, env: dict) -> str:
    return subprocess.run([sys.executable, __file__, *args], env=env, check=True, capture_output=True,
                          text=True).stdout


def _in_fresh_process(variant: str, blocks: int, model_name: str, warm_toolchain: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        if warm_toolchain:
            _child(["--variant", "warm-up"], env)
        probes = set(glob.glob(os.path.join(cache, "**", "*.so"), recursive=True))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = _child(["--variant", variant, "--blocks", str(blocks), "--model", model_name], env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        # one shared object per C++ program Inductor compiled in this process: its kernels and,
        # in a cold cache, its instruction-set probes
        kernels = len(set(glob.glob(os.path.join(cache, "**", "*.so"), recursive=True)) - probes)
    result = json.loads(out.strip().splitlines()[-1])
    # CPU seconds of the whole process tree (start-up, the C++ compiler runs, 3 steps): on a
    # shared machine wall time also counts other people's work, CPU time does not
    result["process_cpu_s"] = ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                               - result["steady_cpu_s"])
    result["compiler_cpu_s"] = result["process_cpu_s"] - result["own_cpu_s"]
    result["kernels"] = kernels
    return result


def report(results: dict, blocks: int, model_name: str) -> str:
    eager = results["eager"]["process_cpu_s"]
    base = results["whole"]

    def cost(r):  # compile CPU time: the process's beyond the eager process's
        return r["process_cpu_s"] - eager

    lines = [
        "| variant | first step wall (s) | later step (ms) | process CPU (s) | compile CPU (s) | of which C++ compiler (s) "
        "| C++ kernels | graphs | ratio whole / variant (compile CPU) | losses (3 steps) | compile phases (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        r = results[v]
        ratio = f"{cost(base) / cost(r):.2f}x" if v != "eager" else ""
        lines.append(
            f"| {v} | {r['step_s'][0]:.2f} | {r['steady_step_ms']:.1f} | {r['process_cpu_s']:.1f} | {cost(r):.1f} | {r['compiler_cpu_s']:.1f} "
            f"| {r['kernels']} | {r['graphs']} | {ratio} | {', '.join(f'{l:.7f}' for l in r['losses'])} "
            f"| {r['phases_s']} |")
    worst = max(abs(a - b) for v in VARIANTS for a, b in zip(base["losses"], results[v]["losses"]))
    relative = max(abs(a - b) / abs(a) for v in VARIANTS for a, b in zip(base["losses"], results[v]["losses"]))
    lines += ["", f"Largest loss difference from whole-model compile: {worst:.2e} ({relative:.1e} relative)"]
    fastest_whole = min(cost(results["whole"]), cost(results["whole-cpp-wrapper"]))
    fastest_regional = min(cost(results["regional"]), cost(results["regional-python-wrapper"]))
    lines += [
        "",
        "Compile CPU time, whole-model over regional:",
        f"- each with its faster wrapper: {fastest_whole / fastest_regional:.2f}x",
        f"- both with the Python wrapper (Inductor's default): "
        f"{cost(results['whole']) / cost(results['regional-python-wrapper']):.2f}x",
        f"- both with the C++ wrapper: {cost(results['whole-cpp-wrapper']) / cost(results['regional']):.2f}x",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--model", choices=["gpt2", "mha"], default="gpt2",
                        help="gpt2: causal GPT-2 blocks (default); mha: the earlier nn.MultiheadAttention block")
    parser.add_argument("--warm-toolchain", action="store_true",
                        help="before each variant, let Inductor probe the CPU's instruction sets in its "
                             "(still kernel-free) cache, as any earlier compile on the machine has done")
    parser.add_argument("--variant", choices=VARIANTS + ("warm-up", "warm-up-cpp-wrapper"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="append the markdown result here")
    args = parser.parse_args(argv)
    if args.variant in ("warm-up", "warm-up-cpp-wrapper"):
        _warm_up_toolchain(cpp_wrapper=args.variant == "warm-up-cpp-wrapper")
        return
    if args.variant:
        print(json.dumps(_run_variant(args.variant, args.blocks, args.model)))
        return
    # the precompiled headers live outside TORCHINDUCTOR_CACHE_DIR (under $TMPDIR), shared by
    # every process: build them now (the kernels' and the C++ wrapper's) so that no variant pays
    # for them and the order does not matter
    for warm_up in ("warm-up", "warm-up-cpp-wrapper"):
        with tempfile.TemporaryDirectory() as cache:
            _child(["--variant", warm_up], dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache))
    results = {v: _in_fresh_process(v, args.blocks, args.model, args.warm_toolchain) for v in VARIANTS}
    warm = " --warm-toolchain" if args.warm_toolchain else ""
    cache = ("Inductor cache holding only the instruction-set probes" if args.warm_toolchain
             else "empty Inductor cache")
    text = (
        f"## {args.blocks}-block transformer, {args.model} blocks, {cache} (CPU)\n\n"
        f"- command: `OMP_NUM_THREADS=1 python benchmarks/regional_compile.py --blocks {args.blocks} "
        f"--model {args.model}{warm}`\n"
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"torch {torch.__version__}, Python {platform.python_version()}\n\n"
        + report(results, args.blocks, args.model)
    )
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
