"""Many trainers in one process and dynamo's recompile limit.

Dynamo keeps compiled code per code object and stops compiling a code object after
``torch._dynamo.config.recompile_limit`` (8) entries that guard on the same objects, running it
uncompiled from then on. fasttrain's own compiled functions are private copies per trainer
(``compile_cache.with_own_dynamo_cache``), but the optimizer step goes through torch's code: the
``Optimizer.step`` wrappers and the optimizer's functions, which dynamo compiles as separate
frames after the graph break torch's optimizers make on purpose. Those code objects are shared by
every optimizer in the process, their entries guard on the optimizer's class, and so the ninth
trainer's update ran eagerly, with tensor betas (a host read per step), without a word.

Two measures:

* where ``torch.compile`` offers ``isolate_recompiles`` (torch 2.12 and later), the update is
  compiled with it: frames compiled under one trainer's update count only against that trainer's
  limit, so any number of trainers each get the same compiled step; compiled functions kept
  across runs (a LightningModule's, fitted again with a new optimizer each time) get an update
  of their own for each optimizer (``_CompiledFunctions.update_for``);
* elsewhere, ``recompile_limit`` is raised knowingly by one for every optimizer whose update
  fasttrain compiles: each adds exactly one entry per shared frame (its guards name that
  optimizer), so the limit still catches a real recompile loop within one trainer.

And no fallback goes unseen: a filter on dynamo's logger notes every "hit config.recompile_limit"
message, and the engines turn it into one warning naming the function, dynamo's last reason to
recompile it and what to change (:func:`new_hits`). The two causes met in training scripts:
batches whose shape changes from step to step (text padded to each batch's longest sample) and a
hook that changes a Python number on every call (a counter in ``optimizer_step``).
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import weakref
from typing import List

import torch

_LOGGER = "torch._dynamo.convert_frame"


class _LimitHits(logging.Filter):
    """Records dynamo's recompile-limit messages; lets every record through unchanged."""

    def __init__(self):
        super().__init__()
        self.hits: List[str] = []
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if message.startswith("torch._dynamo hit config."):
            args = record.args if isinstance(record.args, tuple) else ()
            # (limit name, its value, "'function' (file:line)", last recompile reason)
            if len(args) >= 3:
                what = f"dynamo hit {args[0]}={args[1]} for {args[2]}"
                if len(args) >= 4 and args[3]:
                    what += f", last recompiled because {short_reason(str(args[3]))}"
            else:
                what = record.getMessage().splitlines()[0]
            with self._lock:
                self.hits.append(what)
        return True


HITS = _LimitHits()


def short_reason(reason: str) -> str:
    """Dynamo's reason to recompile (a guard that failed), as one line: the guard, and the user's
    line that read the value where dynamo names it."""
    # "0/7: tensor 'batch['input_ids']' size mismatch at index 1. expected 10, actual 11", or
    # "2/7: self.count == 7  # self.count += 1  # file.py:12 in hook": the guard, without the
    # frame/entry numbers and the source comment dynamo appends
    lines = reason.strip().splitlines()  # dynamo may follow it with the user's stack
    parts = [part.strip() for part in (lines[0] if lines else "").split("  #")]
    reason = " ".join(parts[0].split())
    head, _, rest = reason.partition(": ")
    guard = rest if rest and head.replace("/", "").isdigit() else reason
    # the last comment names the user's line that read the value ("file.py:12 in hook")
    where = parts[-1] if len(parts) > 1 and re.search(r":\d+ in \w", parts[-1]) else ""
    return f"{guard} (at {where})" if where else guard


def what_to_change(hit: str) -> str:
    """What to change, for a hit noted by :data:`HITS` (it holds dynamo's last reason)."""
    reason = hit.partition(", last recompiled because ")[2]
    if "size mismatch" in reason or "stride mismatch" in reason:
        return (
            "The batches change shape from step to step and each shape compiles anew: pad them to "
            "one length (or to a few, with a multiple), or pass compile_options={'dynamic': None} "
            "to compile graphs that take any size."
        )
    if "==" in reason or "!=" in reason:
        return (
            "A hook reads a Python value that changes at every call, and each value compiles "
            "anew: keep counters and other per-step state out of the compiled hooks (in a callback, "
            "or in scheduler_step, which runs eagerly), or train with engine='eager'."
        )
    return 'TORCH_LOGS="recompiles" lists each recompile and its reason.'


def is_limit_failure(error: BaseException) -> bool:
    """Whether ``error`` is dynamo refusing to compile a function past the limit (it raises
    this instead of running the function uncompiled when the compile asked for ``fullgraph``)."""
    return isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit)


def install() -> None:
    """Start noting recompile-limit hits (idempotent)."""
    logger = logging.getLogger(_LOGGER)
    if HITS not in logger.filters:
        logger.addFilter(HITS)


def hit_count() -> int:
    return len(HITS.hits)


def new_hits(seen: int) -> List[str]:
    """The hits noted since ``hit_count()`` returned ``seen``."""
    return HITS.hits[seen:]


def _supports_isolation() -> bool:
    try:
        return "isolate_recompiles" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover - a wrapped torch.compile without a signature
        return False


ISOLATES = _supports_isolation()

_compiled_for: "weakref.WeakSet" = weakref.WeakSet()


def update_compile_kwargs() -> dict:
    """Extra ``torch.compile`` arguments for a trainer's update function."""
    return {"isolate_recompiles": True} if ISOLATES else {}


def reserve_for(optimizer) -> None:
    """Called once per optimizer whose update fasttrain compiles. Without isolation, raise
    ``recompile_limit`` by one per such optimizer; with it, nothing to do."""
    if ISOLATES or optimizer is None or optimizer in _compiled_for:
        return
    _compiled_for.add(optimizer)
    # every optimizer ever compiled keeps its entries in the shared frames' caches (dynamo does
    # not drop them when the optimizer dies), so the count only grows
    config = torch._dynamo.config
    config.recompile_limit = config.recompile_limit + 1
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 32 * config.recompile_limit)
