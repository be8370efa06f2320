"""The multi-process tests' launcher (tests/launching.py): a hung launch shows where each of its
processes waits, leaves no process behind, and is retried once when the caller allows it; a
restartable launch whose collective waited for a peer until its timeout is started again from the
beginning."""

import sys
import time

import psutil
import pytest

from launching import (
    LaunchGroup,
    _with_fresh_port,
    finish,
    launch_env,
    run_restartable,
    start,
    torchrun_two,
    wait,
)

# waits in a function of its own name, so that its stack can be recognised; hangs only on the
# first run when MARKER is given (the marker file records that a run happened)
SCRIPT = """\
import os, sys, time
marker = sys.argv[1] if len(sys.argv) > 1 else None
def waiting_in_the_script():
    time.sleep(600)
rank = os.environ.get("RANK", "plain")
first = marker is None or not os.path.exists(marker + rank)
if marker:
    open(marker + rank, "w").close()
print(f"started {rank}", flush=True)
if first:
    waiting_in_the_script()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "hangs.py"
    path.write_text(SCRIPT)
    return path


def _descendants_ended(launch) -> None:
    assert launch.proc.poll() is not None
    left = [p for p in psutil.process_iter(["cmdline"]) if str(launch.cmd[-1]) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_a_hung_plain_process_fails_with_its_stack(tmp_path, script):
    launch = start([sys.executable, str(script)], tmp_path / "plain.log", launch_env())
    with pytest.raises(pytest.fail.Exception) as failure:
        wait(launch, time.monotonic() + 3, "the script")
    message = str(failure.value)
    assert message.startswith("the script timed out")
    assert "waiting_in_the_script" in message and "started plain" in message
    _descendants_ended(launch)


@pytest.mark.multiprocess
def test_a_hung_torchrun_launch_shows_both_workers_stacks_and_ends_them(tmp_path, script):
    launch = start(torchrun_two(script, tmp_path / "never"), tmp_path / "two.log", launch_env())
    deadline = time.monotonic() + 60
    # the deadline comes once both workers wait in the script
    while not all((tmp_path / f"never{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.log_tail()
        time.sleep(0.2)
    with pytest.raises(pytest.fail.Exception) as failure:
        wait(launch, time.monotonic() + 1, "torchrun")
    message = str(failure.value)
    # one stack per worker (each process's fault handler), each in the script's function
    assert message.count("waiting_in_the_script") >= 2, message
    _descendants_ended(launch)


def test_a_hang_is_started_again_once_with_a_warning(tmp_path, script):
    launch = start([sys.executable, str(script), str(tmp_path / "ran")], tmp_path / "again.log", launch_env())
    with pytest.warns(UserWarning, match="(?s)the script hung and is started again.*waiting_in_the_script"):
        finish(launch, time.monotonic() + 3, "the script", retry_s=30)
    assert launch.attempts == 2
    assert "waiting_in_the_script" in (tmp_path / "again.log.attempt1").read_text()
    _descendants_ended(launch)
    assert (tmp_path / "again.log").read_text() == "started plain\n"


def test_without_retry_a_hang_fails(tmp_path, script):
    launch = start([sys.executable, str(script), str(tmp_path / "ran")], tmp_path / "once.log", launch_env())
    with pytest.raises(pytest.fail.Exception, match="the script timed out"):
        finish(launch, time.monotonic() + 3, "the script")
    assert launch.attempts == 1


def test_a_failing_launch_fails_at_once_with_its_output(tmp_path):
    launch = start([sys.executable, "-c", "print('before'); raise SystemExit(3)"], tmp_path / "fails.log", launch_env())
    with pytest.raises(pytest.fail.Exception, match="(?s)the script failed \\(3\\).*before"):
        finish(launch, time.monotonic() + 30, "the script", retry_s=30)
    assert launch.attempts == 1


def test_a_launch_that_hangs_twice_fails(tmp_path, script):
    launch = start([sys.executable, str(script)], tmp_path / "twice.log", launch_env())
    with pytest.warns(UserWarning, match="hung and is started again"):
        with pytest.raises(pytest.fail.Exception, match=r"the script \(started again after a hang\) timed out"):
            finish(launch, time.monotonic() + 3, "the script", retry_s=3)
    assert launch.attempts == 2
    _descendants_ended(launch)


def test_a_hung_process_with_children_writes_its_own_stack_too(tmp_path, script):
    # a process with a child of its own (data-loader workers, compile workers) is not a launcher:
    # its stack is what the failure must show
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, {str(script)!r}])\n"
        "def parent_waits_here():\n"
        "    time.sleep(600)\n"
        "parent_waits_here()\n"
    )
    launch = start([sys.executable, str(parent)], tmp_path / "parent.log", launch_env())
    with pytest.raises(pytest.fail.Exception) as failure:
        wait(launch, time.monotonic() + 3, "the parent")
    assert "parent_waits_here" in str(failure.value) and "waiting_in_the_script" in str(failure.value)
    _descendants_ended(launch)


def test_launches_of_a_group_end_with_it(tmp_path, script):
    with pytest.raises(RuntimeError):
        with LaunchGroup() as group:
            launch = group.start([sys.executable, str(script)], tmp_path / "group.log", launch_env())
            raise RuntimeError("a test failing on another launch")
    _descendants_ended(launch)


def test_a_restart_listens_on_a_fresh_port():
    cmd = ["torchrun", "--master_port", "1", "--main_process_port=2", "worker.py", "--master_port"]
    fresh = _with_fresh_port(cmd)
    assert fresh[0] == "torchrun" and fresh[3].startswith("--main_process_port=") and fresh[4:] == cmd[4:]
    assert fresh[2] != "1" and int(fresh[2]) > 0
    assert fresh[3] != "--main_process_port=2" and int(fresh[3].split("=")[1]) > 0


# run by torchrun as ``peer.py OUT MARKER MESSAGE``: each process writes its rank's file into OUT;
# on the first attempt (no MARKER yet) process 1 prints MESSAGE and fails, as a collective whose
# peer never came does
PEER_SCRIPT = """\
import os, sys
out, marker, message = sys.argv[1:]
rank = os.environ["RANK"]
first = not os.path.exists(marker + rank)
open(marker + rank, "w").close()
open(os.path.join(out, "rank" + rank), "w").write("first" if first else "second")
if first and rank == "1":
    print(message, flush=True)
    raise SystemExit(1)
