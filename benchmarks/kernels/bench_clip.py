"""Fused gradient clipping against torch's foreach path: device time, bytes moved, copy bandwidth.

    python benchmarks/kernels/bench_clip.py --out bench_out/run      # on a GPU
    python benchmarks/kernels/bench_clip.py --device cpu --tiny      # correctness run (CI)

Two gradient sets: GPT-2 124M's (148 tensors, 124.4M elements) in fp32 and in bf16, and 2,000
small tensors (fp32, 1.4M elements) where launch count, not bandwidth, decides.

Device time: each call is captured in a CUDA graph and replayed (``triton.testing.do_bench_cudagraph``),
so the figure is the GPU's work alone. A plain timed call also pays Python: argument checks,
the chunk-table lookup, launches, about 100 microseconds, more than the whole kernel on small
sets; that cost is reported apart, as ``host+device`` (``triton.testing.do_bench``: CUDA events
around each call, L2 flushed between calls). Bandwidth = bytes each implementation must move /
device time, against the bandwidth of a copy of the same elements measured the same way: a Triton
kernel with the fused kernels' launch plan (``copy_baseline.py``), captured and replayed as they
are, counted as read + write (2N). torch's ``copy_`` is shown beside it: a ``cudaMemcpyAsync``, not
a kernel, which on the first H200 run measured 2.77 TB/s where the kernels read at 4.2 TB/s.

Bytes per call, N = gradient bytes:
- norm clip, clipping (scale != 1): fused 3N (read for the norm; read + write to scale); torch
  foreach 3N.
- norm clip, no clipping (scale == 1): fused N (the scale pass returns at once); torch 3N.
- value clip, steady state (nothing left to clamp): fused N; torch foreach 4N (clamp_min_ then
  clamp_max_, each reads and writes).

The clipping case uses ``max_norm = -1`` on gradients of norm 1: the scale is about -1 on every
call, so no call can find a scale of exactly 1 and skip its writes, and the norm stays near 1
however many times a call is repeated. torch accepts a negative max_norm too: both do the same work.

On the CPU (``--device cpu``) it checks the fused results against torch's and times the host
calls; no bandwidth claims are made from that.
"""
import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

GPT2 = dict(vocab=50257, ctx=1024, dim=768, layers=12)
GPT2_TINY = dict(vocab=512, ctx=64, dim=32, layers=2)
#: (count, shapes cycled through): 2,000 tensors of 256 to 2,048 elements
SMALL = (2000, [(256,), (512,), (32, 32), (2048,)])
SMALL_TINY = (50, SMALL[1])

#: targets of the clipping case: fused / torch foreach device time, and share of copy bandwidth
TARGET_SPEEDUP_GPT2 = 1.5
TARGET_SPEEDUP_SMALL = 3.0
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


def small_shapes(count, cycle):
    return [cycle[i % len(cycle)] for i in range(count)]


def driver_version():
    from fasttrain.bench.hardware import describe_environment

    return describe_environment("cuda").get("driver") or "unknown"


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


class CudaTimer:
    """Device time from CUDA-graph replays; host+device time from plainly timed calls."""

    def __init__(self, warmup_ms, rep_ms):
        from triton.testing import do_bench, do_bench_cudagraph

        self._bench, self._graph = do_bench, do_bench_cudagraph
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

        #: figures that could not be taken from graph replays, and why
        self.notes = []

    def device_ms(self, fn, label=""):
        # do_bench_cudagraph captures on a side stream; run once first so lazily built state
        # (the chunk table, workspaces) exists before capture
        fn()
        torch.cuda.synchronize()
        try:
            return self._graph(fn, rep=self.rep_ms, return_mode="median")
        except RuntimeError as error:  # a call that cannot be captured is still timed, and said so
            self.notes.append(f"{label}: not capturable ({str(error).splitlines()[0]}); device ms is host+device")
            return self.host_ms(fn)

    def host_ms(self, fn):
        return self._bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")


class HostTimer:
    """CPU mode: host time of each call (the device time is the same thing there)."""

    def __init__(self, repeats=5):
        self.repeats = repeats
        self.notes = []

    def host_ms(self, fn, label=""):
        fn()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    device_ms = host_ms


