"""benchmarks/run_gpu.sh: its options and refusals, what it leaves in the output folder (and
nowhere else), results written step by step, and the result file it assembles and joins."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import write_result as W  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")

#: what the GPU machine brings back from its output folder
MAX_FILES = 8
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
#: the steps of the bench part that cost minutes on a CPU, cut to one second
FAST_BENCH = {"RUN_GPU_LIMIT_S_BENCH_MLP": "1", "RUN_GPU_LIMIT_S_BENCH_CONVNET": "1"}


def _env(**env):
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}


def _sh(*args, **env):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=600, env=_env(**env))


def _git_status():
    result = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    )
    return result.stdout if result.returncode == 0 else None


def _limits():
    """The script's step limits, parts and budgets, read from its source."""
    text = open(SCRIPT).read()
    table = text[text.index("declare -A LIMIT_S=("):]
    table = table[: table.index("\n)")]
    limits = {name: int(value) for name, value in re.findall(r"\[([a-z0-9-]+)\]=(\d+)", table)}
    cases = text[text.index("part_steps() {"):]
    cases = cases[: cases.index("esac")]
    parts = {part: steps.split() for part, steps in re.findall(r"^\s+([a-z-]+)\) echo ([a-z0-9 -]+) ;;$", cases, re.M)}
    scalar = {k: int(v) for k, v in re.findall(r"^(PART_BUDGET_S|SETUP_LIMIT_S|KILL_AFTER_S)=(\d+)$", text, re.M)}
    return limits, parts, scalar


def test_every_part_ends_well_inside_nine_minutes_when_every_step_times_out():
    limits, parts, scalar = _limits()
    assert set(parts) == {"tests", "check", "check-gpt", "bench", "bench-gpt", "overhead"}
    assert sorted(s for steps in parts.values() for s in steps) == sorted(limits)  # every step has a limit
    for part, steps in parts.items():
        total = sum(limits[s] for s in steps)
        assert total <= scalar["PART_BUDGET_S"], part
        # set-up, every step killed at the end of its grace, and 10 s to rewrite the results per step
        worst = scalar["SETUP_LIMIT_S"] + total + (len(steps) + 1) * (scalar["KILL_AFTER_S"] + 10)
        assert worst <= 8.5 * 60, (part, worst)


def _all_schedule():
    """--part all's slots from the script's source: [(reserved, [[(step, limit), ...] per lane])]."""
    text = open(SCRIPT).read()
    block = text[text.index("ALL_SCHEDULE='") + len("ALL_SCHEDULE='"):]
    block = block[: block.index("'")]
    slots = []
    for line in block.splitlines():
        if not line.strip():
            continue
        reserved = line.startswith("#")
        lanes = [[(item.split("=")[0], int(item.split("=")[1])) for item in lane.split()]
                 for lane in line.lstrip("#").split("|")]
        slots.append((reserved, lanes))
    scalar = {k: int(v) for k, v in re.findall(
        r"^(ALL_BUDGET_S|SETUP_LIMIT_S|KILL_AFTER_S|COLLECT_S|FIRST_COLLECT_S|BENCH_MARGIN_S)=(\d+)$", text, re.M)}
    return slots, scalar


