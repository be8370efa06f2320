"""The README's benchmark tables, generated from committed result files.

A table lives between two markers, the opening one naming the JSON file that ``fasttrain bench``
wrote (path relative to the Markdown file)::

    <!-- bench-table: benchmarks/results/cpu-mlp-tiny.json -->
    ...generated...
    <!-- /bench-table -->

``fasttrain readme`` rewrites what is between them; ``fasttrain readme --check`` (run by the
tests) fails when a table no longer matches its file, so the README cannot drift from the
measurement it quotes. Every row the run printed appears, in the run's order.

Result files that are Markdown (a GPU run's, ``benchmarks/results/<date>-<gpu>.md``) are quoted
by section: between ``<!-- result-section: FILE#HEADING -->`` and ``<!-- /result-section -->``
stands, verbatim, what FILE holds under its ``## HEADING`` line, up to its next heading of level
1 or 2.

Ratios are taken per repeat: the repeats are interleaved, so repeat r of every peer ran under
the same machine conditions, and ``bare_time[r] / peer_time[r]`` is a paired measurement. The
table gives their median with the minimum and maximum, and says how many repeats there were.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Dict, List

from fasttrain.bench.peers import BASELINE
from fasttrain.bench.report import PTA, paired_ratios, rate_text
from fasttrain.bench.runner import peer_label

_BLOCK = re.compile(
    r"(?P<open><!-- bench-table: (?P<path>[^\s]+) -->\n)(?P<body>.*?)(?P<close><!-- /bench-table -->)",
    re.DOTALL,
)


_SECTION = re.compile(
    r"(?P<open><!-- result-section: (?P<path>[^\s#]+)#(?P<heading>[^\n]+?) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- /result-section -->)",
    re.DOTALL,
)


class ReadmeTableError(ValueError):
    """A marked table names a result file that is missing or not a ``fasttrain bench`` result."""


def _range(values: List[float], spec: str = ".2f") -> str:
    if not values:
        return "n/a"
    mid = statistics.median(values)
    if len(values) == 1:
        return format(mid, spec)
    return f"{mid:{spec}} [{min(values):{spec}}-{max(values):{spec}}]"


def render_table(result: Dict[str, object], source: str) -> str:
    """The Markdown for one result file: a line saying what ran, then one row per peer."""
    env, wl, settings = result["environment"], result["workload"], result["settings"]
    peers = result["peers"]
    times = {p["name"]: p["step_times"] for p in peers if p["status"] == "ok" and p["step_times"]}
    repeats = min((len(t) for t in times.values()), default=0)
    interrupted = " (interrupted)" if result.get("interrupted") else ""
    lines = [
        f"{env['device_name']}, {settings['threads']} thread(s), torch {env['torch']}; "
        f"`{settings['command']}`: {wl['workload']} {wl['size']}, batch {wl['batch_size']}, "
        f"{wl['amp_dtype']}{', ' + wl['optimizer'] if 'optimizer' in wl else ''}; "
        f"{settings['steps']} steps after {settings['warmup']} warm-up, "
        f"{repeats} interleaved repeats{interrupted}, {settings.get('clock', 'wall')} clock. "
        f"Values are median [min-max] over the repeats; ratios are per repeat. "
        f"Source: `{source}`.",
        "",
        "| peer | steps/s | x bare | x pytorch-accelerated | host syncs/step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in peers:
        label = peer_label(p["name"], p.get("engine"))
        if p["name"] not in times:
            lines.append(f"| {label} | {p['status']}: {(p.get('reason') or '').replace('|', '/')} | | | |")
            continue
        rates = [1.0 / t for t in times[p["name"]]]
        vs_bare = paired_ratios(times[p["name"]], times.get(BASELINE, []))
        vs_pta = paired_ratios(times[p["name"]], times.get(PTA, []))
        steps = f"{rate_text(statistics.median(rates))} [{rate_text(min(rates))}-{rate_text(max(rates))}]"
        syncs = p.get("host_syncs_per_step")
        lines.append(
            f"| {label} | {steps} | {_range(vs_bare)} | {_range(vs_pta)} | "
            f"{'n/a' if syncs is None else format(syncs, '.3g')} |"
        )
    return "\n".join(lines) + "\n"


def _load(markdown_path: str, source: str) -> Dict[str, object]:
    path = os.path.join(os.path.dirname(os.path.abspath(markdown_path)), source)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ReadmeTableError(f"{markdown_path}: the table marker names {source}, which does not exist") from None
    except json.JSONDecodeError as exc:
        raise ReadmeTableError(f"{source} is not JSON ({exc})") from None
    missing = {"environment", "workload", "settings", "peers"} - set(data)
    if missing:
        raise ReadmeTableError(f"{source} is not a fasttrain bench result: no {', '.join(sorted(missing))}")
    return data


def section_text(markdown_path: str, source: str, heading: str) -> str:
    """What the Markdown result file ``source`` holds under its ``## heading`` line, up to its
    next heading of level 1 or 2, verbatim but for blank lines at either end."""
    path = os.path.join(os.path.dirname(os.path.abspath(markdown_path)), source)
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ReadmeTableError(f"{markdown_path}: the section marker names {source}, which does not exist") from None
    headings = [line[3:].strip() for line in lines if line.startswith("## ")]
    if heading not in headings:
        raise ReadmeTableError(
            f"{source} has no '## {heading}' section; its sections: {', '.join(headings) or 'none'}"
        )
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and line[3:].strip() == heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(("# ", "## "))), len(lines))
    body = lines[start:end]
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    return "\n".join(body) + "\n"


def rewrite_tables(markdown_path: str, check: bool = False) -> List[str]:
    """Regenerate every marked table and quoted section of ``markdown_path``; returns the result
    files whose table or section changed (with ``check``, nothing is written)."""
    with open(markdown_path) as f:
        text = f.read()
    if not _BLOCK.search(text) and not _SECTION.search(text):
        raise ReadmeTableError(
            f"{markdown_path} has no '<!-- bench-table: FILE -->' ... '<!-- /bench-table -->' section "
            "and no '<!-- result-section: FILE#HEADING -->' ... '<!-- /result-section -->' one"
        )
    changed: List[str] = []

    def replace(match: re.Match) -> str:
        source = match.group("path")
        body = render_table(_load(markdown_path, source), source)
        if body != match.group("body"):
            changed.append(source)
        return match.group("open") + body + match.group("close")

    def quote(match: re.Match) -> str:
        source, heading = match.group("path"), match.group("heading")
        body = section_text(markdown_path, source, heading)
        if body != match.group("body"):
            changed.append(f"{source}#{heading}")
        return match.group("open") + body + match.group("close")

    new_text = _SECTION.sub(quote, _BLOCK.sub(replace, text))
    if changed and not check:
        with open(markdown_path, "w") as f:
            f.write(new_text)
    return changed