def measure(grad_sets, timer, device, after_set=None):
    """Rows ``(set, case, dtype, impl, device ms, host ms, bytes, speedup vs torch)`` and the copy
    bandwidth (bytes/s) per gradient set and dtype. ``after_set(rows, copy_bw, done)``, when
    given, is called after each gradient set with what was measured so far."""
    import copy_baseline

    import fasttrain.kernels as K

    rows, copy_bw = [], {}
    for set_name, shapes, dtype_name, value_clip in grad_sets:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        numel = sum(torch.Size(s).numel() for s in shapes)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        key = (set_name, dtype_name)

        # the baseline: a Triton copy of the same elements with the kernels' launch plan, timed
        # as they are; torch's copy_ (a cudaMemcpy, not a kernel) is shown beside it
        src = torch.randn(numel, device=device).to(dtype)
        dst = torch.empty_like(src)
        t_copy = timer.device_ms(lambda: copy_baseline.copy(dst, src), "copy")
        if not torch.equal(dst, src):
            raise AssertionError(f"{set_name} {dtype_name}: the baseline copy did not copy")
        copy_bw[key] = 2 * nbytes / (t_copy * 1e-3)
        mib = f"{nbytes / 2**20:.1f} MiB"
        rows.append((set_name, f"copy ({mib}), the kernels' launch plan", dtype_name, "triton", t_copy, None, 2 * nbytes, None))
        t_memcpy = timer.device_ms(lambda: dst.copy_(src), "copy_")
        rows.append((set_name, f"copy_ ({mib})", dtype_name, "torch", t_memcpy, None, 2 * nbytes, None))
        del src, dst

        grads, params = make_grads(shapes, dtype, device)
        check_correct(K.clip_grad_norm_, K.clip_grad_norm_reference, grads, 0.5)
        cases = [("norm clip, clipping", -1.0, 3, 3), ("norm clip, no clipping", 1e30, 1, 3)]
        for label, max_norm, fused_passes, torch_passes in cases:
            fused = lambda: K.clip_grad_norm_(grads, max_norm)  # noqa: E731
            reference = lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)  # noqa: E731
            t_fused = timer.device_ms(fused, f"{set_name} {dtype_name} fused")
            t_torch = timer.device_ms(reference, f"{set_name} {dtype_name} torch")
            h_fused, h_torch = timer.host_ms(fused), timer.host_ms(reference)
            rows.append((set_name, label, dtype_name, "fused", t_fused, h_fused, fused_passes * nbytes, t_torch / t_fused))
            rows.append((set_name, label, dtype_name, "torch foreach", t_torch, h_torch, torch_passes * nbytes, 1.0))

        if value_clip:
            K.clip_grad_value_(grads, 1e-4)  # reach the steady state: nothing left to clamp
            fused = lambda: K.clip_grad_value_(grads, 1e-4)  # noqa: E731
            reference = lambda: torch.nn.utils.clip_grad_value_(params, 1e-4, foreach=True)  # noqa: E731
            t_fused = timer.device_ms(fused, f"{set_name} {dtype_name} fused")
            t_torch = timer.device_ms(reference, f"{set_name} {dtype_name} torch")
            rows.append((set_name, "value clip, steady", dtype_name, "fused", t_fused, timer.host_ms(fused), nbytes, t_torch / t_fused))
            rows.append((set_name, "value clip, steady", dtype_name, "torch foreach", t_torch, timer.host_ms(reference), 4 * nbytes, 1.0))
        del grads, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if after_set is not None:
            after_set(rows, copy_bw, len(copy_bw))
    return rows, copy_bw


def verdicts(rows, copy_bw):
    """One line per clipping case with its targets; ``met`` False when any target is missed."""
    lines, met = [], True
    for set_name, label, dtype_name, impl, ms, _host, moved, speedup in rows:
        if label != "norm clip, clipping" or impl != "fused":
            continue
        frac = moved / (ms * 1e-3) / copy_bw[(set_name, dtype_name)]
        if set_name.startswith("gpt2"):
            ok = speedup >= TARGET_SPEEDUP_GPT2 and frac >= TARGET_BW_FRACTION
            lines.append(
                f"- {set_name} {dtype_name}: {speedup:.2f}x torch foreach (target >= {TARGET_SPEEDUP_GPT2}x), "
                f"{100 * frac:.0f}% of copy bandwidth (target >= {100 * TARGET_BW_FRACTION:.0f}%): "
                f"{'met' if ok else 'NOT met'}"
            )
        else:
            ok = speedup >= TARGET_SPEEDUP_SMALL
            lines.append(
                f"- {set_name} {dtype_name}: {speedup:.2f}x torch foreach (target >= {TARGET_SPEEDUP_SMALL}x): "
                f"{'met' if ok else 'NOT met'}"
            )
        met = met and ok
    return lines, met


