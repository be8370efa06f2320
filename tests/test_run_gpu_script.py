"""benchmarks/run_gpu.sh's options and refusals, and the result file it assembles."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import write_result as W  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _sh(*args, **env):
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_help_lists_the_options():
    result = _sh("--help")
    assert result.returncode == 0
    for option in ("--device", "--part", "--out", "--wheels", "--results", "--tiny"):
        assert option in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown option --bogus"),
        (["--part", "everything"], "--part must be check, bench or all"),
        (["--device", "tpu"], "--device must be cuda or cpu"),
    ],
)
def test_bad_options_exit_2_with_one_line(args, message):
    result = _sh(*args)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr


def test_cuda_mode_without_a_gpu_says_so(tmp_path):
    result = _sh("--device", "cuda", "--out", str(tmp_path))
    if result.returncode == 2:
        assert "nvidia-smi was not found" in result.stderr or "torch sees no CUDA device" in result.stderr
    else:
        pytest.skip("a CUDA device is present")


def test_missing_wheels_folder_stops_before_any_step(tmp_path):
    result = _sh("--device", "cpu", "--tiny", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "--wheels" in result.stderr and "no such folder" in result.stderr
    assert not (tmp_path / "o" / "steps.tsv").exists()


def test_result_file_collects_steps_and_marks_failures(tmp_path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "check").mkdir()
    (out / "commands.txt").write_text("bash benchmarks/run_gpu.sh --part check\n")
    (out / "steps.tsv").write_text(
        f"pytest-gpu\t0\t12\t{out}/logs/pytest-gpu.log\n"
        f"gpu-check\t1\t40\t{out}/logs/gpu-check.log\n"
        f"bench-gpt\t124\t220\t{out}/logs/bench-gpt.log\n"
        f"gpu-check\t0\t38\t{out}/logs/gpu-check.log\n"  # run again: the latest outcome counts
    )
    (out / "logs" / "pytest-gpu.log").write_text("....\n12 passed, 3 skipped in 11.0s\n")
    (out / "check" / "check.md").write_text("# title\n\n| table |\nall checks passed\n")
    (out / "mlp-small.md").write_text("| peer | steps/s |\n")
    assert W.main(["--out", str(out), "--device", "cpu", "--results", str(tmp_path / "results")]) == 1
    text = (out / "result.md").read_text()
    assert "- command: `bash benchmarks/run_gpu.sh --part check`" in text
    assert "- torch " in text and "triton" in text
    assert "| gpu-check | ok | 38 |" in text
    assert "| bench-gpt | TIMED OUT (exit 124) | 220 |" in text
    assert "`12 passed, 3 skipped in 11.0s`" in text
    assert "## Bench: mlp-small" in text and "all checks passed" in text
    assert text.split("## Failed")[1].strip().startswith("- bench-gpt: TIMED OUT")
    (copy,) = (tmp_path / "results").iterdir()
    assert copy.name.endswith("-cpu.md") and copy.read_text() == text
