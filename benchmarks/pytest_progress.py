"""A pytest plugin that notes each test as it starts and as it ends, in the file named by
``FASTTRAIN_TEST_PROGRESS``, so that a run the process did not survive (an abort in native code
kills pytest before its summary and its JUnit report) still says which test it died in.

Loaded by benchmarks/gpu_tests.py (``-p pytest_progress``); one line per event, written and
closed at once so that the lines reach the file before any crash:

    start <node id>
    fail {"test": <node id>, "when": <phase>, "message": <the report's end>}
    end <node id> <outcome>

The failures' messages are noted as they happen: a run that dies later writes no JUnit report.
"""

from __future__ import annotations

import json
import os

#: how much of a failure's report is noted (its end: the assertion and its values)
MESSAGE_CHARS = 4000

_outcomes: dict = {}


def _note(line: str) -> None:
    path = os.environ.get("FASTTRAIN_TEST_PROGRESS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    _outcomes[nodeid] = "passed"
    _note(f"start {nodeid}")


def pytest_runtest_logreport(report):
    # the worst of the setup, call and teardown phases; a skip counts where nothing failed
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        text = report.longreprtext
        _note("fail " + json.dumps({"test": report.nodeid, "when": report.when, "message": text[-MESSAGE_CHARS:]}))
    elif report.skipped and _outcomes.get(report.nodeid) == "passed":
        _outcomes[report.nodeid] = "skipped"


def pytest_runtest_logfinish(nodeid, location):
    _note(f"end {nodeid} {_outcomes.pop(nodeid, 'passed')}")


def read_progress(path: str):
    """``(started, outcomes, failures)``: the node ids in the order they started, the outcome of
    each one that ended (a started test with no outcome is the one the process died in), and each
    failure noted, in order (dicts with ``test``, ``when`` and ``message``)."""
    started, outcomes, failures = [], {}, []
    if not os.path.exists(path):
        return started, outcomes, failures
    with open(path, encoding="utf-8") as f:
        for line in f:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "start" and rest:
                started.append(rest)
            elif kind == "end" and rest:
                nodeid, _, outcome = rest.rpartition(" ")
                outcomes[nodeid] = outcome
            elif kind == "fail" and rest:
                try:
                    failures.append(json.loads(rest))
                except ValueError:  # the line a crash cut short
                    pass
    return started, outcomes, failures
