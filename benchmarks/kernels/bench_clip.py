"""Fused gradient clipping vs torch's foreach path on the gradients of GPT-2 124M.

    python benchmarks/kernels/bench_clip.py --out benchmarks/results/

Builds one gradient tensor per GPT-2 124M parameter (148 tensors, 124.4M elements) in fp32 and
bf16, times each variant with ``triton.testing.do_bench`` (median, L2 flushed between runs) and
reports achieved bandwidth = (bytes read + bytes written) / time next to the bandwidth of a plain
device ``copy_`` of the same size, timed the same way. Writes a markdown table (GPU, driver,
torch, triton) to ``--out`` and prints it. Needs a CUDA device.

Traffic per call, N = gradient bytes:
- norm clip, clipping (scale != 1): fused 3N (read, read + write); torch foreach 3N.
- norm clip, no clipping (scale == 1): fused N (the scale pass returns at once); torch 3N
  (it multiplies by 1).
- value clip, steady state (nothing left to clamp): fused N (stores only changed elements);
  torch foreach 4N (clamp_min_ then clamp_max_, each reads and writes).

The clipping case uses ``max_norm = -1`` on gradients of norm 1: the scale is about -1 on every
call, so no call can find a scale of exactly 1 and skip its writes, and the norm stays near 1
however many times do_bench repeats the call. torch accepts a negative max_norm too, so both
sides do the same work.
"""
import argparse
import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

GPT2 = dict(vocab=50257, ctx=1024, dim=768, layers=12)
TARGET_SPEEDUP = 2.0
DEVICE = "cuda"
TARGET_BW_FRACTION = 0.80


def gpt2_grad_shapes(vocab, ctx, dim, layers):
    shapes = [(vocab, dim), (ctx, dim)]  # wte, wpe
    for _ in range(layers):
        shapes += [(dim,), (dim,)]  # ln_1
        shapes += [(dim, 3 * dim), (3 * dim,)]  # attn.c_attn
        shapes += [(dim, dim), (dim,)]  # attn.c_proj
        shapes += [(dim,), (dim,)]  # ln_2
        shapes += [(dim, 4 * dim), (4 * dim,)]  # mlp.c_fc
        shapes += [(4 * dim, dim), (dim,)]  # mlp.c_proj
    shapes += [(dim,), (dim,)]  # ln_f
    return shapes


def driver_version():
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # nvidia-ml-py missing or NVML unavailable: ask nvidia-smi instead
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            )
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
        except Exception:
            return "unknown"


def make_grads(shapes, dtype, device):
    """Gradients and parameters holding them; values scaled so the global norm is about 1."""
    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(torch.Size(s).numel() for s in shapes)
    grads = [torch.randn(s, generator=gen, device=device).mul_(total ** -0.5).to(dtype) for s in shapes]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append(p)
    return grads, params


def check_correct(fused, reference, grads, max_norm):
    """Fused vs reference on copies, so the timed kernel is known to give the right answer."""
    a = [g.clone() for g in grads]
    b = [g.clone() for g in grads]
    torch.testing.assert_close(fused(a, max_norm), reference(b, max_norm), rtol=1e-5, atol=1e-6)
    rtol = 1e-5 if grads[0].dtype == torch.float32 else 8e-3
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=1e-6)


def run(args):
    import triton
    from triton.testing import do_bench

    import fasttrain.kernels as K

    if K.triton_interpreted():
        sys.exit("bench_clip: TRITON_INTERPRET is set; unset it to time the compiled kernels")

    device = torch.device(DEVICE)
    bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731
    shapes = gpt2_grad_shapes(**GPT2)
    numel = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    copy_bw = {}
    for dtype_name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()

        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        src.random_(0, 255)
        t_copy = bench(lambda: dst.copy_(src))
        copy_bw[dtype_name] = 2 * nbytes / (t_copy * 1e-3)
        del src, dst
        rows.append((f"copy_ ({nbytes / 2**20:.0f} MiB)", dtype_name, "torch", t_copy, 2 * nbytes, None))

        grads, params = make_grads(shapes, dtype, device)
        check_correct(K.clip_grad_norm_, K.clip_grad_norm_reference, grads, 0.5)
        cases = [
            ("norm clip, clipping", -1.0, 3, 3),
            ("norm clip, no clipping", 1e30, 1, 3),
        ]
        for label, max_norm, fused_passes, torch_passes in cases:
            t_fused = bench(lambda: K.clip_grad_norm_(grads, max_norm))
            t_torch = bench(lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
            rows.append((label, dtype_name, "fused", t_fused, fused_passes * nbytes, t_torch / t_fused))
            rows.append((label, dtype_name, "torch foreach", t_torch, torch_passes * nbytes, 1.0))

        K.clip_grad_value_(grads, 1e-4)  # reach the steady state: nothing left to clamp
        t_fused = bench(lambda: K.clip_grad_value_(grads, 1e-4))
        t_torch = bench(lambda: torch.nn.utils.clip_grad_value_(params, 1e-4, foreach=True))
        rows.append(("value clip, steady", dtype_name, "fused", t_fused, nbytes, t_torch / t_fused))
        rows.append(("value clip, steady", dtype_name, "torch foreach", t_torch, 4 * nbytes, 1.0))
        del grads, params
        torch.cuda.empty_cache()

    return render(rows, copy_bw, numel, len(shapes), triton.__version__)


def render(rows, copy_bw, numel, ntensors, triton_version):
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# Fused gradient clipping vs torch foreach (GPT-2 124M gradients)",
        "",
        f"- GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver_version()}",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, "
        f"Python {platform.python_version()}",
        f"- {ntensors} tensors, {numel / 1e6:.1f}M elements; median of triton.testing.do_bench "
        "(L2 flushed between runs)",
        f"- date {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "| case | dtype | impl | median ms | GB moved | GB/s | % of copy BW | speedup vs torch |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for label, dtype_name, impl, ms, moved, speedup in rows:
        bw = moved / (ms * 1e-3)
        frac = bw / copy_bw[dtype_name]
        lines.append(
            f"| {label} | {dtype_name} | {impl} | {ms:.3f} | {moved / 1e9:.2f} | {bw / 1e9:.0f} | "
            f"{100 * frac:.0f}% | {'' if speedup is None else f'{speedup:.2f}x'} |"
        )
        if label == "norm clip, clipping" and impl == "fused":
            verdicts.append(
                f"- {dtype_name} fused norm clip: {speedup:.2f}x torch foreach "
                f"(target >= {TARGET_SPEEDUP:.0f}x: {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}), "
                f"{100 * frac:.0f}% of copy bandwidth "
                f"(target >= {100 * TARGET_BW_FRACTION:.0f}%: {'met' if frac >= TARGET_BW_FRACTION else 'NOT met'})"
            )
    lines += ["", "Targets (clipping case):", *verdicts, ""]
    lines += [
        "GB moved counts the bytes each implementation must read and write (see the script's "
        "docstring); the fused value clip also writes the few elements it changes, not counted.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the markdown report")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time in ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench measurement time in ms")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_clip: no CUDA device found; this benchmark times GPU kernels, run it on a GPU machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench_clip: triton is not installed; install it to time the fused kernels")
    report = run(args)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(0)).strip("-").lower()
    path = args.out / f"bench_clip_{slug}_{datetime.date.today().isoformat()}.md"
    path.write_text(report)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
