"""A ``torch.profiler`` callback for training runs, and the CPU peak-memory measurement.

:class:`ProfilerCallback` runs the profiler over chosen training steps with torch's
wait / warmup / active schedule and writes each recorded window as a Chrome trace (open in
``chrome://tracing`` or Perfetto) or as TensorBoard profiler files. It advances the schedule
with ``profiler.step()`` at each step end, which reads no device value, so profiling adds no
synchronisation to the step (the profiler itself synchronises when a window is written, once
per window). Compiled and CUDA-graphed steps appear as their compiled regions and graph
launches; the host gap between steps is visible in the trace.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from fasttrain.callbacks.events import TrainerCallback
from fasttrain.callbacks.flush_records import is_main_process

__all__ = ["ProfilerCallback", "peak_cpu_memory_bytes"]

TRACE_FORMATS = ("chrome", "tensorboard")


def _activities(device) -> list:
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return activities


class ProfilerCallback(TrainerCallback):
    """Profiles training steps with ``torch.profiler``.

    :param output_dir: where traces go: ``trace_<n>.json`` per window (``"chrome"``) or
        TensorBoard's ``*.pt.trace.json`` files (``"tensorboard"``, open with
        ``tensorboard --logdir output_dir``).
    :param wait, warmup, active, repeat, skip_first: torch's profiler schedule, in training
        micro-steps: skip ``skip_first``, then ``repeat`` times: idle ``wait``, warm up
        ``warmup`` (recorded then thrown away), record ``active``. Keep the first steps out of
        the record when the engine compiles or captures there.
    :param trace: ``"chrome"`` or ``"tensorboard"``.
    :param record_memory: also record allocations and write ``memory_<n>.html``, the memory
        timeline by category (parameters, gradients, activations, optimizer state).
    :param with_stack: record Python stacks (larger traces, slower).
    :param all_processes: profile every process (files get ``rank<r>_`` prefixes); by default
        only the world's process zero profiles.
    :param on_window: called with the profiler when a window has been recorded, while its events
        are readable (``prof.events()``, ``prof.key_averages()``); the profiler clears them after.

    After the run, :attr:`profiler` holds the last profile (``key_averages()`` for tables) and
    :attr:`trace_paths` the files written.
    """

    #: reads no ``model_outputs`` at step ends (the graphed engine need not keep them)
    model_outputs_phases = ()

    def __init__(
        self,
        output_dir="profiler",
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        trace: str = "chrome",
        record_memory: bool = False,
        with_stack: bool = False,
        all_processes: bool = False,
        on_window: Optional[Callable[[profile], None]] = None,
    ):
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                   ("repeat", repeat, 0), ("skip_first", skip_first, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"ProfilerCallback: {name} must be an int >= {least}, got {value!r}")
        if trace not in TRACE_FORMATS:
            raise ValueError(f"ProfilerCallback: trace must be one of {TRACE_FORMATS}, got {trace!r}")
        self.output_dir = os.fspath(output_dir)
        self.schedule_args = dict(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
        self.trace = trace
        self.record_memory = record_memory
        self.with_stack = with_stack
        self.all_processes = all_processes
        self.on_window = on_window
        self.windows = 0
        self.profiler: Optional[profile] = None
        self.trace_paths: list = []
        self._prefix = ""

    def _on_trace_ready(self) -> Callable:
        handler = None
        if self.trace == "tensorboard":
            handler = tensorboard_trace_handler(self.output_dir, worker_name=self._prefix.rstrip("_") or None)

        def ready(prof):
            repeat = self.schedule_args["repeat"]
            if repeat and self.windows >= repeat:
                return  # stop() after the last window hands over a partial one with no steps
            if handler is not None:
                before = set(os.listdir(self.output_dir))
                handler(prof)
                self.trace_paths += sorted(os.path.join(self.output_dir, f)
                                           for f in set(os.listdir(self.output_dir)) - before)
            else:
                path = os.path.join(self.output_dir, f"{self._prefix}trace_{self.windows}.json")
                prof.export_chrome_trace(path)
                self.trace_paths.append(path)
            if self.record_memory:
                device = "cuda:0" if ProfilerActivity.CUDA in prof.activities else "cpu"
                path = os.path.join(self.output_dir, f"{self._prefix}memory_{self.windows}.html")
                prof.export_memory_timeline(path, device=device)
                self.trace_paths.append(path)
            self.windows += 1
            if self.on_window is not None:
                self.on_window(prof)

        return ready

    def on_training_run_start(self, trainer, **kwargs):
        if not (self.all_processes or is_main_process(trainer)):
            return
        if self.all_processes and trainer.run_config is not None and trainer.run_config.num_processes > 1:
            self._prefix = f"rank{torch.distributed.get_rank()}_"
        os.makedirs(self.output_dir, exist_ok=True)
        self.profiler = profile(
            activities=_activities(trainer.device),
            schedule=schedule(**self.schedule_args),
            on_trace_ready=self._on_trace_ready(),
            record_shapes=self.record_memory,
            profile_memory=self.record_memory,
            with_stack=self.with_stack or self.record_memory,  # the memory timeline needs stacks
        )
        self.profiler.start()

    def on_train_step_end(self, trainer, **kwargs):
        if self.profiler is not None:
            self.profiler.step()  # host-side schedule bookkeeping; reads no device value

    def on_training_run_end(self, trainer, **kwargs):
        self._stop()

    def on_stop_training_error(self, trainer, **kwargs):
        self._stop()

    def _stop(self) -> None:
        if self.profiler is not None and self.profiler.profiler is not None:
            self.profiler.stop()


def peak_cpu_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors alive while ``fn()`` runs, from the profiler's memory timeline
    (allocations by category; memory held before ``fn`` starts is not counted)."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    # private API: the same timeline export_memory_timeline writes, as numbers instead of a plot
    _times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return int(max((sum(s) for s in sizes), default=0))
