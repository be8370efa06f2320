"""Ctrl-C during `fasttrain bench`: a prompt stop that keeps only the repeats every peer finished."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_promptly_and_keeps_completed_repeats(tmp_path, signum):
    """SIGTERM is what a time limit sends (``timeout``, run_gpu.sh's steps, a scheduler): it must
    keep the completed repeats as Ctrl-C does, not end the process with nothing written."""
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
        proc.send_signal(signum)
        sent = time.monotonic()
        proc.wait(timeout=60)
        stopped_in = time.monotonic() - sent
        stdout = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=5)
    # fasttrain's trainer takes the signal itself while its peer runs (it finishes the step), so
    # which one came is known only when the runner's handler got it
    expected = {signal.SIGINT: {130}, signal.SIGTERM: {130, 143}}[signum]
    assert proc.returncode in expected, stdout + "".join(stderr)
    assert stopped_in < 15
    assert "INTERRUPTED" in stdout and "kept the" in stdout
    data = json.loads((out / "mlp-tiny.json").read_text())
    assert data["interrupted"] is True
    assert data["settings"]["stopped_by"] in {signum.name, "a stop signal"}
    completed = data["completed_repeats"]
    assert 2 <= completed < 100000
    for peer in data["peers"]:
        # the repeat that Ctrl-C cut short is gone for every peer, not only the one it hit
        assert peer["status"] == "ok"
        assert len(peer["step_times"]) + peer["invalid_repeats"] == completed
    assert re.search(rf"INTERRUPTED( \([a-zA-Z ]+\))? after {completed} of 100000 repeats", (out / "mlp-tiny.md").read_text())
