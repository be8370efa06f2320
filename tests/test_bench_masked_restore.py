"""benchmarks/kernels/bench_masked_restore.py: its CPU correctness run and what it reports."""

import os
import sys

import kernel_cases as C  # first: may set TRITON_INTERPRET before triton is imported
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "kernels"))

import bench_masked_restore as B  # noqa: E402


@C.requires_interpreter
def test_cpu_run_checks_every_implementation_and_reports_every_case(tmp_path):
    assert B.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "bench_masked_restore.md").read_text()
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in text.splitlines() if line.startswith("| gpt2") or line.startswith("| 50 ")]
    assert rows == [
        [tensors, flag, impl]
        for tensors in ("gpt2-tiny adam", "50 small sgd-momentum")
        for flag in ("down", "up")
        for impl in B.IMPLS
    ]
    # the tiny GPT-2 set: each parameter with two moments and a step counter
    assert f"equal over {4 * len(B.gpt2_grad_shapes(**B.GPT2_TINY))} tensors" in text
    assert "CPU run: correctness and host time only" in text


@C.requires_interpreter
@pytest.mark.parametrize("broken", ["restores with the flag down", "restores nothing"])
def test_correctness_check_fails_on_a_wrong_restore(broken):
    import fasttrain.kernels as K

    impls = B.implementations(K, interpreted=True)
    save, restore = impls["fused"]
    if broken == "restores nothing":
        impls["fused"] = (save, lambda tensors, snapshot, found_inf: None)
    else:
        impls["fused"] = (save, lambda tensors, snapshot, found_inf: restore(tensors, snapshot, torch.ones(1)))
    with pytest.raises(AssertionError, match="fused: with the flag"):
        B.check_correct(impls, torch.device("cpu"))
