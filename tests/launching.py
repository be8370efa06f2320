"""Starting the multi-process tests' launches (torchrun, two gloo processes) and waiting for
them: a session of their own, so that a timeout ends the launcher and its workers together, and
the end of the output in every failure message."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: what a surrounding launch sets and a new launch must not inherit
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


#: the result files of a worker run by :func:`run_two_and_one`: both ranks, and the plain process
RESULT_NAMES = ("rank0_world2", "rank1_world2", "rank0_world1")


def launch_env(**extra) -> dict:
    """This process's environment less :data:`LAUNCH_VARIABLES`, one thread a process, unbuffered
    output, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun_two(script: Path, *args) -> list:
    """The command that runs ``script`` with ``args`` in two processes on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *map(str, args)]


def run_two_and_one(worker: Path, out: Path, env, timeout_s: float) -> dict:
    """``worker out`` under torchrun in two processes and, side by side, in one plain process (the
    references); fails the test unless both succeed within ``timeout_s``. Returns what the worker
    saved in ``out``, by :data:`RESULT_NAMES`."""
    deadline = time.monotonic() + timeout_s
    multi = start(torchrun_two(worker, out), out / "two_processes.log", env)
    single = start([sys.executable, str(worker), str(out)], out / "one_process.log", env)
    finish(single, out / "one_process.log", deadline, "the single-process reference")
    finish(multi, out / "two_processes.log", deadline, "torchrun --nproc_per_node 2")
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in RESULT_NAMES}


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