def render(rows, copy_bw, device, header):
    lines = [
        "# Fused gradient clipping vs torch foreach",
        "",
        *header,
        "",
        "| gradients | case | dtype | impl | device ms | host+device ms | MB moved | GB/s | % of copy BW | x torch (device) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for set_name, label, dtype_name, impl, ms, host, moved, speedup in rows:
        bw = moved / (ms * 1e-3)
        frac = bw / copy_bw[(set_name, dtype_name)]
        lines.append(
            f"| {set_name} | {label} | {dtype_name} | {impl} | {ms:.4f} | {'' if host is None else f'{host:.4f}'} | "
            f"{moved / 1e6:.1f} | {bw / 1e9:.0f} | {100 * frac:.0f}% | {'' if speedup is None else f'{speedup:.2f}x'} |"
        )
    if device.type == "cuda":
        found, _ = verdicts(rows, copy_bw)
        lines += ["", "Targets (clipping case, device time):", *found]
    else:
        lines += ["", "CPU run: correctness and host time only; device figures need a GPU run."]
    lines += ["", "MB moved counts what each implementation must read and write (see the script's docstring).", ""]
    return "\n".join(lines)


def header_lines(device, tiny):
    import triton

    sizes = "tiny sizes (a check, not a measurement)" if tiny else "GPT-2 124M (148 tensors, 124.4M elements); 2,000 small tensors"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"- GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver_version()}"
        method = "- device ms: median of CUDA-graph replays (triton do_bench_cudagraph); host+device ms: median of timed calls (do_bench, L2 flushed)"
    else:
        where = f"- CPU: {platform.processor() or platform.machine()}"
        method = "- host time of each call (median of 5); the CPU run checks results, it measures nothing for the GPU"
    return [
        where,
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, Python {platform.python_version()}",
        f"- {sizes}",
        method,
        f"- date {date}",
    ]


def grad_sets(tiny, dtypes):
    gpt = gpt2_grad_shapes(**(GPT2_TINY if tiny else GPT2))
    count, cycle = SMALL_TINY if tiny else SMALL
    sets = [("gpt2-124m" if not tiny else "gpt2-tiny", gpt, d, True) for d in dtypes]
    sets.append((f"{count} small", small_shapes(count, cycle), "fp32", False))
    return sets


def kernel_bench_parser(name: str, doc: str, tiny_help: str) -> argparse.ArgumentParser:
    """The options every kernel benchmark takes: --device, --out (for ``<name>.md``), --tiny,
    --warmup and --rep."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=None, help=f"folder for {name}.md (default: print only)")
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time in ms")
    parser.add_argument("--rep", type=int, default=100, help="measurement time per figure in ms")
    return parser


def kernel_bench_setup(parser, args, name: str):
    """The device, the timer for it, and fasttrain.kernels, after refusing what cannot be timed."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; use --device cpu for the correctness run")
    import fasttrain.kernels as K

    if not K.triton_available():
        sys.exit(f"{name}: triton is not installed; install it to time the fused kernels")
    if device.type == "cuda" and K.triton_interpreted():
        sys.exit(f"{name}: TRITON_INTERPRET is set; unset it to time the compiled kernels")
    timer = CudaTimer(args.warmup, args.rep) if device.type == "cuda" else HostTimer()
    return device, timer, K


def write_report(report: str, out, name: str) -> None:
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(report)


def main(argv=None):
    parser = kernel_bench_parser("bench_clip", __doc__, "small gradient sets (CI)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--enforce-targets", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    device, timer, _ = kernel_bench_setup(parser, args, "bench_clip")
    sets = grad_sets(args.tiny, args.dtypes)

    def report(rows, copy_bw, *extra):
        header = header_lines(device, args.tiny) + [f"- note: {n}" for n in timer.notes] + list(extra)
        return render(rows, copy_bw, device, header)

    def partial_report(rows, copy_bw, done):
        # written after each set: a run its time limit stops keeps the sets it finished
        if args.out is not None and done < len(sets):
            args.out.mkdir(parents=True, exist_ok=True)
            partial = f"- partial: {done} of {len(sets)} gradient sets measured so far"
            (args.out / "bench_clip.md").write_text(report(rows, copy_bw, partial))

    rows, copy_bw = measure(sets, timer, device, after_set=partial_report)
    write_report(report(rows, copy_bw), args.out, "bench_clip")
    _, met = verdicts(rows, copy_bw)
    return 1 if (args.enforce_targets and device.type == "cuda" and not met) else 0


if __name__ == "__main__":
    sys.exit(main())
