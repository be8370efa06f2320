"""Ctrl-C during `fasttrain bench`: a prompt stop that keeps only the repeats every peer finished."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_stops_promptly_and_keeps_completed_repeats(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # many long repeats: the run could not finish on its own within the test
    proc = subprocess.Popen(
        [sys.executable, "-m", "fasttrain", "bench", "--steps", "30", "--warmup", "2",
         "--repeats", "100000", "--peers", "bare,fasttrain-eager", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    stderr = []
    reader = threading.Thread(target=lambda: stderr.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    try:
        # the progress bar (stderr) names each repeat as it starts; wait until two have completed
        while "repeat 3/100000 fasttrain-eager" not in "".join(stderr):
            assert proc.poll() is None, "".join(stderr)
            assert time.monotonic() < deadline, "the benchmark did not reach its third repeat"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=60)
        stopped_in = time.monotonic() - sent
        stdout = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=5)
    assert proc.returncode == 130, stdout + "".join(stderr)
    assert stopped_in < 15
    assert "INTERRUPTED after" in stdout and "interrupted: kept the" in stdout
    data = json.loads((out / "mlp-tiny.json").read_text())
    assert data["interrupted"] is True
    completed = data["completed_repeats"]
    assert 2 <= completed < 100000
    for peer in data["peers"]:
        # the repeat that Ctrl-C cut short is gone for every peer, not only the one it hit
        assert peer["status"] == "ok"
        assert len(peer["step_times"]) + peer["invalid_repeats"] == completed
    assert f"INTERRUPTED after {completed} of 100000 repeats" in (out / "mlp-tiny.md").read_text()