def test_part_all_fits_nine_minutes_as_its_gpu_schedule_shows():
    """One device session has 15 minutes, machine start included, and 10 per command: --part all
    must end within 9 minutes from cold caches even when every step runs out of its time. The CPU
    mode shows the GPU run's schedule."""
    slots, scalar = _all_schedule()
    result = _sh("--part", "all", "--device", "cpu", "--gpu-sizes", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("== schedule of --part all: each step's limit on CUDA")
    shown = {m.group(1).strip(): int(m.group(2)) for m in (re.match(r"^   (.+?)\s+(\d+) s$", l) for l in lines) if m}
    per_step = scalar["KILL_AFTER_S"] + scalar["COLLECT_S"]
    worst = scalar["SETUP_LIMIT_S"] + scalar["KILL_AFTER_S"] + scalar["FIRST_COLLECT_S"]
    assert shown[f"set-up={scalar['SETUP_LIMIT_S']}"] == worst
    for reserved, lanes in slots:
        # side by side, a slot takes its longest lane
        slot = max(sum(limit + per_step for _, limit in lane) for lane in lanes)
        label = " | ".join(" ".join(f"{n}={l}" for n, l in lane) for lane in lanes)
        assert shown[("reserved: " if reserved else "") + label] == slot, label
        worst += slot
    assert worst <= scalar["ALL_BUDGET_S"] == 9 * 60
    assert f"worst case (every step out of time, killed after {scalar['KILL_AFTER_S']} s, " in result.stdout
    assert result.stdout.count(f": {worst} s of 540 s") == 1
    # the correctness checks run beside pytest; the benches each alone
    first = slots[0][1]
    assert [n for n, _ in first[0]] == ["pytest-gpu"] and {n for n, _ in first[1]} == {"check-mlp", "check-hf-gpt2"}
    assert [reserved for reserved, _ in slots] == [False] * len(slots)
    assert all(len(lanes) == 1 and len(lanes[0]) == 1 for _, lanes in slots[1:])
    # every bench is told its limit (3x on this CPU) less the margin, and the GPU run's sizes
    commands = {line.split(" (limit ")[0]: line for line in lines if " (limit " in line}
    assert set(commands) == {n for reserved, lanes in slots if not reserved for lane in lanes for n, _ in lane}
    for reserved, lanes in slots:
        for name, limit in (item for lane in lanes for item in lane):
            if reserved or name in ("bench-clip", "bench-loss-accum", "bench-masked-restore") or not name.startswith("bench-"):
                continue
            assert f"--time-limit {3 * limit - scalar['BENCH_MARGIN_S']}" in commands[name]
    assert "--size 124m --batch-size 16 --precision bf16" in commands["bench-hf-gpt2"]
    assert "--peers bare,compiled-model,fasttrain-cudagraph,fasttrain-compiled " in commands["bench-hf-gpt2"]
    # the MLP bench times the peers of the MLP targets, and Lightning's own loop
    targets = {peer for table, a, b, _ in W.TARGETS if table == "mlp-small" for peer in (a, b)}
    peers = commands["bench-mlp"].split("--peers ")[1].split()[0].split(",")
    assert set(peers) == targets | {"lightning"} and peers[0] == "bare"
    assert "--sizes cuda" in commands["check-hf-gpt2"]


def test_the_host_overhead_bench_runs_every_engine_in_its_part_and_a_commented_line_only_reserves(tmp_path):
    result = _sh("--part", "overhead", "--dry-run")
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("bench-overhead (limit 60s): "))
    assert "bench --device cuda" in line and "--workload overhead" in line and "--time-limit 52" in line
    assert "--peers bare,compiled,compiled-model,cudagraph,pytorch-accelerated,lightning," in line
    # the masked skip's undo, at its full sizes on CUDA
    line = next(l for l in result.stdout.splitlines() if l.startswith("bench-masked-restore (limit 40s): "))
    assert "benchmarks/kernels/bench_masked_restore.py --device cuda --out " in line and "--tiny" not in line
    result = _sh("--part", "all", "--dry-run")
    assert result.returncode == 0 and "reserved:" not in result.stdout
    # commenting a line out keeps its room in the worst case without running it
    text = open(SCRIPT).read()
    assert text.count("\nbench-loss-accum=12\n") == 1
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "run_gpu.sh"  # the script runs from the repository it lies in
    script.write_text(text.replace("\nbench-loss-accum=12\n", "\n#bench-loss-accum=12\n"))
    result = subprocess.run(["bash", str(script), "--part", "all", "--dry-run"],
                            capture_output=True, text=True, timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
    assert "reserved: bench-loss-accum=12" in result.stdout
    assert not any(l.startswith("bench-loss-accum (limit") for l in result.stdout.splitlines())


def test_help_lists_the_options_and_parts():
    result = _sh("--help")
    assert result.returncode == 0
    for word in ("--device", "--part", "--wheels", "--tiny", "OUT", "check-gpt", "bench-gpt", "--merge", "--dry-run", "all:"):
        assert word in result.stdout
    # the whole header, to its last line
    assert result.stdout.rstrip().endswith("set up (one line says what is missing).")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus", "/tmp/x"], "unknown option --bogus"),
        (["--part", "everything", "/tmp/x"], "--part must be one of tests check check-gpt bench bench-gpt overhead all"),
        (["--device", "tpu", "/tmp/x"], "--device must be cuda or cpu"),
        (["--device", "cpu"], "give the output folder as the argument"),
        (["/tmp/x", "/tmp/y"], "one output folder only"),
    ],
)
def test_bad_options_exit_2_with_one_line(args, message):
    result = _sh(*args)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr


