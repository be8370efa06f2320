"""Counting host-device synchronisations and recompilations.

:class:`SyncCounter` counts the tensor methods that hand a device value to the host. On a GPU each
of them stalls the host until the device catches up; on the CPU they cost nothing, but counting
them there still shows, without a GPU, which loop *would* stall. On CUDA it also counts the
synchronising operations PyTorch itself reports in sync-debug mode (blocking copies, ops whose
output size depends on data), which no Python-level patch can see.

:class:`RecompileCounter` reads ``torch._dynamo``'s global counters before and after a region.

Both are for measurement runs, not timed runs: the patched methods add a Python call to every
``.item()`` of the code under test.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from typing import Dict, List, Optional

import torch

#: Tensor methods that copy a value to the host (a sync when the tensor lives on a GPU).
SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")

#: PyTorch's own calls are left out by default: e.g. Adam reads its step count, a CPU tensor
#: unless ``capturable``, with ``.item()``, which is no device sync. Syncs inside PyTorch that do
#: reach the device are what the CUDA sync-debug count is for.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

_SYNC_WARNING = "synchroniz"  # matches PyTorch's "called a synchronizing CUDA operation"


class SyncCounter:
    """Context manager counting host syncs made inside it.

    ``path_prefix``: when given, only calls whose immediate caller's source file lies under this
    directory are counted (e.g. the fasttrain package, to tell the trainer's syncs from the user's).
    ``cuda``: also count the synchronising CUDA operations reported by
    ``torch.cuda.set_sync_debug_mode("warn")``; ignored without CUDA. ``skip_cpu_tensors``: do not
    count calls on CPU tensors (on a GPU run they are no syncs; on a CPU run keep them, as a proxy
    for what would sync on a GPU). ``include_torch_internals``: also count calls made from inside
    PyTorch's own package.

    After the block, ``count`` is the total of the Python-level calls, ``by_method`` splits it,
    and ``cuda_syncs`` is the number of synchronising CUDA operations (None when not measured).
    Not re-entrant, and it patches ``torch.Tensor`` for the whole process: count one thing at a time.
    """

    def __init__(
        self,
        path_prefix: Optional[str] = None,
        cuda: bool = True,
        skip_cpu_tensors: bool = False,
        include_torch_internals: bool = False,
    ):
        self.path_prefix = os.path.abspath(path_prefix) + os.sep if path_prefix else None
        self.measure_cuda = cuda and torch.cuda.is_available()
        self.skip_cpu_tensors = skip_cpu_tensors
        self.include_torch_internals = include_torch_internals
        self.by_method: Counter = Counter()
        #: counts per ``(method, "file:line")`` of the caller, to find where a loop syncs.
        self.by_site: Counter = Counter()
        self.cuda_syncs: Optional[int] = None
        self._saved: Dict[str, object] = {}
        self._warnings_ctx = None
        self._caught = None
        self._old_debug_mode = None

    @property
    def count(self) -> int:
        return sum(self.by_method.values())

    def _counts(self, filename: str) -> bool:
        if not self.include_torch_internals and filename.startswith(_TORCH_DIR):
            return False
        return self.path_prefix is None or os.path.abspath(filename).startswith(self.path_prefix)

    def _wrap(self, name: str, original):
        counter = self

        def counted(self_tensor, *args, **kwargs):
            if not (counter.skip_cpu_tensors and self_tensor.device.type == "cpu"):
                # Frame 1 is whoever called the method; for implicit calls such as ``if t:``
                # the interpreter calls the slot directly, so frame 1 is still the user's frame.
                frame = sys._getframe(1)
                if counter._counts(frame.f_code.co_filename):
                    counter.by_method[name] += 1
                    counter.by_site[(name, f"{frame.f_code.co_filename}:{frame.f_lineno}")] += 1
            return original(self_tensor, *args, **kwargs)

        counted.__name__ = name
        counted.__wrapped__ = original
        return counted

    def __enter__(self) -> "SyncCounter":
        if self._saved:
            raise RuntimeError("SyncCounter is not re-entrant")
        for name in SYNC_METHODS:
            own = name in torch.Tensor.__dict__
            self._saved[name] = torch.Tensor.__dict__[name] if own else None
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        if self.measure_cuda:
            self._warnings_ctx = warnings.catch_warnings(record=True)
            self._caught = self._warnings_ctx.__enter__()
            # "always": the default filter would report a repeated warning from one line once.
            warnings.simplefilter("always")
            self._old_debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.measure_cuda:
            torch.cuda.set_sync_debug_mode(self._old_debug_mode)
            self.cuda_syncs = sum(1 for w in self._caught if _SYNC_WARNING in str(w.message))
            self._warnings_ctx.__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)  # the method was inherited from TensorBase
            else:
                setattr(torch.Tensor, name, saved)
        self._saved = {}

    def as_dict(self) -> Dict[str, object]:
        return {
            "host_syncs": self.count,
            "by_method": dict(self.by_method),
            "by_site": {f"{m} @ {site}": n for (m, site), n in self.by_site.most_common()},
            "cuda_syncs": self.cuda_syncs,
        }


def _dynamo_counters():
    from torch._dynamo.utils import counters

    return counters


class RecompileCounter:
    """Context manager reporting what ``torch.compile`` compiled inside it.

    Use it after warm-up: any frame compiled inside the block is then a recompilation (a guard
    failed, e.g. a new shape or a changed Python constant) or a frame never seen before; either
    costs a stall that steady-state training must not have.

    ``recompiles``: frames compiled inside the block. ``new_graphs``: graphs produced.
    ``graph_breaks``: graph breaks met while compiling them. ``reasons``: for each frame compiled
    again because a guard failed, ``"function: guard"`` in dynamo's words; the other compiled
    frames were compiled for the first time.
    """

    def __init__(self):
        self.recompiles = 0
        self.new_graphs = 0
        self.graph_breaks = 0
        self.reasons: List[str] = []
        self._start = None
        self._mark = None

    @staticmethod
    def _snapshot():
        from fasttrain.engine.compile_events import compiles_so_far

        c = _dynamo_counters()
        # frames compiled by either of dynamo's paths: counters["frames"] leaves out the
        # fullgraph=True one, which fasttrain's engines compile their forward hooks with
        return (
            compiles_so_far(),
            c["stats"]["unique_graphs"],
            sum(c["graph_break"].values()),
        )

    def __enter__(self) -> "RecompileCounter":
        from fasttrain.engine.compile_events import CompileMark

        self._start = self._snapshot()
        self._mark = CompileMark()
        return self

    def __exit__(self, *exc) -> None:
        self.update()

    def update(self) -> None:
        """Refresh the counts (also usable inside the block)."""
        now = self._snapshot()
        self.recompiles, self.new_graphs, self.graph_breaks = (a - b for a, b in zip(now, self._start))
        self.reasons = [f"{name}: {guard}" for name, guard in self._mark.guard_failures()]

    def as_dict(self) -> Dict[str, int]:
        return {"recompiles": self.recompiles, "new_graphs": self.new_graphs, "graph_breaks": self.graph_breaks}
