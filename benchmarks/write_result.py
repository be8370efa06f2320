"""The result file of `run_gpu.sh`: written after every step, and joined over the parts.

    python benchmarks/write_result.py --work SCRATCH --out OUT --device cuda --command "..."
    python benchmarks/write_result.py --merge DIR [DIR ...] --results benchmarks/results

The first form is what `run_gpu.sh` calls after each step. It reads the scratch folder of the
run (``steps.tsv``: name, exit status, seconds, time limit, part and CPU seconds of every step so far;
``logs/<step>.log``; ``steps/<step>/``: the Markdown tables, CSV and JSON the step wrote) and
rewrites the output folder's few files: ``run.json`` (everything below, as data: the steps of
earlier parts already recorded there are kept), ``result.md`` (the result file), ``run.log``
(the end of every step's log), ``bench.csv`` and ``check.csv`` (one row per peer, one per engine
run). The environment (GPU, driver, torch, triton) is read once, on the first call.

The second form joins the output folders of several parts (one per GPU command, each brought
back on its own) into ``<results>/<date>-<gpu>.md``; it writes nothing into those folders.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import io
import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

#: the order the steps' sections appear in, whatever order they ran in
STEP_ORDER = (
    "pytest-gpu", "check-mlp", "check-convnet", "check-gpt", "check-hf-gpt2",
    "bench-mlp", "bench-convnet", "bench-gpt", "bench-hf-gpt2", "bench-clip", "bench-loss-accum",
    "bench-masked-restore", "bench-overhead", "profile-mlp",
)
#: section titles of the steps that are not named after a workload
TITLES = {
    "pytest-gpu": "pytest -m gpu",
    "bench-clip": "Fused gradient clipping (benchmarks/kernels/bench_clip.py)",
    "bench-loss-accum": "Loss gathering (benchmarks/kernels/bench_loss_accum.py)",
    "bench-masked-restore": "The masked skip's undo (benchmarks/kernels/bench_masked_restore.py)",
    "profile-mlp": "Host time per step by function: mlp (benchmarks/host_profile.py)",
}
#: how much of each step's log run.log keeps (its end: where a failure shows)
LOG_TAIL_LINES = 120
LOG_TAIL_BYTES = 16_000
#: the speed targets of the GPU verification: (bench table, peer, reference peer, minimum ratio of
#: median steps/s). The default engine on CUDA is cudagraph.
TARGETS = (
    ("mlp-small", "fasttrain-cudagraph", "pytorch-accelerated", 3.0),
    ("mlp-small", "fasttrain-cudagraph", "bare", 1.5),
    ("mlp-small", "fasttrain-cudagraph", "cudagraph", 0.95),
    ("mlp-small", "fasttrain-lightning", "fasttrain-cudagraph", 0.9),
    ("gpt-124m", "fasttrain-compiled", "compiled", 1.0),
    ("gpt-124m", "fasttrain-cudagraph", "compiled", 1.1),
    ("hf-gpt2-124m", "fasttrain-compiled", "compiled-model", 1.0),
    ("hf-gpt2-124m", "fasttrain-cudagraph", "compiled-model", 1.1),
)
#: the columns of check.csv, from gpu_check.py's check.json
CHECK_COLUMNS = (
    "workload", "precision", "engine", "active_engine", "active_eval_engine", "weight_rel_diff",
    "loss_rel_diff_mean", "loss_rel_diff_max", "cuda_syncs_after_warmup", "host_reads_after_warmup",
    "recompiles_after_warmup", "steps_after_warmup", "seconds",
)


def describe(status: str) -> str:
    code = int(status) if str(status).lstrip("-").isdigit() else None
    if code == 0:
        return "ok"
    if code in (124, 137):
        return f"TIMED OUT (exit {code})"
    return f"FAILED (exit {status})"


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _drop_title(text: str) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[1:]).strip() if lines and lines[0].startswith("# ") else text.strip()


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def read_steps(work: str) -> List[Dict[str, str]]:
    """The steps of ``steps.tsv`` in the order they ran; a step run twice keeps its last outcome."""
    latest: Dict[str, Dict[str, str]] = {}
    path = os.path.join(work, "steps.tsv")
    if os.path.exists(path):
        for line in _read(path).splitlines():
            parts = line.split("\t")
            if len(parts) in (5, 6):
                latest.pop(parts[0], None)
                latest[parts[0]] = dict(zip(("name", "status", "seconds", "limit", "part", "cpu_seconds"), parts))
    return list(latest.values())


def log_tail(path: str) -> str:
    if not os.path.exists(path):
        return ""
    text = _read(path)
    lines = text.splitlines()[-LOG_TAIL_LINES:]
    tail = "\n".join(lines)[-LOG_TAIL_BYTES:]
    return tail if len(tail) == len(text.rstrip("\n")) else "[...]\n" + tail


def pytest_section(log: str, junit=None, crashes: Sequence[dict] = ()) -> str:
    """pytest's summary line (one per run: benchmarks/gpu_tests.py runs it again after a crash),
    the tests that crashed (``crashes``, from its crashes.json, with what the run printed about
    the crash), the tests that failed or errored and, from the JUnit XML reports (``junit``, a
    path or a list of them), each one's message whole (up to FAILURE_MESSAGE_CHARS): the summary
    lines are cut to the terminal's width and the log's tail may not reach the failures, while the
    GPU tests' messages carry their diagnostics (where memory sat at a peak, what a capture did)."""
    lines = log.splitlines()
    summary = [line for line in lines if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)]
    failed = [line.strip() for line in lines if line.startswith(("FAILED ", "ERROR "))]
    runs = len(summary) + len(crashes)
    if not summary:
        out = ["`no summary line (the run did not finish)`"]
    elif runs > 1 or crashes:
        out = [f"{len(crashes)} crash(es); pytest ran {runs} time(s), each after the last crash:", ""]
        out += [f"- `{line.strip('= ')}`" for line in summary]
    else:
        out = [f"`{summary[-1].strip('= ')}`"]
    for crash in crashes:
        out += ["", f"- CRASHED `{crash.get('test')}` (signal {crash.get('signal')}), the run's last words:", "",
                "  ```", *[f"  {line}" for line in crash.get("output", [])], "  ```"]
    lost = [(f["test"], f.get("message", "")) for crash in crashes for f in crash.get("failed_before", [])]
    if failed or lost:
        out += [""] + [f"- {line}" for line in failed] + [f"- FAILED {test} (in a run that crashed later)" for test, _ in lost]
    paths = [junit] if isinstance(junit, str) else list(junit or ())
    messages = lost + [m for path in paths if os.path.exists(path) for m in junit_failures(path)]
    if messages:
        out += ["", "Failure messages (pytest's JUnit report):", ""]
        for test, message in messages:
            if len(message) > FAILURE_MESSAGE_CHARS:
                message = message[:FAILURE_MESSAGE_CHARS] + f" [... {len(message) - FAILURE_MESSAGE_CHARS} more characters]"
            out += [f"- `{test}`:", "", "  ```", *[f"  {line}" for line in message.splitlines()], "  ```"]
    return "\n".join(out)