def test_an_output_folder_inside_the_working_copy_is_refused():
    result = _sh("--device", "cpu", "--tiny", os.path.join(ROOT, "bench_out", "refused"))
    assert result.returncode == 2 and "lies inside the working copy" in result.stderr
    assert not os.path.exists(os.path.join(ROOT, "bench_out", "refused", "result.md"))


def test_cuda_mode_without_a_gpu_says_so(tmp_path):
    result = _sh("--device", "cuda", str(tmp_path))
    if result.returncode == 2:
        assert "nvidia-smi was not found" in result.stderr or "torch sees no CUDA device" in result.stderr
    else:
        pytest.skip("a CUDA device is present")


def test_missing_wheels_folder_stops_before_any_step(tmp_path):
    result = _sh("--device", "cpu", "--tiny", "--wheels", str(tmp_path / "none"), str(tmp_path / "o"))
    assert result.returncode == 2
    assert "--wheels" in result.stderr and "no such folder" in result.stderr
    assert not (tmp_path / "o" / "run.json").exists()


@pytest.mark.slow
def test_a_part_writes_few_files_to_the_given_folder_only_and_a_timeout_loses_one_step(tmp_path):
    before = _git_status()
    other = tmp_path / "env-out"  # the GPU machine's $OUT, when the folder given is another one
    other.mkdir()
    dest, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    result = _sh("--device", "cpu", "--tiny", "--part", "bench", str(dest), OUT=str(other), TMPDIR=str(scratch),
                 **FAST_BENCH)
    assert result.returncode == 1, result.stderr
    files = sorted(os.listdir(dest))
    assert files == ["result.md", "run.json", "run.log"]  # the kernel benchmarks write no CSV
    assert len(files) <= MAX_FILES and all(NAME.match(f) and (dest / f).is_file() for f in files)
    assert all((dest / f).stat().st_size < 1 << 20 for f in files)
    assert list(other.iterdir()) == []
    assert list(scratch.iterdir()) == []  # the scratch folder is removed at the end
    assert _git_status() == before  # nothing written under the working copy, ignored files included
    text = (dest / "result.md").read_text()
    assert "| bench | bench-mlp | TIMED OUT (exit 124) | " in text
    assert "| bench | bench-convnet | TIMED OUT (exit 124) | " in text
    assert re.search(r"\| bench \| bench-clip \| ok \| \d+ \| \d+ \| 180 \|", text)  # the CPU's limits: 3x
    assert "## Fused gradient clipping" in text and "## Loss gathering" in text
    assert "- command: `bash benchmarks/run_gpu.sh --device cpu --tiny --part bench " in text
    record = json.loads((dest / "run.json").read_text())
    assert [s["name"] for s in record["steps"]] == ["bench-mlp", "bench-convnet", "bench-clip", "bench-loss-accum"]
    assert "== bench-clip (ok" in (dest / "run.log").read_text()


