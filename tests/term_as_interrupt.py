"""A TERM ends a pytest run as Ctrl-C does: the tests that ran keep their results.

The device run stops a step at its time limit with ``timeout``, which sends TERM and, 5 seconds
later, KILL (benchmarks/run_gpu.sh). Python's default for TERM ends the process at once: pytest
then prints no summary and writes no JUnit report, and a ``pytest -m gpu`` stopped near its end
would say nothing of the tests it had run. Raised as KeyboardInterrupt in the main thread, the
TERM lets pytest finish the way it does on Ctrl-C: the summary line, the failures so far, the
JUnit report. A second TERM ends the process at once. tests/conftest.py installs it for every
run; ``-p term_as_interrupt`` does for a run without that conftest.
"""

from __future__ import annotations

import signal
import threading


def interrupt_on_term() -> None:
    """TERM raises KeyboardInterrupt, where no one else handles TERM (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the process at once
    raise KeyboardInterrupt("terminated (SIGTERM)")


def pytest_configure(config) -> None:
    interrupt_on_term()
