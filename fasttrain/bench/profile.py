"""``fasttrain bench --profile``: one profiled fasttrain run of a workload.

Writes a Chrome trace of the recorded steps and prints two things:

- the top operators (kernels on CUDA, aten ops on the CPU) by their own time;
- per step, the host-side gap: the part of the step during which the device computes nothing
  (step time minus the union of kernel intervals on CUDA, minus the union of aten-op intervals on
  the CPU). It is what framework overhead, Python and data loading cost a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

from torch.autograd import DeviceType

__all__ = ["StepGap", "step_gaps", "top_operators", "run_profile"]


@dataclass(frozen=True)
class StepGap:
    step: int
    step_ms: float
    busy_ms: float

    @property
    def gap_ms(self) -> float:
        return self.step_ms - self.busy_ms


def _union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def step_gaps(events: Sequence) -> List[StepGap]:
    """Per ``ProfilerStep#n`` range of ``events`` (``profile.events()``): its length and how much
    of it the device was busy, both in milliseconds."""
    # torch names every step range "ProfilerStep*" in the events; they are numbered by order
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    work = on_device or [e for e in events if e.name.startswith("aten::")]
    gaps = []
    for index, s in enumerate(sorted(steps, key=lambda e: e.time_range.start)):
        lo, hi = s.time_range.start, s.time_range.end
        clipped = [(max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in work
                   if e.time_range.end > lo and e.time_range.start < hi]
        gaps.append(StepGap(index, (hi - lo) / 1e3, _union_length(clipped) / 1e3))
    return gaps


def top_operators(prof, limit: int = 10) -> List[Tuple[str, float, int]]:
    """``(name, self time in ms, calls)`` of the operators with the most self time: device time
    when a device ran kernels, CPU time otherwise."""
    averages = [a for a in prof.key_averages() if not a.key.startswith("ProfilerStep")]
    use_device = any(getattr(a, "self_device_time_total", 0) > 0 for a in averages)
    attr = "self_device_time_total" if use_device else "self_cpu_time_total"
    ranked = sorted(averages, key=lambda a: getattr(a, attr), reverse=True)[:limit]
    return [(a.key, getattr(a, attr) / 1e3, a.count) for a in ranked]


def format_profile(tops, gaps: List[StepGap], trace_paths) -> str:
    lines = ["Top operators by self time:", f"{'ms':>10}  {'calls':>6}  name"]
    lines += [f"{ms:10.3f}  {calls:6d}  {name}" for name, ms, calls in tops]
    lines += ["", "Host-side gap per step (device idle):", f"{'step':>5}  {'step ms':>9}  {'busy ms':>9}  {'gap ms':>9}"]
    lines += [f"{g.step:5d}  {g.step_ms:9.3f}  {g.busy_ms:9.3f}  {g.gap_ms:9.3f}" for g in gaps]
    lines += ["", "Trace: " + ", ".join(trace_paths)]
    return "\n".join(lines)


def run_profile(workload, out_dir: str, *, engine: str = "auto", warmup: int = 3, steps: int = 5) -> str:
    """Train ``workload`` with fasttrain for ``warmup + steps`` updates, record the last
    ``steps`` (the warm-up holds compilation and graph capture), write the trace under
    ``out_dir`` and return the printed summary."""
    from fasttrain.bench.peers import loader_kwargs
    from fasttrain.bench.workloads import passthrough_collate
    from fasttrain.profiling import ProfilerCallback
    from fasttrain.trainer import Trainer

    model = workload.make_model()
    summary = []
    profiler = ProfilerCallback(
        os.path.join(out_dir, "profile"), wait=0, warmup=warmup, active=steps,
        on_window=lambda prof: summary.append((top_operators(prof), step_gaps(prof.events()))),
    )
    trainer = Trainer(model, workload.loss_func, workload.make_optimizer(model), callbacks=[profiler],
                      engine=engine, log_every_n_steps=warmup + steps,
                      mixed_precision="bf16" if workload.amp_dtype else "no")
    workload.resize(warmup + steps + 1)
    kwargs = loader_kwargs(workload)
    trainer.train(workload.dataset, num_epochs=1, per_device_batch_size=workload.batch_size,
                  max_num_train_steps=warmup + steps + 1, collate_fn=passthrough_collate,
                  train_dataloader_kwargs=kwargs)
    tops, gaps = summary[0]
    return format_profile(tops, gaps, profiler.trace_paths)