"""


@pytest.fixture
def peer_script(tmp_path):
    path = tmp_path / "peer.py"
    path.write_text(PEER_SCRIPT)
    return path


@pytest.mark.multiprocess
def test_a_restartable_launch_whose_peer_timed_out_starts_again_in_an_empty_directory(tmp_path, peer_script):
    out = tmp_path / "out"
    out.mkdir()
    timeout = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 120000ms for recv operation"
    with pytest.warns(UserWarning, match="(?s)the launch failed on a collective that waited for a peer.*Timed out waiting"):
        run_restartable(peer_script, out, tmp_path / "ran", timeout, max_restarts=0, timeout_s=120, what="the launch")
    # the retry wrote into an empty directory; the first attempt's files and log are kept aside
    assert sorted(p.name for p in out.iterdir()) == ["launch.log", "rank0", "rank1"]
    assert {(out / f"rank{r}").read_text() for r in (0, 1)} == {"second"}
    first = tmp_path / "out.attempt1"
    assert {(first / f"rank{r}").read_text() for r in (0, 1)} == {"first"}
    assert "Timed out waiting" in (first / "launch.log").read_text()


@pytest.mark.multiprocess
def test_a_restartable_launch_failing_otherwise_fails_at_once(tmp_path, peer_script):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(pytest.fail.Exception, match="(?s)the launch failed \\(1\\).*ValueError: wrong shapes"):
        run_restartable(peer_script, out, tmp_path / "ran", "ValueError: wrong shapes", max_restarts=0, timeout_s=120,
                        what="the launch")
    assert not (tmp_path / "out.attempt1").exists()


#: ends with 0 in both processes; process 0 writes ``planned`` into ``out`` from the given start on
PLANNED_SCRIPT = """
import os, sys
out, marker, planned_from = sys.argv[1:]
rank = os.environ["RANK"]
starts = len([p for p in os.listdir(os.path.dirname(marker)) if p.startswith(os.path.basename(marker) + rank)])
open(marker + rank + "-" + str(starts), "w").close()
if rank == "0" and starts + 1 >= int(planned_from):
    open(os.path.join(out, "killed.pt"), "w").close()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("planned_from", [2, 3], ids=["second-start", "never"])
def test_a_launch_that_ends_without_its_planned_failure_starts_again_once(tmp_path, planned_from):
    """A launch whose script was to kill a process and write a file first, and that ended with 0
    without the file, ran its restart for another failure: started again once, then it fails."""
    script = tmp_path / "planned.py"
    script.write_text(PLANNED_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    ran = tmp_path / "ran" / "start"
    ran.parent.mkdir()
    args = (script, out, ran, planned_from)
    if planned_from == 2:
        with pytest.warns(UserWarning, match="the launch ended without the planned failure \\(killed.pt missing\\)"):
            run_restartable(*args, max_restarts=0, timeout_s=120, what="the launch", planned="killed.pt")
        assert (out / "killed.pt").exists() and not (tmp_path / "out.attempt1" / "killed.pt").exists()
    else:
        with pytest.warns(UserWarning), pytest.raises(
            pytest.fail.Exception, match="the launch \\(started again\\) ended without the planned failure"
        ):
            run_restartable(*args, max_restarts=0, timeout_s=120, what="the launch", planned="killed.pt")
    assert len(list(ran.parent.iterdir())) == 4  # two starts of two processes
