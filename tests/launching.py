"""Starting the multi-process tests' launches (torchrun, two gloo processes) and waiting for
them: a session of their own, so that a timeout ends the launcher and its workers together, and
the end of the output in every failure message.

A launch still running at its deadline has hung. Before it is killed, every Python process in
it writes the stacks of all its threads into the log (``PYTHONFAULTHANDLER`` is set and the
processes get ``SIGABRT``), so the failure names the call each process waits in. A hang is
retried once when the caller allows it, with a warning that carries the hung attempt's stacks: a
gloo peer that never answers on a loaded machine fails one attempt, not the suite; a launch that
hangs twice, or exits with an error, fails the test.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: what a surrounding launch sets and a new launch must not inherit
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
#: how long the processes of a hung launch get to write their stacks before they are killed
STACK_DUMP_S = 5.0
#: the options whose value is the port a launch listens on, renewed when it is started again
PORT_OPTIONS = ("--master_port", "--main_process_port")
#: how much of a log a failure message shows: a hung launch's stacks need more
LOG_TAIL = 6000
HUNG_LOG_TAIL = 16000


#: the result files of a worker run by :func:`run_two_and_one`: both ranks, and the plain process
RESULT_NAMES = ("rank0_world2", "rank1_world2", "rank0_world1")


class LaunchHung(Exception):
    """A launch was still running at its deadline (its stacks are in its log)."""


def launch_env(**extra) -> dict:
    """This process's environment less :data:`LAUNCH_VARIABLES`, one thread a process, unbuffered
    output, Python's fault handler on (stacks on ``SIGABRT``), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **extra)
    return env


def torchrun_two(script: Path, *args, max_restarts: int = 0) -> list:
    """The command that runs ``script`` with ``args`` in two processes on this host.

    With ``max_restarts`` torchrun starts the pair again, up to that many times, when a process
    fails. That launch uses the c10d rendezvous, and its environment needs
    :data:`RESTART_ENV`: torchrun's static rendezvous (``--master_port``) and, by default, the
    c10d one keep the first start's store, where the restarted processes can read the previous
    start's process-group addresses and fail to connect (pytorch/pytorch#135712)."""
    if not max_restarts:
        launch = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    else:
        launch = ["--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *launch, str(script),
            *map(str, args)]


#: the environment of a launch that torchrun may restart: each start gets a store of its own
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


#: what gloo writes when a collective waited its process group's timeout for a peer: the peer
#: hung (its stacks are in the log when its worker calls ``worker_common.dump_stacks_when_stalled``)
PEER_TIMEOUT_MARKERS = ("Timed out waiting", "timed out waiting")


def run_restartable(script: Path, out: Path, *args, max_restarts: int, timeout_s: float, what: str,
                    planned: str = None) -> float:
    """``script out *args`` in two CPU processes that torchrun starts again up to
    ``max_restarts`` times (its log in ``out/launch.log``); fails the test unless it ends with
    0 within ``timeout_s``. Returns the seconds of the launch that succeeded.

    A launch that hangs, or fails because a collective waited its timeout for a peer that never
    came (:data:`PEER_TIMEOUT_MARKERS`), is started once more from the beginning, in an empty
    ``out`` (the first attempt's files, its log included, move to ``out.attempt1``), with a
    warning carrying the end of the first attempt's log: a gloo peer stalled on a loaded machine
    fails one attempt, not the suite. So is a launch that ended with 0 without the file
    ``planned`` in ``out``, which the script's planned failure writes (a process that kills
    itself): a process failed before it, on its own, and torchrun's restart went to that failure,
    which the warning shows. Any other failure, or a second one, fails the test."""
    env = launch_env(ACCELERATE_USE_CPU="1", **RESTART_ENV)
    for attempt in (1, 2):
        started = time.monotonic()
        # each attempt on fresh ports: the first attempt's rendezvous store may still hold its port
        launch = start(torchrun_two(script, out, *args, max_restarts=max_restarts), out / "launch.log", env)
        try:
            code = launch.wait(started + timeout_s)
        except LaunchHung:
            code = None
        if code == 0 and (planned is None or (out / planned).exists()):
            return time.monotonic() - started
        if code == 0:
            why = (f"ended without the planned failure ({planned} missing): a process failed before it, and "
                   "torchrun's restart went to that failure")
        elif code is None:
            why = "hung"
        elif any(marker in launch.log_tail(HUNG_LOG_TAIL) for marker in PEER_TIMEOUT_MARKERS):
            why = "failed on a collective that waited for a peer until its timeout"
        else:
            pytest.fail(f"{what} failed ({code}); end of its output:\n{launch.log_tail()}")
        if attempt == 2:
            pytest.fail(f"{what} (started again) {why}; end of its output:\n{launch.log_tail(HUNG_LOG_TAIL)}")
        warnings.warn(f"{what} {why} and is started again from the beginning; the end of its output:\n"
                      f"{launch.log_tail(HUNG_LOG_TAIL)}", stacklevel=2)
        out.replace(out.with_name(f"{out.name}.attempt1"))
        out.mkdir()