#: how much of one failing test's message result.md keeps
FAILURE_MESSAGE_CHARS = 6000


def junit_failures(path: str) -> List[Tuple[str, str]]:
    """``(test id, message)`` of every failed or errored test case in a JUnit XML report; an
    unreadable report (a run cut off while writing it) gives none."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError):
        return []
    found = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            element = case.find(kind)
            if element is not None:
                name = f"{case.get('classname', '?')}::{case.get('name', '?')}"
                found.append((name, element.get("message") or (element.text or "").strip()))
    return found


def step_section(name: str, folder: str, log_path: str) -> str:
    """The Markdown a step contributes: its tables (every ``.md`` it wrote), or pytest's summary."""
    if name == "pytest-gpu":
        reports = sorted(glob.glob(os.path.join(folder, "junit*.xml")), key=lambda p: (len(p), p))
        crashes_path = os.path.join(folder, "crashes.json")
        crashes = []
        if os.path.exists(crashes_path):
            try:
                crashes = json.loads(_read(crashes_path))
            except ValueError:  # cut off while written
                crashes = [{"test": "(crashes.json unreadable)", "signal": "?", "output": []}]
        return pytest_section(_read(log_path), reports, crashes) if os.path.exists(log_path) else ""
    parts = [_drop_title(_read(path)) for path in sorted(glob.glob(os.path.join(folder, "*.md")))]
    return "\n\n".join(p for p in parts if p)


def _csv_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def step_rows(name: str, folder: str) -> List[Dict[str, object]]:
    """The CSV rows a step contributes: the bench's per-peer rows, the checks' per-run rows."""
    rows: List[Dict[str, object]] = []
    if name.startswith("bench-"):
        for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
            rows += [{"table": os.path.basename(path)[:-4], **row} for row in _csv_rows(path)]
    elif name.startswith("check-") and os.path.exists(os.path.join(folder, "check.json")):
        for run in json.loads(_read(os.path.join(folder, "check.json"))).get("runs", []):
            loss = run.get("loss_rel_diff") or (None, None)
            values = dict(run, loss_rel_diff_mean=loss[0], loss_rel_diff_max=loss[1])
            rows.append({key: values.get(key) for key in CHECK_COLUMNS})
    return rows


