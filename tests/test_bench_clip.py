"""benchmarks/kernels/bench_clip.py: its CPU correctness run and how it judges the GPU targets."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "kernels"))

import bench_clip as B  # noqa: E402


def test_cpu_run_checks_and_reports_every_case(tmp_path):
    assert B.main(["--device", "cpu", "--tiny", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "bench_clip.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| gpt2-tiny") or line.startswith("| 50 small")]
    # per set: the baseline copy and torch's copy_, then fused and torch for each case; value
    # clipping on the GPT-2 set only
    assert len(rows) == (2 + 6) + (2 + 4)
    baseline = [line for line in rows if "copy (" in line]
    assert len(baseline) == 2 and all("the kernels' launch plan | fp32 | triton |" in line and "| 100% |" in line for line in baseline)
    assert "CPU run: correctness and host time only" in text


def test_a_run_stopped_after_its_first_set_keeps_that_sets_rows(tmp_path, monkeypatch):
    # the device run's time limit may stop the bench: what it measured stays in its report
    make_grads = B.make_grads
    made = []

    def stopping_after_one_set(shapes, dtype, device):
        made.append(len(shapes))
        if len(made) == 2:
            raise KeyboardInterrupt("the step's time limit")
        return make_grads(shapes, dtype, device)

    monkeypatch.setattr(B, "make_grads", stopping_after_one_set)
    with pytest.raises(KeyboardInterrupt):
        B.main(["--device", "cpu", "--tiny", "--dtypes", "fp32", "--out", str(tmp_path)])
    text = (tmp_path / "bench_clip.md").read_text()
    assert "- partial: 1 of 2 gradient sets measured so far" in text
    assert len([line for line in text.splitlines() if line.startswith("| gpt2-tiny")]) == 2 + 6
    assert not any(line.startswith("| 50 small") for line in text.splitlines())
    # a whole run says nothing of parts
    monkeypatch.setattr(B, "make_grads", make_grads)
    assert B.main(["--device", "cpu", "--tiny", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
    assert "partial" not in (tmp_path / "bench_clip.md").read_text()


def test_small_set_has_2000_tensors():
    count, cycle = B.SMALL
    assert len(B.small_shapes(count, cycle)) == 2000
    assert len(B.gpt2_grad_shapes(**B.GPT2)) == 148


def test_targets_judged_on_device_time_and_3n_bytes():
    n = 1e9
    copy_bw = {("gpt2-124m", "fp32"): 2e12, ("2000 small", "fp32"): 1e12}
    # 3N bytes in 1.6 ms = 1.875 TB/s, 94% of copy; 1.6x torch foreach
    good = [("gpt2-124m", "norm clip, clipping", "fp32", "fused", 1.6, 1.7, 3 * n, 1.6),
            ("2000 small", "norm clip, clipping", "fp32", "fused", 0.01, 0.1, 3e6, 3.5)]
    lines, met = B.verdicts(good, copy_bw)
    assert met and all(line.endswith("met") for line in lines)
    slow_bw = [("gpt2-124m", "norm clip, clipping", "fp32", "fused", 2.0, 2.1, 3 * n, 1.6)]  # 75% of copy
    assert B.verdicts(slow_bw, copy_bw)[1] is False
    few_x = [("2000 small", "norm clip, clipping", "fp32", "fused", 0.01, 0.1, 3e6, 2.9)]
    assert B.verdicts(few_x, copy_bw)[1] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_clip_is_timed_from_graph_replays():
    # device time needs the call captured; a fallback to timed calls would include host time
    import fasttrain.kernels as K

    grads, _ = B.make_grads(B.small_shapes(*B.SMALL_TINY), torch.float32, torch.device("cuda"))
    timer = B.CudaTimer(warmup_ms=5, rep_ms=20)
    assert timer.device_ms(lambda: K.clip_grad_norm_(grads, -1.0), "fused") > 0
    assert timer.notes == []