def _kill_session(proc):
    """SIGKILL every process of the session ``proc`` leads: ``timeout`` puts each step in a
    process group of its own, so killing the script's group would leave the step running."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _sid(int(entry)) == proc.pid:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def test_each_step_writes_its_result_before_the_next_starts(tmp_path):
    """A part killed during its second step (the GPU machine's 10-minute limit) keeps the first."""
    dest = tmp_path / "out"
    env = _env(RUN_GPU_LIMIT_S_BENCH_MLP="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        ["bash", SCRIPT, "--device", "cpu", "--tiny", "--part", "bench", str(dest)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    result = dest / "result.md"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if result.exists() and "bench-mlp" in result.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the part ended before its second step"
    finally:
        _kill_session(proc)
    text = result.read_text()
    assert "| bench | bench-mlp | TIMED OUT (exit 124) |" in text and "bench-convnet" not in text
    assert sorted(os.listdir(dest)) == ["result.md", "run.json", "run.log"]
    deadline = time.monotonic() + 10  # killed processes take a moment to be reaped
    while [e for e in os.listdir("/proc") if e.isdigit() and _sid(int(e)) == proc.pid] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [e for e in os.listdir("/proc") if e.isdigit() and _sid(int(e)) == proc.pid]  # nothing left running


def _sid(pid):
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


# ---------------------------------------------------------------------------- write_result.py


def _scratch(tmp_path, steps):
    """A run's scratch folder as run_gpu.sh leaves it."""
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "steps.tsv").write_text("".join("\t".join(map(str, step)) + "\n" for step in steps))
    for name, *_ in steps:
        (work / "steps" / name).mkdir(parents=True, exist_ok=True)
    return work


ENV = {"device_name": "NVIDIA H100 80GB HBM3", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0+cu130",
       "triton": "3.6.0", "python": "3.12.3", "platform": "Linux"}


def test_collect_folds_steps_into_few_files_and_keeps_earlier_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "environment", lambda device: dict(ENV))
    out = tmp_path / "out"
    out.mkdir()
    work = _scratch(tmp_path, [
        ("pytest-gpu", 0, 12, 450, "tests", 30),
        ("check-mlp", 1, 40, 180, "check", 35),
        ("bench-gpt", 124, 240, 240, "bench-gpt", 900),
        ("check-mlp", 0, 38, 180, "check", 33),  # run again: the latest outcome counts
    ])
    (work / "logs" / "pytest-gpu.log").write_text("..F.\nFAILED tests/test_x.py::test_y - boom\n1 failed, 12 passed, 3 skipped in 11.0s\n")
    (work / "logs" / "bench-gpt.log").write_text("compiling\nstill compiling\n")
    (work / "steps" / "check-mlp" / "check.md").write_text("# title\n\n| table |\nall checks passed\n")
    (work / "steps" / "check-mlp" / "check.json").write_text(json.dumps(
        {"runs": [{"workload": "mlp", "precision": "fp32", "engine": "compiled", "weight_rel_diff": 1e-7, "seconds": 3.0}]}
    ))
    (work / "steps" / "bench-gpt" / "gpt-124m.csv").write_text("peer,status,steps_per_s_median\nbare,ok,2.0\n")
    assert W.main(["--work", str(work), "--out", str(out), "--device", "cuda", "--command", "bash run_gpu.sh A"]) == 0
    assert sorted(os.listdir(out)) == ["bench.csv", "check.csv", "result.md", "run.json", "run.log"]
    text = (out / "result.md").read_text()
    assert text.startswith(f"# fasttrain GPU run, {json.loads((out / 'run.json').read_text())['date']}")
    assert "- device: NVIDIA H100 80GB HBM3 (driver 580.1, CUDA 13.0)" in text and "triton 3.6.0" in text
    assert "- command: `bash run_gpu.sh A`" in text
    assert "| check | check-mlp | ok | 38 | 33 | 180 |" in text
    assert "| bench-gpt | bench-gpt | TIMED OUT (exit 124) | 240 | 900 | 240 |" in text
    assert "`1 failed, 12 passed, 3 skipped in 11.0s`" in text and "- FAILED tests/test_x.py::test_y - boom" in text
    assert "## Engine checks: mlp (benchmarks/gpu_check.py)" in text and "all checks passed" in text
    assert "- bench-gpt: TIMED OUT (exit 124); last line of its log: `still compiling`" in text
    assert (out / "check.csv").read_text().splitlines()[1].startswith("check-mlp,mlp,fp32,compiled,,,1e-07,")
    assert (out / "bench.csv").read_text().splitlines() == ["step,table,peer,status,steps_per_s_median", "bench-gpt,gpt-124m,bare,ok,2.0"]
    # a second part into the same folder adds its steps and command, keeping the first part's
    work2 = _scratch(tmp_path / "2", [("bench-clip", 0, 30, 80, "bench")])  # without CPU seconds
    (work2 / "steps" / "bench-clip" / "bench_clip.md").write_text("# clip\n\n| clip table |\n")
    W.main(["--work", str(work2), "--out", str(out), "--device", "cuda", "--command", "bash run_gpu.sh B"])
    text = (out / "result.md").read_text()
    assert "`bash run_gpu.sh A`" in text and "`bash run_gpu.sh B`" in text
    assert "| check | check-mlp | ok |" in text and "| bench | bench-clip | ok | 30 | n/a | 80 |" in text
    assert text.index("## pytest -m gpu") < text.index("## Engine checks") < text.index("## Fused gradient clipping")