def environment(device: str) -> Dict[str, object]:
    from fasttrain.bench.hardware import describe_environment

    return describe_environment(device)


def load_run(folder: str) -> Optional[dict]:
    path = os.path.join(folder, "run.json")
    return json.loads(_read(path)) if os.path.exists(path) else None


def collect(work: str, out: str, device: str, command: str) -> dict:
    """Fold the scratch folder's steps into ``out/run.json``; returns the record."""
    record = load_run(out) or {}
    if record.get("device") not in (None, device):
        raise SystemExit(f"{out}/run.json holds a {record['device']} run; give a {device} run another folder")
    record.setdefault("device", device)
    record.setdefault("date", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    if "environment" not in record:
        record["environment"] = environment(device)
    commands = record.setdefault("commands", [])
    if command and command not in commands:
        commands.append(command)
    steps = {s["name"]: s for s in record.get("steps", [])}
    for s in read_steps(work):
        folder = os.path.join(work, "steps", s["name"])
        log_path = os.path.join(work, "logs", f"{s['name']}.log")
        steps.pop(s["name"], None)
        steps[s["name"]] = dict(
            s, section=step_section(s["name"], folder, log_path), rows=step_rows(s["name"], folder),
            log=log_tail(log_path),
        )
    record["steps"] = list(steps.values())
    setup_log = os.path.join(work, "logs", "setup.log")
    if os.path.exists(setup_log):
        record["setup_log"] = log_tail(setup_log)
    return record


def merge(records: List[dict]) -> dict:
    """One record of several parts' records, which must come from one device."""
    names = {str(r["environment"].get("device_name")) for r in records}
    if len(names) > 1:
        raise SystemExit(f"the parts ran on different devices ({', '.join(sorted(names))}); record each apart")
    merged = dict(records[0], commands=[], steps=[])
    steps: Dict[str, dict] = {}
    for record in records:
        merged["commands"] += [c for c in record["commands"] if c not in merged["commands"]]
        for s in record["steps"]:
            steps.pop(s["name"], None)
            steps[s["name"]] = s
    merged["steps"] = list(steps.values())
    return merged


def environment_lines(device: str, env: Dict[str, object]) -> List[str]:
    if device == "cuda":
        where = f"- device: {env.get('device_name')} (driver {env.get('driver')}, CUDA {env.get('cuda')})"
    else:
        where = f"- device: CPU {env.get('device_name')} ({env.get('cpu_count')} cores)"
    versions = ", ".join(
        f"{name} {env.get(name)}"
        for name in ("torch", "triton", "accelerate", "pytorch-accelerated", "lightning", "transformers", "fasttrain")
        if env.get(name) is not None
    )
    return [where, f"- {versions}, Python {env.get('python')}", f"- platform: {env.get('platform')}"]


def _rate(rows: List[dict], table: str, peer: str) -> Optional[float]:
    for row in rows:
        if row.get("table") == table and row.get("peer") == peer and row.get("status") == "ok":
            try:
                return float(row["steps_per_s_median"])
            except (KeyError, TypeError, ValueError):
                return None
    return None


def target_lines(steps: List[dict]) -> List[str]:
    """The targets whose bench table is present: measured ratio and whether it is met."""
    rows = [row for s in steps if s["name"].startswith("bench-") for row in s.get("rows", [])]
    tables = {row.get("table") for row in rows}
    lines = []
    for table, peer, reference, minimum in TARGETS:
        if table not in tables:
            continue
        a, b = _rate(rows, table, peer), _rate(rows, table, reference)
        measured = a / b if a and b else None
        met = "n/a" if measured is None else ("yes" if measured >= minimum else "NO")
        shown = "n/a" if measured is None else f"{measured:.2f}x"
        lines.append(f"| {table} | {peer} | {reference} | >= {minimum:.2f}x | {shown} | {met} |")
    if not lines:
        return []
    return ["## Targets (median steps/s over the reference's)", "", "| table | peer | against | target | measured | met |",
            "|---|---|---|---|---|---|", *lines, ""]


def _order(step: dict) -> int:
    return STEP_ORDER.index(step["name"]) if step["name"] in STEP_ORDER else len(STEP_ORDER)


def render(record: dict) -> str:
    device = record["device"]
    steps = record["steps"]
    out = [f"# fasttrain {'GPU' if device == 'cuda' else 'CPU'} run, {record['date']}", ""]
    out += environment_lines(device, record["environment"])
    out += [f"- command: `{c}`" for c in record["commands"]]
    out += [
        "- each step started from empty inductor and Triton caches; seconds include compiling",
        "",
        "## Steps",
        "",
        "| part | step | outcome | seconds | CPU seconds | limit |",
        "|---|---|---|---:|---:|---:|",
    ]
    out += [
        f"| {s['part']} | {s['name']} | {describe(s['status'])} | {s['seconds']} | {s.get('cpu_seconds') or 'n/a'} | {s['limit']} |"
        for s in steps
    ]
    out.append("")
    for s in sorted(steps, key=_order):
        if s.get("section"):
            title = TITLES.get(s["name"]) or (
                f"Engine checks: {s['name'][6:]} (benchmarks/gpu_check.py)" if s["name"].startswith("check-")
                else f"Bench: {s['name'][6:]}"
            )
            out += [f"## {title}", "", s["section"], ""]
    out += target_lines(steps)
    failed = [s for s in steps if describe(s["status"]) != "ok"]
    if failed:
        out += ["## Failed", ""]
        for s in failed:
            last = [line for line in s.get("log", "").splitlines() if line.strip()][-1:] or ["(no output)"]
            out.append(f"- {s['name']}: {describe(s['status'])}; last line of its log: `{last[0].strip()[:200]}`")
        out.append("")
    return "\n".join(out)


def _write_csv(path: str, rows: List[Dict[str, object]]) -> None:
    if not rows:
        if os.path.exists(path):
            os.remove(path)
        return
    columns: List[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    with open(path, "w", newline="") as f:
        f.write(buf.getvalue())


def write_folder(record: dict, out: str) -> None:
    """``run.json``, ``result.md``, ``run.log`` and the CSVs; each replaced whole (write, then
    rename), so a run killed mid-write leaves the previous version, never half a file."""

    def put(name: str, text: str) -> None:
        tmp = os.path.join(out, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))

    put("run.json", json.dumps(record, indent=1))
    put("result.md", render(record))
    log = [f"== set-up\n{record.get('setup_log', '')}"]
    log += [f"== {s['name']} ({describe(s['status'])}, {s['seconds']} s)\n{s.get('log', '')}" for s in record["steps"]]
    put("run.log", "\n\n".join(log) + "\n")
    for kind in ("bench", "check"):
        rows = [dict(step=s["name"], **row) for s in record["steps"] if s["name"].startswith(kind) for row in s["rows"]]
        _write_csv(os.path.join(out, f"{kind}.csv"), rows)


def results_path(record: dict, results: str) -> str:
    name = record["environment"].get("device_name") if record["device"] == "cuda" else "cpu"
    return os.path.join(results, f"{record['date']}-{slug(str(name))}.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", help="the run's scratch folder (steps.tsv, logs/, steps/)")
    parser.add_argument("--out", help="the run's output folder")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--command", default="", help="the command line of this invocation")
    parser.add_argument("--merge", nargs="+", metavar="DIR", help="output folders of several parts to join")
    parser.add_argument("--results", default=None, help="with --merge: the folder for <date>-<gpu>.md")
    args = parser.parse_args(argv)
    if args.merge:
        if not args.results:
            parser.error("--merge needs --results, the folder the joined file goes to (benchmarks/results)")
        records = []
        for folder in args.merge:
            record = load_run(folder)
            if record is None:
                parser.error(f"{folder} holds no run.json; give the output folders run_gpu.sh wrote")
            records.append(record)
        record = merge(records)
        os.makedirs(args.results, exist_ok=True)
        path = results_path(record, args.results)
        with open(path, "w") as f:
            f.write(render(record))
        print(f"wrote {path}", file=sys.stderr)
        return 0 if all(describe(s["status"]) == "ok" for s in record["steps"]) else 1
    if not (args.work and args.out and args.device):
        parser.error("give --work, --out and --device (or --merge DIR... --results DIR)")
    for option, folder in (("--work", args.work), ("--out", args.out)):
        if not os.path.isdir(folder):
            parser.error(f"{option} {folder}: no such folder")
    # the status says whether the files were written; the steps' outcomes are in them
    write_folder(collect(args.work, args.out, args.device, args.command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
