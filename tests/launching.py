"""Starting the multi-process tests' launches (torchrun, two gloo processes) and waiting for
them: a session of their own, so that a timeout ends the launcher and its workers together, and
the end of the output in every failure message."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: what a surrounding launch sets and a new launch must not inherit
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, log_path: Path, env) -> subprocess.Popen:
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, log_path: Path, deadline: float, what: str) -> int:
    """The exit code; a launch still running at ``deadline`` is killed and fails the test."""
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{what} timed out; end of its output:\n{log_path.read_text(errors='replace')[-6000:]}")
    return proc.returncode


def finish(proc: subprocess.Popen, log_path: Path, deadline: float, what: str) -> None:
    """Wait for the launch and fail the test unless it exited with 0."""
    if wait(proc, log_path, deadline, what) != 0:
        pytest.fail(f"{what} failed ({proc.returncode}); end of its output:\n{log_path.read_text(errors='replace')[-6000:]}")