def run_two_and_one(worker: Path, out: Path, env, timeout_s: float) -> dict:
    """``worker out`` under torchrun in two processes and, side by side, in one plain process (the
    references); fails the test unless both succeed within ``timeout_s`` (a hang is retried once).
    Returns what the worker saved in ``out``, by :data:`RESULT_NAMES`."""
    deadline = time.monotonic() + timeout_s
    with LaunchGroup() as launches:
        multi = launches.start(torchrun_two(worker, out), out / "two_processes.log", env)
        single = launches.start([sys.executable, str(worker), str(out)], out / "one_process.log", env)
        finish(single, deadline, "the single-process reference", retry_s=timeout_s)
        finish(multi, deadline, "torchrun --nproc_per_node 2", retry_s=timeout_s)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in RESULT_NAMES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_fresh_port(cmd: list) -> list:
    cmd = list(cmd)
    for i, arg in enumerate(cmd):
        option, equals, _ = arg.partition("=")
        if option in PORT_OPTIONS and equals:
            cmd[i] = f"{option}={free_port()}"
        elif arg in PORT_OPTIONS and i + 1 < len(cmd):
            cmd[i + 1] = str(free_port())
    return cmd


class Launch:
    """A started command with its log, which can be started again."""

    def __init__(self, cmd, log_path: Path, env):
        self.cmd, self.log_path, self.env = list(cmd), Path(log_path), env
        self.attempts = 0
        self.proc = self._popen()

    def _popen(self) -> subprocess.Popen:
        self.attempts += 1
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def restart(self) -> None:
        """Start the command again, on a fresh port; the previous log is kept beside the new one."""
        self.log_path.replace(self.log_path.with_name(f"{self.log_path.name}.attempt{self.attempts}"))
        self.cmd = _with_fresh_port(self.cmd)
        self.proc = self._popen()

    def log_tail(self, chars: int = LOG_TAIL) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait(self, deadline: float) -> int:
        """The exit code; raises :class:`LaunchHung` after writing the stacks of every process of
        a launch still running at ``deadline`` into its log and killing them."""
        try:
            return self.proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self._end_tree(signal.SIGABRT)  # each fault handler writes its stacks, then its process ends
            raise LaunchHung() from None

    def kill(self) -> None:
        """End the launch and every process it started, if it is still running."""
        if self.proc.poll() is None:
            self._end_tree(None)

    def _end_tree(self, first_signal) -> None:
        # torchrun starts each worker in a session of its own: the workers are found as the
        # launcher's descendants, before the launcher ends and they are handed to init
        try:
            launcher = psutil.Process(self.proc.pid)
            processes = [launcher, *launcher.children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        if first_signal is not None:
            for process in processes:
                _signal(process, first_signal)
            psutil.wait_procs(processes, timeout=STACK_DUMP_S)
        for process in processes:
            _signal(process, signal.SIGKILL)
        self.proc.wait()


def _signal(process, sig) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def start(cmd, log_path: Path, env) -> Launch:
    return Launch(cmd, log_path, env)


class LaunchGroup(contextlib.AbstractContextManager):
    """Launches started side by side: on the way out, also when a test fails on one of them,
    every one still running is killed with all its processes, so none is left waiting for a
    peer for the rest of the test session."""

    def __init__(self):
        self.launches = []

    def start(self, cmd, log_path: Path, env) -> Launch:
        launch = start(cmd, log_path, env)
        self.launches.append(launch)
        return launch

    def __exit__(self, *exc):
        for launch in self.launches:
            launch.kill()
        return None


def wait(launch: Launch, deadline: float, what: str) -> int:
    """The exit code; a launch still running at ``deadline`` fails the test with its stacks."""
    try:
        return launch.wait(deadline)
    except LaunchHung:
        _fail_hung(launch, what)


def _fail_hung(launch: Launch, what: str) -> None:
    pytest.fail(f"{what} timed out; end of its output, with the stacks of its processes:\n"
                f"{launch.log_tail(HUNG_LOG_TAIL)}")


def finish(launch: Launch, deadline: float, what: str, retry_s: float = None) -> None:
    """Wait for the launch and fail the test unless it exited with 0. With ``retry_s``, a launch
    that hangs is started once more and given ``retry_s`` seconds, with a warning carrying the
    stacks of the hung attempt."""
    try:
        code = launch.wait(deadline)
    except LaunchHung:
        if retry_s is None:
            _fail_hung(launch, what)
        warnings.warn(f"{what} hung and is started again; the stacks of its processes:\n"
                      f"{launch.log_tail(HUNG_LOG_TAIL)}", stacklevel=2)
        launch.restart()
        code = wait(launch, time.monotonic() + retry_s, f"{what} (started again after a hang)")
    if code != 0:
        pytest.fail(f"{what} failed ({code}); end of its output:\n{launch.log_tail()}")
