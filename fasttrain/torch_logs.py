"""Quieting torch log records that fasttrain's own machinery triggers and that say nothing to a user.

The compiled engine compiles the optimizer update. ``torch.optim.Optimizer.step`` wraps itself in
a profiler ``record_function``, which dynamo cannot put into a graph: it logs "Profiler record
function ... will be ignored" once per process. The step is traced correctly (the marker only
labels profiler traces), so a normal run would show a warning about nothing the user wrote or
can change. The filter drops exactly those records, on the loggers that emit them; every other
record passes.
"""

from __future__ import annotations

import logging

#: the dynamo modules that log the profiler notices
_LOGGERS = ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")


class _ProfilerNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not (message.startswith("Profiler ") and message.endswith(" will be ignored"))


_FILTER = _ProfilerNoticeFilter()


def quiet_profiler_notices() -> None:
    """Install the filter (idempotent: a logger keeps one copy)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
