"""Run pytest, and run it again past any test the process does not survive.

A crash in native code (an abort in the CUDA allocator, a segfault in a kernel launcher) ends
pytest at once: no summary line, no JUnit report, and none of the tests after it run. On a device
run, where one command has minutes, that loses most of ``pytest -m gpu``. Here pytest runs with
``benchmarks/pytest_progress.py``, which notes each test as it starts and ends; when the process
dies of a signal, the test it died in is recorded as crashed and pytest runs again with every
test that already started deselected, until a run ends by itself (or ``--attempts`` runs).

    python3 benchmarks/gpu_tests.py --out FOLDER -- -m gpu -q tests

Each run writes ``FOLDER/junit-<n>.xml``; ``FOLDER/crashes.json`` lists the crashed tests, each
with the signal, what its run printed about the crash, and the failures of that run before it
(their messages, which the run's JUnit report would have held). pytest runs with
``--capture=sys``: what native code writes to the process's stderr (a C++ exception's message
before an abort) goes to the log instead of a capture file the crash would lose. Exit status: 0 when every run passed and
nothing crashed, 1 when a test failed or crashed, pytest's own status otherwise, 2 when a TERM
stopped it (sent to the process group, as ``timeout`` sends it, it ends pytest the way Ctrl-C
does, with its summary and report).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from pytest_progress import read_progress  # noqa: E402

#: lines of a run's output kept to find its crash's report in
TAIL_LINES = 400
#: lines of that report kept with the crash: from a few before faulthandler's "Fatal Python
#: error" (native code's own message, a C++ exception's, comes just before it) into the stacks
CRASH_LINES_BEFORE, CRASH_LINES_AFTER = 12, 40


def crash_report(lines: List[str]) -> List[str]:
    """The part of a dead run's output that says what killed it."""
    for i, line in enumerate(lines):
        if "Fatal Python error" in line:  # after pytest's progress characters on its line
            return lines[max(0, i - CRASH_LINES_BEFORE): i + CRASH_LINES_AFTER]
    return lines[-(CRASH_LINES_BEFORE + CRASH_LINES_AFTER):]


def _run(cmd: List[str], env: dict, tail: collections.deque, stopping: dict) -> int:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def note(signum, frame):
        # pytest is in this process's group, which the TERM reached as well (timeout, like a
        # terminal's Ctrl-C, signals the whole group): passed on again, a second TERM would end
        # pytest before its summary (tests/term_as_interrupt.py)
        stopping["term"] = True

    previous = signal.signal(signal.SIGTERM, note)
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JUnit reports and crashes.json")
    parser.add_argument("--attempts", type=int, default=8, help="pytest runs at most (default 8)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    os.makedirs(args.out, exist_ok=True)
    progress = os.path.join(args.out, "progress.txt")
    if os.path.exists(progress):
        os.remove(progress)
    env = dict(os.environ)
    env["FASTTRAIN_TEST_PROGRESS"] = progress
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_SHOW_CPP_STACKTRACES", "1")
    env["PYTHONUNBUFFERED"] = "1"
    crashes, statuses, stopping = [], [], {}
    for attempt in range(1, args.attempts + 1):
        started, _, failures = read_progress(progress)
        cmd = [sys.executable, "-m", "pytest", "-p", "pytest_progress", "--capture=sys",
               f"--junitxml={os.path.join(args.out, f'junit-{attempt}.xml')}"]
        cmd += [f"--deselect={nodeid}" for nodeid in started] + pytest_args
        tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
        rc = _run(cmd, env, tail, stopping)
        statuses.append(rc)
        now_started, outcomes, now_failures = read_progress(progress)
        died_in = [n for n in now_started[len(started):] if n not in outcomes]
        if rc >= 0 or stopping or not died_in:
            break
        # the run's JUnit report died with it: its failures are kept from the progress notes
        crashes.append({"test": died_in[-1], "signal": -rc, "run": attempt, "output": crash_report(list(tail)),
                        "failed_before": now_failures[len(failures):]})
        with open(os.path.join(args.out, "crashes.json"), "w", encoding="utf-8") as f:
            json.dump(crashes, f, indent=1)
        print(f"gpu_tests.py: run {attempt} died of signal {-rc} in {died_in[-1]}; running the tests after it",
              flush=True)
    if stopping:
        return 2
    if crashes or 1 in statuses:
        return 1
    last = statuses[-1]
    return last if last >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
