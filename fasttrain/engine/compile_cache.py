"""Inductor's on-disk compile caches, one per process of a sharded run.

Under FSDP2 every process compiles the same code over its own shards, and the shards of a
parameter need not have the same shape on every process (5 rows over 2 processes are 3 and 2; a
1-row head is 1 and 0). The processes of one machine share Inductor's cache directory by default,
and its FX-graph and AOTAutograd caches can hand one process a graph compiled for another's
shard shapes: the compiled update then computes wrong values without an error (seen on two gloo
processes: the weights drift from the eager run's after a warm-cache start). A cache directory of
its own per process keeps the caching (a second run still starts warm) without the mix-up.
"""

from __future__ import annotations

import os

_CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
_chosen = None  # the directory set here, so that later runs of the process keep it


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
