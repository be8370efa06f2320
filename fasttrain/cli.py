"""The ``fasttrain`` command line.

``fasttrain bench`` trains one synthetic workload with every peer side by side and prints their
throughput as ratios to a bare PyTorch loop (method: fasttrain/bench/runner.py and
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from typing import List, Optional

from fasttrain._version import __version__

#: (steps, warmup, repeats) per workload and device type; chosen so that the default CPU run of
#: the mlp finishes within about a minute on two cores, and GPU runs fit in a few minutes.
_SCHEDULES = {
    ("mlp", "cpu"): (150, 10, 5),
    ("convnet", "cpu"): (8, 2, 3),
    ("gpt", "cpu"): (100, 10, 3),
    ("hf-gpt2", "cpu"): (100, 10, 3),
    ("overhead", "cpu"): (2000, 50, 9),
    ("mlp", "cuda"): (500, 50, 5),
    ("convnet", "cuda"): (100, 20, 5),
    ("gpt", "cuda"): (100, 20, 3),
    ("hf-gpt2", "cuda"): (100, 20, 3),
    ("overhead", "cuda"): (2000, 50, 7),
}
#: GPT-2 124M (either implementation) on CUDA
_GPT_124M_CUDA = (40, 10, 3)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default in ``--help``, unless the help text already gives it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from fasttrain.bench.peers import PEERS
    from fasttrain.bench.workloads import DEFAULT_BATCH, DEFAULT_BATCH_CPU, SIZES, WORKLOADS

    parser = argparse.ArgumentParser(prog="fasttrain", description="fasttrain command line tools")
    parser.add_argument("--version", action="version", version=f"fasttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser(
        "bench",
        help="measure training throughput of fasttrain and its peers side by side",
        description="Train a synthetic workload with every peer, interleaved, and report steps/s, "
        "ratios to a bare PyTorch loop, host syncs per step, recompiles, memory and MFU. Ctrl-C "
        "stops it and keeps the repeats that every peer completed.",
        formatter_class=_HelpFormatter,
    )
    b.set_defaults(subparser=b)
    b.add_argument("--workload", choices=WORKLOADS, default="mlp",
                   help="synthetic workload (hf-gpt2: transformers' GPT2LMHeadModel from a config, "
                   "needs pip install transformers)")
    sizes = sorted({s for table in SIZES.values() for s in table})
    b.add_argument("--size", choices=sizes, default=None,
                   help="model size (default: tiny for mlp, gpt and hf-gpt2 on the CPU, 124m for hf-gpt2 on "
                   "CUDA, small for convnet; 124m is for gpt and hf-gpt2 only)")
    batches = ", ".join(
        f"{w} {DEFAULT_BATCH_CPU[w]} (CPU) / {DEFAULT_BATCH[w]} (CUDA)" for w in WORKLOADS
    )
    b.add_argument("--batch-size", type=_positive_int, default=None,
                   help=f"per-step batch (default: {batches})")
    schedule = "; ".join(f"{w} {d}: {'/'.join(map(str, v))}" for (w, d), v in _SCHEDULES.items())
    b.add_argument("--steps", type=_positive_int, default=None,
                   help=f"measured steps per repeat (default per workload and device, as "
                   f"steps/warm-up/repeats: {schedule})")
    b.add_argument("--warmup", type=_positive_int, default=None,
                   help="steps run before the measured ones in every training call (default: see --steps)")
    b.add_argument("--repeats", type=_positive_int, default=None,
                   help="interleaved repeats per peer (default: see --steps)")
    b.add_argument("--time-limit", type=_positive_float, default=None, metavar="SECONDS",
                   help="end within SECONDS of the process's start: after the first peer's set-up the "
                   "repeats, then the steps and warm-up, are cut so the step work takes at most 40%% of "
                   "the time left (the rest is for compiling); a peer whose set-up does not fit is "
                   "skipped; only the repeats that fit run; the limit itself stops the run as Ctrl-C "
                   "does (fasttrain/bench/time_limit.py)")
    b.add_argument("--peers", default=None,
                   help=f"comma-separated subset of: {', '.join(PEERS)} (default: all; bare is always run)")
    b.add_argument("--out", default=None,
                   help="directory for JSON/CSV/Markdown/PNG (default: a new folder "
                   "bench_out/<workload>-<size>-<device>-<time> for every run)")
    b.add_argument("--force", action="store_true",
                   help="overwrite result files already in --out (otherwise the run refuses to start)")
    b.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    b.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default on CPU: 1, since intra-op threads oversubscribe small "
                   "machines and add noise; on CUDA: torch's default)")
    b.add_argument("--channels-last", action="store_true", help="channels_last memory format (convnet only)")
    b.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="autocast precision (default: bf16 for gpt on CUDA, fp32 otherwise)")
    b.add_argument("--peak-tflops", type=_positive_float, default=None,
                   help="device peak TFLOP/s for MFU (default: looked up for known GPUs)")
    b.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="what times a run: wall time, or process CPU time, which ignores time spent "
                   "descheduled on a shared host (default auto: cpu for single-threaded CPU runs, "
                   "wall otherwise)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--profile", action="store_true",
                   help="instead of comparing peers, profile fasttrain (--engine) on the workload: write a "
                        "Chrome trace under --out and print the top kernels and the host-side gap per step")
    b.add_argument("--engine", choices=("auto", "eager", "compiled", "cudagraph"), default="auto",
                   help="fasttrain engine for --profile (default: auto)")

    r = sub.add_parser(
        "readme",
        help="rewrite the README's benchmark tables from committed result files",
        description="Regenerate the tables between the '<!-- bench-table: FILE -->' and "
        "'<!-- /bench-table -->' markers of a Markdown file from the JSON result files they name, "
        "and the sections between '<!-- result-section: FILE#HEADING -->' and "
        "'<!-- /result-section -->' from the Markdown result files they name.",
        formatter_class=_HelpFormatter,
    )
    r.set_defaults(subparser=r)
    r.add_argument("--file", default="README.md", help="the Markdown file to rewrite")
    r.add_argument("--check", action="store_true",
                   help="change nothing; exit with status 1 when a table differs from its result file")
    return parser


def _out_dir(args, device: str, size: str) -> str:
    if args.out is not None:
        return args.out
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("bench_out", f"{args.workload}-{size}-{device}-{stamp}")


#: when the command started: ``--time-limit`` counts from here (set by :func:`main`)
_STARTED = time.monotonic()


def _estimate(first, warmup: int, steps: int, repeats: int, num_peers: int) -> Optional[str]:
    """A one-line estimate of the whole run from the first peer's set-up, or None for a short
    run. Set-up ran ``3 * warmup + steps`` steps; each repeat runs ``2 * warmup + steps``."""
    if first.setup_s is None:
        return None
    per_step = first.setup_s / (3 * warmup + steps)
    per_peer = first.setup_s + repeats * (2 * warmup + steps) * per_step
    total = per_peer * num_peers
    if total < 60:
        return None
    return (
        f"estimate: about {total / 60:.0f} min for {num_peers} peers (~{per_peer:.0f} s each, "
        f"from the {first.name} loop's {per_step * 1000:.0f} ms per step; compiling peers take "
        "longer); lower --batch-size, --steps or --repeats for a shorter run, Ctrl-C keeps what "
        "completed"
    )


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, command: str) -> int:
    import torch

    from fasttrain.bench.hardware import describe_environment, peak_flops
    from fasttrain.bench.peers import resolve_peers
    from fasttrain.bench.report import existing_reports, format_table, paired_lines, summarize, write_reports
    from fasttrain.bench.runner import run_benchmark
    from fasttrain.bench.workloads import SIZES, default_size, make_workload

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but CUDA is not available here; use --device cpu")
    size = args.size
    if size is not None and size not in SIZES[args.workload]:
        parser.error(f"--size {size} does not exist for --workload {args.workload}; "
                     f"choose one of {', '.join(SIZES[args.workload])}")
    if args.channels_last and args.workload != "convnet":
        parser.error("--channels-last applies to --workload convnet only")
    try:
        peer_names = resolve_peers(args.peers)
    except ValueError as exc:
        parser.error(f"--peers: {exc}")
    size = size or default_size(args.workload, device)
    out_dir = _out_dir(args, device, size)
    clash = existing_reports(out_dir, args.workload, size)
    if clash and not args.force:
        parser.error(f"{clash[0]} already exists; pass --force to overwrite it, or choose another "
                     "--out (leaving --out out writes every run to a new folder)")

    steps, warmup, repeats = _SCHEDULES[(args.workload, device)]
    if size == "124m" and device == "cuda":
        steps, warmup, repeats = _GPT_124M_CUDA
    steps, warmup, repeats = args.steps or steps, args.warmup or warmup, args.repeats or repeats

    threads = args.threads or (1 if device == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)

    clock = args.clock
    if clock == "auto":
        clock = "cpu" if device == "cpu" and torch.get_num_threads() == 1 else "wall"
    elif clock == "cpu" and device != "cpu":
        parser.error("--clock cpu cannot see GPU work; use --clock wall (the default) on CUDA")

    workload = make_workload(
        args.workload, size=size, device=device, batch_size=args.batch_size,
        channels_last=args.channels_last, precision=args.precision,
    )
    if args.profile:
        from fasttrain.bench.profile import run_profile

        print(run_profile(workload, out_dir, engine=args.engine, warmup=args.warmup or 3, steps=args.steps or 5))
        return 0
    precision = "bf16" if workload.amp_dtype is not None else "fp32"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, precision)
    environment = describe_environment(device)
    settings = {"threads": torch.get_num_threads(), "peak_flops": peak, "command": command}
    estimated = []

    def on_setup(result, warmup, steps, repeats, num_peers):
        if not estimated:
            estimated.append(True)
            line = _estimate(result, warmup, steps, repeats, num_peers)
            if line:
                print(line, file=sys.stderr, flush=True)

    time_limit = None
    if args.time_limit is not None:
        from fasttrain.bench.time_limit import TimeLimit

        time_limit = TimeLimit(args.time_limit, start=_STARTED)
    bench = run_benchmark(
        workload, peer_names, steps=steps, warmup=warmup, repeats=repeats,
        progress=not args.no_progress, settings=settings, clock=clock, on_setup=on_setup,
        time_limit=time_limit,
    )
    rows = summarize(bench, peak_flops=peak)
    print(f"device: {environment['device_name']} · torch {environment['torch']} · "
          f"{settings['threads']} thread(s)")
    print(format_table(bench, rows))
    for line in paired_lines(bench):
        print(line)
    paths = write_reports(bench, out_dir, rows, environment)
    print("wrote " + ", ".join(paths[k] for k in sorted(paths)))
    if "png" not in paths and not _has_matplotlib():
        print("no chart: matplotlib is not installed; pip install 'fasttrain[plot]' to get a PNG")
    if bench.interrupted:
        stopped_by = bench.settings.get("stopped_by")
        print(f"interrupted ({stopped_by}): kept the {bench.completed_repeats} repeat(s) every peer "
              "completed; the repeat in progress was discarded")
        if stopped_by == "time limit":
            return 0 if bench.completed_repeats else 1
        # the shell's status for a run ended by the signal: 130 for SIGINT, 143 for SIGTERM
        return 143 if stopped_by == "SIGTERM" else 130
    if time_limit is not None and not bench.completed_repeats:
        return 1
    return 0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _readme(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fasttrain.bench.readme import ReadmeTableError, rewrite_tables

    try:
        changed = rewrite_tables(args.file, check=args.check)
    except (OSError, ReadmeTableError) as exc:
        parser.error(str(exc))
    if args.check:
        if changed:
            print(f"{args.file}: tables out of date with {', '.join(changed)}; run fasttrain readme")
            return 1
        print(f"{args.file}: tables match their result files")
        return 0
    print(f"{args.file}: rewrote tables from {', '.join(changed)}" if changed else f"{args.file}: up to date")
    return 0


def _process_started() -> float:
    """The ``time.monotonic()`` reading at which this process started, where Linux says (the
    interpreter's start-up and the imports count against ``--time-limit``); else now."""
    try:
        with open("/proc/self/stat") as f:
            # the fields after the command name, which may itself hold spaces
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        elapsed = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    return time.monotonic() - max(0.0, elapsed)


def main(argv: Optional[List[str]] = None) -> int:
    global _STARTED
    _STARTED = _process_started() if argv is None else time.monotonic()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args, args.subparser, "fasttrain " + shlex.join(argv))
    if args.command == "readme":
        return _readme(args, args.subparser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