def _part(folder, steps, env=ENV, date="2026-11-26", command="c"):
    folder.mkdir(parents=True)
    record = {"device": "cuda", "date": date, "environment": env, "commands": [command], "steps": steps}
    (folder / "run.json").write_text(json.dumps(record))
    return str(folder)


def _step(name, part, status="0", rows=(), section="table"):
    return {"name": name, "part": part, "status": status, "seconds": "9", "limit": "100", "section": section,
            "rows": list(rows), "log": "last line"}


def test_merge_joins_the_parts_into_the_dated_result_file_with_the_targets(tmp_path):
    rows = [
        {"table": "hf-gpt2-124m", "peer": p, "status": "ok", "steps_per_s_median": v}
        for p, v in (("bare", "1.0"), ("compiled-model", "2.0"), ("fasttrain-compiled", "2.2"), ("fasttrain-cudagraph", "1.8"))
    ]
    a = _part(tmp_path / "a", [_step("pytest-gpu", "tests", section="`5 passed`")], command="bash run_gpu.sh --part tests")
    b = _part(tmp_path / "b", [_step("bench-hf-gpt2", "bench-gpt", rows=rows)], command="bash run_gpu.sh --part bench-gpt")
    results = tmp_path / "results"
    assert W.main(["--merge", a, b, "--results", str(results)]) == 0
    text = (results / "2026-11-26-nvidia-h100-80gb-hbm3.md").read_text()
    assert "`bash run_gpu.sh --part tests`" in text and "`bash run_gpu.sh --part bench-gpt`" in text
    assert "| tests | pytest-gpu | ok |" in text and "| bench-gpt | bench-hf-gpt2 | ok |" in text
    assert "| hf-gpt2-124m | fasttrain-compiled | compiled-model | >= 1.00x | 1.10x | yes |" in text
    assert "| hf-gpt2-124m | fasttrain-cudagraph | compiled-model | >= 1.10x | 0.90x | NO |" in text
    assert "mlp-small" not in text  # no target without its table
    assert sorted(os.listdir(tmp_path / "a")) == ["run.json"]  # the parts' folders are only read


