"""benchmarks/gpu_tests.py: pytest run again past a test the process dies in, and the result
file's account of it (benchmarks/write_result.py)."""

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "benchmarks", "gpu_tests.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import write_result as W  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs POSIX signals")

DEMO = '''
import os
import time

import pytest


def test_first():
    pass


@pytest.mark.parametrize("kind", ["abort here", "fine"])
def test_native(kind):
    if kind == "abort here":
        os.write(2, b"terminate called after throwing an instance of 'c10::Error'\\n")
        os.abort()


def test_fails():
    assert 1 == 2


def test_segfaults():
    import ctypes
    ctypes.string_at(0)


def test_last():
    if os.environ.get("DEMO_SLEEP"):
        time.sleep(60)
'''


def _run(tmp_path, *extra, **popen):
    (tmp_path / "test_demo.py").write_text(DEMO)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    env.update(popen.pop("env", {}))
    cmd = [sys.executable, RUNNER, "--out", str(tmp_path / "out"), *extra, "--", "-q", "-p", "no:cacheprovider",
           "-p", "term_as_interrupt", "test_demo.py"]
    return cmd, env


def test_a_crashed_test_is_recorded_and_the_tests_after_it_still_run(tmp_path):
    cmd, env = _run(tmp_path)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout
    crashes = json.loads((tmp_path / "out" / "crashes.json").read_text())
    assert [(c["test"], c["signal"], c["run"]) for c in crashes] == [
        ("test_demo.py::test_native[abort here]", signal.SIGABRT, 1),
        ("test_demo.py::test_segfaults", signal.SIGSEGV, 2),
    ]
    # the native message written to the process's stderr is kept (pytest ran with --capture=sys)
    assert any(line.endswith("terminate called after throwing an instance of 'c10::Error'") for line in crashes[0]["output"])
    # the failure before the second crash keeps its message, which that run's report lost
    assert [(f["test"], f["when"]) for f in crashes[1]["failed_before"]] == [("test_demo.py::test_fails", "call")]
    assert "assert 1 == 2" in crashes[1]["failed_before"][0]["message"] and crashes[0]["failed_before"] == []
    assert any("Fatal Python error: Aborted" in line for line in crashes[0]["output"])
    assert "Fatal Python error: Segmentation fault" in crashes[1]["output"][0]
    # every test ran once: the third run deselected the five that had started before it
    outcomes = {}
    for n in (1, 2, 3):
        path = tmp_path / "out" / f"junit-{n}.xml"
        if not path.exists():  # a run that died wrote no report
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            failed = case.find("failure") is not None
            outcomes[case.get("name")] = "failed" if failed else "passed"
    assert not (tmp_path / "out" / "junit-1.xml").exists() and not (tmp_path / "out" / "junit-2.xml").exists()
    assert outcomes == {"test_last": "passed"}
    assert "1 passed, 5 deselected" in proc.stdout
    assert "gpu_tests.py: run 1 died of signal 6 in test_demo.py::test_native[abort here]" in proc.stdout


def test_a_run_with_no_crash_runs_once_with_pytests_status(tmp_path):
    cmd, env = _run(tmp_path)
    cmd[-1] = "test_demo.py::test_first"
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert sorted(os.listdir(tmp_path / "out")) == ["junit-1.xml", "progress.txt"]
    cmd[-1] = "test_demo.py::test_fails"
    assert subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300).returncode == 1


def test_a_term_to_the_group_ends_pytest_with_its_summary_and_runs_nothing_more(tmp_path):
    cmd, env = _run(tmp_path)
    cmd[-1] = "test_demo.py::test_last"
    env["DEMO_SLEEP"] = "1"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    progress = tmp_path / "out" / "progress.txt"
    deadline = time.time() + 120
    while not (progress.exists() and "start" in progress.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)  # as timeout sends it: to the whole group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "KeyboardInterrupt" in out and "junit-2.xml" not in os.listdir(tmp_path / "out")


def test_the_result_file_names_each_crash_with_its_last_words_and_every_runs_summary(tmp_path):
    folder = tmp_path / "pytest-gpu"
    folder.mkdir()
    (folder / "crashes.json").write_text(json.dumps([
        {"test": "tests/test_a.py::test_x", "signal": 6, "run": 1,
         "output": ["terminate called after throwing an instance of 'c10::Error'", "Fatal Python error: Aborted"],
         "failed_before": [{"test": "tests/test_a.py::test_w", "when": "call", "message": "E  assert 1 == 2"}]},
    ]))
    (folder / "junit-2.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_b" name="test_y" time="1"><failure message="AssertionError: 3 != 4">tb'
        '</failure></testcase></testsuite></testsuites>')
    log = tmp_path / "pytest-gpu.log"
    log.write_text("..\nFatal Python error: Aborted\n.F\nFAILED tests/test_b.py::test_y - AssertionError\n"
                   "1 failed, 1 passed, 3 deselected in 2.0s\n")
    text = W.step_section("pytest-gpu", str(folder), str(log))
    assert text.startswith("1 crash(es); pytest ran 2 time(s), each after the last crash:\n\n"
                           "- `1 failed, 1 passed, 3 deselected in 2.0s`\n")
    assert ("- CRASHED `tests/test_a.py::test_x` (signal 6), the run's last words:\n\n  ```\n"
            "  terminate called after throwing an instance of 'c10::Error'\n  Fatal Python error: Aborted\n  ```") in text
    assert "- FAILED tests/test_b.py::test_y - AssertionError\n- FAILED tests/test_a.py::test_w (in a run that crashed later)" in text
    assert "- `tests/test_a.py::test_w`:\n\n  ```\n  E  assert 1 == 2\n  ```" in text
    assert "- `tests.test_b::test_y`:\n\n  ```\n  AssertionError: 3 != 4\n  ```" in text
    # one run, no crash: the summary line alone, as before
    (folder / "crashes.json").unlink()
    assert W.step_section("pytest-gpu", str(folder), str(log)).startswith("`1 failed, 1 passed, 3 deselected in 2.0s`")
