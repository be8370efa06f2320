"""What torch's loggers write while a block runs: torch's loggers do not propagate to the root
logger (some not even to ``torch``), so a handler listens on each of them."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List


class _Records(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level=level)
        self.records: List[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def torch_log_records(level: int = logging.WARNING) -> Iterator[List[logging.LogRecord]]:
    """The records of ``level`` or above that torch's loggers (those existing when the block
    starts, ``torch`` included) emit inside the block; one record may appear once per logger it
    passes on its way up."""
    handler = _Records(level)
    names = ("torch", *logging.root.manager.loggerDict)
    loggers = [logging.getLogger(name) for name in names if name == "torch" or name.startswith("torch.")]
    for each in loggers:
        each.addHandler(handler)
    try:
        yield handler.records
    finally:
        for each in loggers:
            each.removeHandler(handler)
