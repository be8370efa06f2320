"""A pytest run ended by TERM (the device run's time limit) reports the tests it ran."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from term_as_interrupt import _interrupt  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent / "benchmarks"))

import write_result  # noqa: E402

SLOW_SUITE = """
import time

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_outlasts_the_limit():
    time.sleep(120)
"""


def test_this_run_turns_a_term_into_an_interrupt():
    assert signal.getsignal(signal.SIGTERM) is _interrupt  # tests/conftest.py


def test_a_run_ended_by_term_prints_its_summary_and_writes_its_junit_report(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_SUITE)
    junit, log = tmp_path / "junit.xml", tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "term_as_interrupt", "-p", "no:cacheprovider",
             "--junitxml", str(junit), "test_slow.py"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while ".F" not in log.read_text() and time.monotonic() < deadline:  # the sleeping test has begun
            time.sleep(0.1)
        time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=30)
    finally:
        run.kill()
    text = log.read_text()
    assert code == 2, text  # pytest's exit code for an interrupted run
    assert "KeyboardInterrupt" in text and "1 failed, 1 passed" in text, text
    assert "FAILED test_slow.py::test_fails" in text, text
    # the interrupted test leaves a nameless, empty case behind
    cases = {case.get("name"): case for case in ET.parse(junit).getroot().iter("testcase") if case.get("name")}
    assert set(cases) == {"test_passes", "test_fails"}
    assert cases["test_fails"].find("failure") is not None and cases["test_passes"].find("failure") is None
    # what the device run's result file says of the step (benchmarks/write_result.py)
    section = write_result.pytest_section(text, str(junit))
    assert section.startswith("`1 failed, 1 passed in ") and "test_slow::test_fails" in section, section
