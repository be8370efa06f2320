"""Compile caches: dynamo's in memory, one per function where it must be; Inductor's on disk, one per
process of a sharded run.

Dynamo keeps its cache of compiled code (and its recompile limit, 8 entries) on the code object:
:func:`with_own_dynamo_cache` gives a function a code object of its own, so that what is compiled
from it (one trainer's step functions, one block class's forward, a probe) neither evicts nor is
checked against what was compiled from another copy. Code objects compare equal by value, and dynamo
files the guards that failed (``guard_failures``) under the code object as a dictionary key: each
copy also carries a constant of its own, so that its failures are its own (symbolic_ints.py reads
them), while its file, line and name, under which dynamo keeps what it saw of each value, are the
original's.

Under FSDP2 every process compiles the same code over its own shards, and the shards of a
parameter need not have the same shape on every process (5 rows over 2 processes are 3 and 2; a
1-row head is 1 and 0). The processes of one machine share Inductor's cache directory by default,
and its FX-graph and AOTAutograd caches can hand one process a graph compiled for another's
shard shapes: the compiled update then computes wrong values without an error (seen on two gloo
processes: the weights drift from the eager run's after a warm-cache start). A cache directory of
its own per process keeps the caching (a second run still starts warm) without the mix-up.
"""

from __future__ import annotations

import itertools
import os
import types
from typing import Callable

_CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
_chosen = None  # the directory set here, so that later runs of the process keep it
_copies = itertools.count()


def with_own_dynamo_cache(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: a cache of compiled code (and a recompile limit) of
    its own, unequal to every other copy's (an unused constant appended: the bytecode's indices
    of the others are unchanged)."""
    code = fn.__code__
    own = code.replace(co_consts=code.co_consts + (f"fasttrain dynamo cache {next(_copies)}",))
    return types.FunctionType(own, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def separate_compile_cache_per_process() -> None:
    """Point Inductor's caches at ``<cache dir>/rank<R>`` in a process group (idempotent)."""
    global _chosen
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # a torch without the helper: no shared cache to separate from
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = False
        return
    current = cache_dir()  # Inductor reads the variable at every cache access
    if current == _chosen:
        return
    _chosen = os.path.join(current, f"rank{dist.get_rank()}")
    os.environ[_CACHE_DIR_VARIABLE] = _chosen
