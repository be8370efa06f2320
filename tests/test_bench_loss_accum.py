"""benchmarks/kernels/bench_loss_accum.py: its CPU correctness run and what it reports."""

import os
import sys

import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "kernels"))

import bench_loss_accum as B  # noqa: E402


@C.requires_interpreter
def test_cpu_run_checks_the_kernel_and_reports_every_case(tmp_path):
    assert B.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "bench_loss_accum.md").read_text()
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| step") or line.startswith("| flush")]
    assert [[c.strip() for c in row] for row in rows] == [
        ["step, with ring", "fused"], ["step, with ring", "reference"],
        ["step, counters only", "fused"], ["step, counters only", "reference"],
        ["step, counters only", "host read"], ["flush", "LossCounters.read"],
    ]
    assert f"equal counters and ring over {B.RING + 5} steps" in text
    assert "CPU run: correctness and host time only" in text


@C.requires_interpreter
def test_correctness_check_fails_on_a_kernel_that_drops_the_weight(monkeypatch):
    import fasttrain.kernels as K

    def unweighted(counters, loss, weight, ring=None):
        K.accumulate_loss_reference(counters, loss, torch.ones_like(weight), ring)

    monkeypatch.setattr(K, "accumulate_loss_triton", unweighted)
    with pytest.raises(AssertionError):
        B.check_correct(torch.device("cpu"), calls=20)
