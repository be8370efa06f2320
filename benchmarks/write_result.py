"""Collect what `run_gpu.sh` left in its output folder into one result file.

    python benchmarks/write_result.py --out bench_out/gpu-... --device cuda --results benchmarks/results

Reads ``commands.txt`` (each invocation's command line), ``steps.tsv`` (name, exit status,
seconds, log of every step), ``check/check.md`` (engine checks), ``logs/pytest-gpu.log``,
the bench tables ``<workload>-<size>.md``, ``bench_clip.md`` and ``bench_loss_accum.md``;
writes ``result.md`` in the folder and ``<results>/<date>-<device>.md``, which records the
GPU, driver, torch and triton versions and the commands. Both invocations of a two-part run rewrite the whole file, so it
holds whatever parts have run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from typing import Dict, List

#: bench tables in the order they are shown
TABLES = ("mlp-small", "mlp-tiny", "gpt-124m", "gpt-tiny", "convnet-small", "convnet-tiny")
#: the kernel benchmarks' tables (benchmarks/kernels/<name>.py writes <name>.md) and their titles
KERNEL_TABLES = (("bench_clip", "Fused gradient clipping"), ("bench_loss_accum", "Loss gathering"))


def read_steps(folder: str) -> List[Dict[str, str]]:
    path = os.path.join(folder, "steps.tsv")
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    steps.append(dict(zip(("name", "status", "seconds", "log"), parts)))
    # a step run again (the same part invoked twice) shows its latest outcome
    latest = {}
    for step in steps:
        latest[step["name"]] = step
    return list(latest.values())


def describe(status: str) -> str:
    code = int(status) if status.lstrip("-").isdigit() else None
    if code == 0:
        return "ok"
    if code in (124, 137):
        return f"TIMED OUT (exit {code})"
    return f"FAILED (exit {status})"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _drop_title(text: str) -> str:
    lines = text.splitlines()
    return "\n".join(lines[1:]).strip() if lines and lines[0].startswith("# ") else text


def environment_lines(device: str) -> List[str]:
    from fasttrain.bench.hardware import describe_environment

    env = describe_environment(device)
    if device == "cuda":
        where = f"- device: {env.get('device_name')} (driver {env.get('driver')}, CUDA {env.get('cuda')})"
    else:
        where = f"- device: CPU {env.get('device_name') or env.get('cpu')} ({env.get('cpu_count')} cores)"
    versions = ", ".join(
        f"{name} {env.get(name)}" for name in ("torch", "triton", "accelerate", "pytorch-accelerated", "lightning", "fasttrain")
        if env.get(name) is not None
    )
    return [where, f"- {versions}, Python {env.get('python')}", f"- platform: {env.get('platform')}"]


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def build(folder: str, device: str) -> tuple:
    """The result text and whether every step passed."""
    steps = read_steps(folder)
    commands = _read(os.path.join(folder, "commands.txt")).splitlines() if os.path.exists(os.path.join(folder, "commands.txt")) else []
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = [f"# fasttrain {'GPU' if device == 'cuda' else 'CPU'} run, {date}", ""]
    out += environment_lines(device)
    out += [f"- command: `{c}`" for c in commands]
    out += [
        f"- raw logs, JSON and CSV: `{folder}/` (not committed)",
        "",
        "## Steps",
        "",
        "| step | outcome | seconds | log |",
        "|---|---|---:|---|",
    ]
    out += [f"| {s['name']} | {describe(s['status'])} | {s['seconds']} | `{s['log']}` |" for s in steps]
    out.append("")
    pytest_log = os.path.join(folder, "logs", "pytest-gpu.log")
    if os.path.exists(pytest_log):
        summary = [line for line in _read(pytest_log).splitlines() if re.search(r"\b(passed|failed|skipped|error)", line)]
        out += ["## pytest -m gpu", "", f"`{summary[-1].strip('= ') if summary else 'no summary line'}`", ""]
    check = os.path.join(folder, "check", "check.md")
    if os.path.exists(check):
        out += ["## Engine checks (benchmarks/gpu_check.py)", "", _drop_title(_read(check)), ""]
    for table in TABLES:
        path = os.path.join(folder, f"{table}.md")
        if os.path.exists(path):
            out += [f"## Bench: {table}", "", _drop_title(_read(path)), ""]
    for name, title in KERNEL_TABLES:
        path = os.path.join(folder, f"{name}.md")
        if os.path.exists(path):
            out += [f"## {title} (benchmarks/kernels/{name}.py)", "", _drop_title(_read(path)), ""]
    failed = [s for s in steps if describe(s["status"]) != "ok"]
    if failed:
        out += ["## Failed", ""] + [f"- {s['name']}: {describe(s['status'])}, see `{s['log']}`" for s in failed] + [""]
    return "\n".join(out), not failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the run's output folder")
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--results", default=None, help="folder for the dated copy (e.g. benchmarks/results)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: no such folder; give run_gpu.sh's output folder")
    text, passed = build(args.out, args.device)
    with open(os.path.join(args.out, "result.md"), "w") as f:
        f.write(text)
    if args.results:
        from fasttrain.bench.hardware import describe_environment

        name = describe_environment(args.device).get("device_name") if args.device == "cuda" else "cpu"
        os.makedirs(args.results, exist_ok=True)
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        path = os.path.join(args.results, f"{date}-{slug(str(name))}.md")
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
