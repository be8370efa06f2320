"""Turning a :class:`~fasttrain.bench.runner.BenchResult` into tables and files.

Throughput is summarised by the median over repeats, with the minimum and maximum beside it so a
noisy run shows itself. Ratios are paired per repeat (:func:`paired_ratios`): ``x bare`` is the
median over repeats of a peer's steps/s over the bare loop's in the same repeat (above 1 is
faster), with their minimum and maximum; ``x pt-acc`` the same against pytorch-accelerated.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import textwrap
from typing import Dict, List, Optional

from fasttrain.bench.peers import BASELINE
from fasttrain.bench.runner import BenchResult, peer_label

PTA = "pytorch-accelerated"

#: the CSV's columns, in order; also the keys of every row of :func:`summarize`.
CSV_FIELDS = (
    "peer",
    "engine",
    "engine_fallback",
    "status",
    "reason",
    "repeats",
    "steps_per_s_median",
    "steps_per_s_min",
    "steps_per_s_max",
    "items",
    "items_per_s_median",
    "items_per_s_min",
    "items_per_s_max",
    "ms_per_step_median",
    "ratio_vs_bare",
    "ratio_vs_bare_min",
    "ratio_vs_bare_max",
    "ratio_vs_pytorch_accelerated",
    "host_syncs_per_step",
    "cuda_syncs_per_step",
    "recompiles_after_warmup",
    "graph_breaks",
    "peak_memory_mb",
    "memory_kind",
    "mfu",
    "gpu_utilization_mean",
    "gpu_power_mean_w",
    "setup_s",
    "notes",
)


def paired_ratios(peer_times: List[float], base_times: List[float]) -> List[float]:
    """Per-repeat throughput ratios of a peer to a reference (``base_time / peer_time``). The
    repeats are interleaved, so repeat r of every peer ran under the same machine conditions and
    each ratio is a paired measurement. Empty when the two do not have the same repeats (one
    dropped a repeat as noise)."""
    if len(peer_times) != len(base_times) or not peer_times:
        return []
    return [b / p for p, b in zip(peer_times, base_times)]


def _ratio(times: Dict[str, List[float]], medians: Dict[str, float], name: str, ref: str):
    """(median, min, max) of the paired ratios of ``name`` to ``ref``; the ratio of the medians
    (no range) when the repeats do not pair up."""
    ratios = paired_ratios(times[name], times[ref])
    if ratios:
        return statistics.median(ratios), min(ratios), max(ratios)
    return medians[name] / medians[ref], None, None


#: pairs of peers compared repeat by repeat below the table, beside the columns' ``x bare`` and
#: ``x pt-acc``: fasttrain.lightning against Lightning itself (the same LightningModule) and
#: against fasttrain's own Trainer on the same engine
PAIRS = (("fasttrain-lightning", "lightning"), ("fasttrain-lightning", "fasttrain-eager"))


def paired_lines(bench: BenchResult, markdown: bool = False) -> List[str]:
    """``peer / reference: median [min-max]`` of the per-repeat throughput ratios of each of
    :data:`PAIRS` whose two peers both ran (the ratio of medians when their repeats do not pair),
    after a heading line; nothing when no pair ran. ``markdown``: as a list, after a blank line."""
    times = {p.name: p.step_times for p in bench.peers if p.status == "ok" and p.step_times}
    lines = []
    for name, ref in PAIRS:
        if name not in times or ref not in times:
            continue
        ratios = paired_ratios(times[name], times[ref])
        if ratios:
            text = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        else:
            medians = {n: statistics.median(1.0 / t for t in times[n]) for n in (name, ref)}
            text = f"{medians[name] / medians[ref]:.2f} (ratio of medians)"
        lines.append(f"- {name} / {ref}: {text}" if markdown else f"{name} / {ref}: {text}")
    if not lines:
        return []
    heading = "paired per repeat, steps/s of one peer over another, median [min-max]:"
    return ["", heading, *lines] if markdown else [heading, *lines]


def summarize(bench: BenchResult, peak_flops: Optional[float] = None) -> List[Dict[str, object]]:
    """One row per peer, with the keys of :data:`CSV_FIELDS`."""
    wl = bench.workload
    items_per_step = wl["items_per_step"]
    flops_per_step = wl.get("flops_per_step")
    medians = {
        p.name: statistics.median(1.0 / t for t in p.step_times)
        for p in bench.peers
        if p.status == "ok" and p.step_times
    }
    rows = []
    for p in bench.peers:
        rates = sorted(1.0 / t for t in p.step_times) if p.status == "ok" else []
        med = medians.get(p.name)
        row = dict.fromkeys(CSV_FIELDS)
        if p.status != "ok" or rates:
            status, reason = p.status, p.reason
        elif bench.interrupted and not bench.completed_repeats:
            stopped_by = bench.settings.get("stopped_by") or "Ctrl-C"
            status, reason = "interrupted", f"{stopped_by} before the first repeat completed"
        else:
            status, reason = "failed", "every repeat was shorter than timer noise; raise --steps"
        row.update(
            peer=p.name,
            engine=p.engine,
            engine_fallback=p.engine_fallback,
            status=status,
            reason=reason,
            repeats=len(rates),
            items=wl["items"],
            host_syncs_per_step=p.host_syncs_per_step,
            cuda_syncs_per_step=p.cuda_syncs_per_step,
            recompiles_after_warmup=p.recompiles,
            graph_breaks=p.graph_breaks,
            peak_memory_mb=p.peak_memory_mb,
            memory_kind=p.memory_kind,
            gpu_utilization_mean=p.gpu.get("utilization_mean"),
            gpu_power_mean_w=p.gpu.get("power_mean_w"),
            setup_s=p.setup_s,
            notes="; ".join(p.notes) or None,
        )
        if rates:
            row.update(
                steps_per_s_median=med,
                steps_per_s_min=rates[0],
                steps_per_s_max=rates[-1],
                items_per_s_median=med * items_per_step,
                items_per_s_min=rates[0] * items_per_step,
                items_per_s_max=rates[-1] * items_per_step,
                ms_per_step_median=1000.0 / med,
            )
            times = {q.name: q.step_times for q in bench.peers if q.name in medians}
            if BASELINE in medians:
                row["ratio_vs_bare"], row["ratio_vs_bare_min"], row["ratio_vs_bare_max"] = _ratio(
                    times, medians, p.name, BASELINE
                )
            if PTA in medians:
                row["ratio_vs_pytorch_accelerated"] = _ratio(times, medians, p.name, PTA)[0]
            if flops_per_step and peak_flops:
                row["mfu"] = flops_per_step * med / peak_flops
            if p.invalid_repeats:
                _add_note(row, f"{p.invalid_repeats} repeat(s) dropped as noise")
        if p.recompiles:
            _add_note(row, recompiles_note(p.recompiles, p.recompile_reasons))
        rows.append(row)
    return rows


def _add_note(row: Dict[str, object], extra: str) -> None:
    row["notes"] = f"{row['notes']}; {extra}" if row["notes"] else extra


def recompiles_note(recompiles: int, reasons: Dict[str, int]) -> str:
    """What compiled after warm-up, for a row's notes: each guard that failed (its first 160
    characters), and how many frames compiled for the first time."""
    again = sum(reasons.values())
    parts = [f"{text[:160]} (x{n})" for text, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    if recompiles > again:
        parts.append(f"{recompiles - again} frame(s) compiled for the first time")
    return f"{recompiles} compile(s) after warm-up: " + "; ".join(parts)


def _fmt(value, spec: str = ".3g", none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def rate_text(value: Optional[float]) -> str:
    """A rate in three significant digits, with k or M for thousands and millions."""
    if value is None:
        return "n/a"
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def _label(row: Dict[str, object]) -> str:
    return peer_label(row["peer"], row.get("engine"))


def table_rows(rows: List[Dict[str, object]]) -> List[List[str]]:
    """Header plus one list of cells per peer, shared by the terminal and Markdown tables."""
    items = next((r["items"] for r in rows), "samples")
    header = ["peer", "steps/s [min-max]", f"{items}/s", "x bare [min-max]", "x pt-acc", "syncs/step",
              "recompiles", "peak MB", "MFU", "GPU util"]
    out = [header]
    for r in rows:
        if r["status"] != "ok":
            out.append([_label(r), f"{r['status']}: {r['reason']}"] + [""] * (len(header) - 2))
            continue
        syncs = _fmt(r["host_syncs_per_step"], ".3g")
        if r["cuda_syncs_per_step"] is not None:
            syncs += f" ({_fmt(r['cuda_syncs_per_step'], '.3g')} cuda)"
        out.append([
            _label(r) + (" *" if r["notes"] else ""),
            f"{rate_text(r['steps_per_s_median'])} "
            f"[{rate_text(r['steps_per_s_min'])}-{rate_text(r['steps_per_s_max'])}]",
            rate_text(r["items_per_s_median"]),
            _fmt(r["ratio_vs_bare"], ".2f") + (
                f" [{r['ratio_vs_bare_min']:.2f}-{r['ratio_vs_bare_max']:.2f}]"
                if r["ratio_vs_bare_min"] is not None else ""
            ),
            _fmt(r["ratio_vs_pytorch_accelerated"], ".2f"),
            syncs,
            str(r["recompiles_after_warmup"]),
            _fmt(r["peak_memory_mb"], ".0f"),
            _fmt(r["mfu"] * 100 if r["mfu"] is not None else None, ".1f", "n/a") + ("%" if r["mfu"] is not None else ""),
            _fmt(r["gpu_utilization_mean"], ".0f") + ("%" if r["gpu_utilization_mean"] is not None else ""),
        ])
    return out


def _title(bench: BenchResult) -> str:
    wl, s = bench.workload, bench.settings
    if bench.interrupted:
        by = s.get("stopped_by")
        repeats = f"INTERRUPTED{f' ({by})' if by and by != 'SIGINT' else ''} after {bench.completed_repeats} of {s['repeats']} repeats"
    else:
        repeats = f"{s['repeats']} repeats"
    return (
        f"{wl['workload']} ({wl['size']}, batch {wl['batch_size']}, {wl['amp_dtype']}"
        f"{', ' + wl['optimizer'] if 'optimizer' in wl else ''}) on {wl['device']}"
        f" · {s['steps']} steps after {s['warmup']} warm-up, {repeats}, interleaved"
        f" · {s.get('clock', 'wall')} clock · steps/s: median [min-max] over repeats"
    )


_MEMORY_MEANING = {
    "cuda_max_reserved": "peak MB: CUDA max_memory_reserved over setup and warm-up (CUDA graph "
    "pools included), above what earlier peers keep resident",
    "cpu_peak_rss_delta": "peak MB: growth of the process's peak RSS over setup and warm-up (a lower "
    "bound: memory freed by earlier peers is reused without growth)",
}


def _notes(rows: List[Dict[str, object]], bench: Optional[BenchResult] = None) -> List[str]:
    lines = [f"* {_label(r)}: {r['notes']}" for r in rows if r["status"] == "ok" and r["notes"]]
    lines += list(bench.settings.get("time_limit_notes") or []) if bench is not None else []
    lines.append(
        "syncs/step: host reads of device values per step (.item(), .tolist(), bool(), float(), "
        ".cpu(), ...) outside PyTorch itself; '(n cuda)': synchronising CUDA operations reported "
        "by sync-debug mode"
    )
    kinds = {r["memory_kind"] for r in rows if r["status"] == "ok" and r["memory_kind"]}
    lines += [_MEMORY_MEANING[k] for k in sorted(kinds) if k in _MEMORY_MEANING]
    return lines


def format_table(bench: BenchResult, rows: List[Dict[str, object]]) -> str:
    """A plain-text table for the terminal."""
    cells = table_rows(rows)
    measured = [row for row in cells if row[2]]  # unavailable peers span the row; keep them out
    widths = [max(len(row[i]) for row in measured) for i in range(len(cells[0]))]
    widths[0] = max(len(row[0]) for row in cells)
    lines = [_title(bench)]
    for n, row in enumerate(cells):
        if n > 0 and not row[2]:  # an unavailable peer: one cell spanning the row
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]}")
            continue
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += _notes(rows, bench)
    return "\n".join(lines)


def format_markdown(bench: BenchResult, rows: List[Dict[str, object]]) -> str:
    cells = table_rows(rows)
    lines = [f"**{_title(bench)}**", "", "| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    for row in cells[1:]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    lines += [""] + _notes(rows, bench)
    return "\n".join(lines) + "\n"


def _write_png(bench: BenchResult, rows: List[Dict[str, object]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is an optional extra: pip install fasttrain[plot]
        return False
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return False
    names = [_label(r) for r in ok]
    med = [r["steps_per_s_median"] for r in ok]
    err = [[m - r["steps_per_s_min"] for m, r in zip(med, ok)], [r["steps_per_s_max"] - m for m, r in zip(med, ok)]]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(ok) + 1.5))
    bars = ax.barh(names, med, xerr=err, color=["#888888" if r["peer"] == BASELINE else "#3b75af" for r in ok])
    for bar, r in zip(bars, ok):
        if r["ratio_vs_bare"] is not None:
            # Right of the error bar, so the two never overlap.
            ax.text(r["steps_per_s_max"], bar.get_y() + bar.get_height() / 2, f"  {r['ratio_vs_bare']:.2f}x", va="center")
    ax.set_xlim(0, max(r["steps_per_s_max"] for r in ok) * 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("steps/s (median, min-max over repeats)")
    ax.set_title("\n".join(textwrap.wrap(_title(bench), 110)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


_EXTENSIONS = ("json", "csv", "md", "png")


def existing_reports(out_dir: str, workload: str, size: str) -> List[str]:
    """The result files a run of ``workload``/``size`` would overwrite in ``out_dir``."""
    stem = os.path.join(out_dir, f"{workload}-{size}")
    return [f"{stem}.{ext}" for ext in _EXTENSIONS if os.path.exists(f"{stem}.{ext}")]


def write_reports(
    bench: BenchResult, out_dir: str, rows: List[Dict[str, object]], environment: Dict[str, object]
) -> Dict[str, str]:
    """Write ``<workload>-<size>.{json,csv,md,png}`` to ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{bench.workload['workload']}-{bench.workload['size']}")
    paths = {"json": stem + ".json", "csv": stem + ".csv", "md": stem + ".md"}
    with open(paths["json"], "w") as f:
        json.dump({"environment": environment, **bench.to_dict(), "summary": rows}, f, indent=2, default=str)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    with open(paths["md"], "w") as f:
        f.write(format_markdown(bench, rows))
        f.writelines(line + "\n" for line in paired_lines(bench, markdown=True))
    if _write_png(bench, rows, stem + ".png"):
        paths["png"] = stem + ".png"
    return paths