def test_merge_refuses_parts_from_different_gpus(tmp_path):
    a = _part(tmp_path / "a", [_step("pytest-gpu", "tests")])
    b = _part(tmp_path / "b", [_step("check-mlp", "check")], env=dict(ENV, device_name="NVIDIA H200"))
    with pytest.raises(SystemExit, match="different devices"):
        W.main(["--merge", a, b, "--results", str(tmp_path / "r")])


@pytest.mark.slow
def test_the_suite_collects_where_optional_packages_are_missing():
    """The GPU machine lacks pytorch-accelerated (unless carried) and may lack others: every test
    module that needs one skips with a reason; none fails to collect."""
    missing = ["pytorch_accelerated", "mlflow", "transformers", "timm", "torchvision", "torchmetrics",
               "tensorboard", "matplotlib", "lightning", "pytorch_lightning"]
    code = (
        "import sys\n"
        f"for name in {missing!r}:\n    sys.modules[name] = None  # import fails, find_spec says absent\n"
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-rs', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=_env(PYTHONDONTWRITEBYTECODE="1"))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "error" not in result.stdout.splitlines()[-1]
    assert "could not import 'pytorch_accelerated'" in result.stdout


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1" tests="3">
<testcase classname="tests.test_engine_cuda_second_pass" name="test_peak_memory" time="9.1"><failure message="AssertionError: ('cudagraph', 1989.0, 1602.0)&#10;traced allocated peak 1989.0 MiB">long traceback</failure></testcase>
<testcase classname="tests.test_x" name="test_ok" time="0.1"/>
<testcase classname="tests.test_y" name="test_setup" time="0.1"><error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>"""


def test_the_pytest_section_carries_each_failures_whole_message_from_the_junit_report(tmp_path, monkeypatch):
    # the summary's FAILED lines are cut to the terminal's width and run.log keeps only the log's
    # end, so a failing GPU test's diagnostics reach the result file through pytest's JUnit report
    monkeypatch.setattr(W, "environment", lambda device: dict(ENV))
    out = tmp_path / "out"
    out.mkdir()
    work = _scratch(tmp_path, [("pytest-gpu", 1, 120, 400, "tests", 100)])
    (work / "logs" / "pytest-gpu.log").write_text(
        "F.E\nFAILED tests/test_engine_cuda_second_pass.py::test_peak_memory - Assertio...\n"
        "1 failed, 1 passed, 1 error in 9.3s\n")
    (work / "steps" / "pytest-gpu" / "junit.xml").write_text(JUNIT)
    assert W.main(["--work", str(work), "--out", str(out), "--device", "cuda", "--command", "c"]) == 0
    text = (out / "result.md").read_text()
    assert ("- `tests.test_engine_cuda_second_pass::test_peak_memory`:\n\n  ```\n"
            "  AssertionError: ('cudagraph', 1989.0, 1602.0)\n  traced allocated peak 1989.0 MiB\n  ```") in text, text
    assert "- `tests.test_y::test_setup`:\n\n  ```\n  fixture failed\n  ```" in text
    assert "test_ok" not in text


def test_a_long_failure_message_is_cut_and_says_how_much_was_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "FAILURE_MESSAGE_CHARS", 10)
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    text = W.pytest_section("1 failed in 1s\n", str(junit))
    assert "  AssertionE [... 68 more characters]" in text, text
    assert W.pytest_section("1 failed in 1s\n", str(tmp_path / "missing.xml")) == "`1 failed in 1s`"
    (tmp_path / "cut.xml").write_text(JUNIT[:200])  # a run stopped while pytest wrote it
    assert W.pytest_section("1 failed in 1s\n", str(tmp_path / "cut.xml")) == "`1 failed in 1s`"


def test_the_gpu_tests_step_writes_a_junit_report_where_the_result_file_reads_it():
    with open(os.path.join(ROOT, "benchmarks", "run_gpu.sh")) as f:
        script = f.read()
    assert 'benchmarks/gpu_tests.py --out "$folder" -- -m gpu' in script
