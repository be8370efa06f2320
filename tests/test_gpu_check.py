"""benchmarks/gpu_check.py, the engine checks of the GPU run, in its CPU mode at tiny sizes."""

import functools
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gpu_check as G  # noqa: E402


def _run(engine, active=None, warnings=(), **kw):
    run = G.RunResult("mlp", "fp32", engine, active_engine=active or engine, active_eval_engine=active or engine)
    run.fallback_warnings = list(warnings)
    run.weights = {"w": torch.ones(4)}
    run.losses = [1.0, 0.9]
    run.flushes_after_warmup, run.epoch_ends_after_warmup = 3, 4
    for key, value in kw.items():
        setattr(run, key, value)
    return run


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_mode_runs_and_writes_its_results(tmp_path, capsys):
    status = G.main(
        ["--device", "cpu", "--tiny", "--compile-backend", "aot_eager", "--workloads", "mlp", "--precisions", "fp32",
         "--out", str(tmp_path)]
    )
    assert status == 0, capsys.readouterr().out
    record = json.loads((tmp_path / "check.json").read_text())
    runs = {r["engine"]: r for r in record["runs"]}
    assert record["failures"] == []
    assert runs["cudagraph"]["active_engine"] == "compiled"  # no CUDA graphs on a CPU
    assert any("falls back" in w for w in runs["cudagraph"]["fallback_warnings"])
    assert runs["compiled"]["weight_rel_diff"] <= G.FP32_WEIGHT_RTOL
    assert runs["compiled"]["steps_after_warmup"] > 0 and runs["compiled"]["recompiles_after_warmup"] == 0
    assert "all checks passed" in (tmp_path / "check.md").read_text()


def test_agreeing_runs_pass():
    assert G.judge([_run("eager"), _run("compiled")], CUDA) == []


def test_silent_fallback_fails():
    failures = G.judge([_run("eager"), _run("cudagraph", active="compiled")], CPU)
    assert failures == ["mlp/fp32/cudagraph: fell back to 'compiled' without a warning"]


def test_other_engine_than_asked_fails_even_with_a_warning():
    failures = G.judge([_run("eager"), _run("cudagraph", active="compiled", warnings=["x falls back"])], CUDA)
    assert len(failures) == 2 and "training ran 'compiled'" in failures[0] and "warnings raised" in failures[1]


def test_differing_weights_fail():
    bad = _run("compiled", weights={"w": torch.ones(4) * (1 + 2 * G.FP32_WEIGHT_RTOL)})
    failures = G.judge([_run("eager"), bad], CUDA)
    assert len(failures) == 1 and "final weights differ" in failures[0]


def test_bf16_losses_beyond_noise_fail():
    ok = _run("compiled", precision="bf16", losses=[1.0, 0.9 * (1 + G.BF16_LOSS_MEAN_RTOL)])
    bad = _run("compiled", precision="bf16", losses=[1.0, 0.9 * (1 + 2 * G.BF16_LOSS_MAX_RTOL)])
    assert G.judge([_run("eager", precision="bf16"), ok], CUDA) == []
    assert "losses differ" in G.judge([_run("eager", precision="bf16"), bad], CUDA)[0]


def test_recompiles_and_syncs_over_budget_fail():
    budget = G.SYNCS_PER_FLUSH * 3 + G.SYNCS_PER_EPOCH_END * 4
    assert G.judge([_run("eager", cuda_syncs_after_warmup=budget, host_reads_after_warmup=budget)], CUDA) == []
    failures = G.judge([_run("eager", recompiles_after_warmup=1, cuda_syncs_after_warmup=budget + 1)], CUDA)
    assert len(failures) == 2 and "compiled after the first epoch" in failures[0] and "CUDA syncs" in failures[1]
    assert failures[0].endswith("1 frames compiled after the first epoch (each for the first time)")
    named = _run("eager", recompiles_after_warmup=2, recompile_reasons=["step: ___check_obj_id(self.trainer, 7)"])
    assert G.judge([named], CUDA) == [
        "mlp/fp32/eager: 2 frames compiled after the first epoch (guards that failed: step: "
        "___check_obj_id(self.trainer, 7))"
    ]


def test_weight_difference_is_over_the_whole_state():
    ref = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    assert G.weight_difference({"a": torch.tensor([3.0]), "b": torch.tensor([4.5])}, ref) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="differ in keys"):
        G.weight_difference({"a": torch.tensor([3.0])}, ref)


def test_bad_options_say_what_to_change(capsys):
    with pytest.raises(SystemExit):
        G.parse_args(["--device", "cpu", "--workloads", "resnet"])
    assert "choose from mlp, convnet, gpt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        G.parse_args(["--device", "cpu", "--engines", "compiled"])
    assert "must include eager" in capsys.readouterr().err


def test_results_are_written_after_each_workload_and_precision(tmp_path, monkeypatch):
    """A check stopped part-way (the GPU machine's time limit) keeps the groups that finished."""
    done = []

    def train_once(name, precision, engine, device, sizes, backend="inductor"):
        if precision == "bf16":
            raise KeyboardInterrupt  # stands in for the kill at the time limit
        done.append(engine)
        return _run(engine, active=G.expected_engine(engine, device), workload=name, precision=precision,
                    fallback_warnings=["falls back"] if engine == "cudagraph" else [])

    monkeypatch.setattr(G, "train_once", train_once)
    with pytest.raises(KeyboardInterrupt):
        G.main(["--device", "cpu", "--tiny", "--workloads", "mlp", "--out", str(tmp_path)])
    assert done == ["eager", "compiled", "cudagraph"]
    text = (tmp_path / "check.md").read_text()
    assert "| mlp | fp32 | compiled | compiled/compiled |" in text
    assert "still to run (the check was cut short here): mlp/bf16" in text
    record = json.loads((tmp_path / "check.json").read_text())
    assert [r["engine"] for r in record["runs"]] == ["eager", "compiled", "cudagraph"] and record["failures"] == []


def test_a_workload_whose_package_is_missing_is_not_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    status = G.main(["--device", "cpu", "--tiny", "--workloads", "hf-gpt2", "--precisions", "fp32", "--out", str(tmp_path)])
    assert status == 0
    record = json.loads((tmp_path / "check.json").read_text())
    assert record["runs"] == [] and record["not_run"][0].startswith("hf-gpt2/fp32: transformers is not installed")
    assert "- hf-gpt2/fp32: transformers is not installed" in (tmp_path / "check.md").read_text()


@pytest.mark.slow
def test_transformers_gpt2_cpu_mode(tmp_path, capsys):
    """The engine checks on transformers' GPT-2: compiled trains it to eager's weights, on the
    engine asked for, with nothing compiled after the first epoch."""
    pytest.importorskip("transformers")
    status = G.main(
        ["--device", "cpu", "--tiny", "--compile-backend", "aot_eager", "--workloads", "hf-gpt2", "--precisions",
         "fp32", "--engines", "eager,compiled", "--out", str(tmp_path)]
    )
    assert status == 0, capsys.readouterr().out
    runs = {r["engine"]: r for r in json.loads((tmp_path / "check.json").read_text())["runs"]}
    assert runs["compiled"]["active_engine"] == "compiled" and runs["compiled"]["recompiles_after_warmup"] == 0
    assert runs["compiled"]["weight_rel_diff"] <= G.FP32_WEIGHT_RTOL


def test_reads_in_a_third_party_models_code_are_the_models():
    transformers = pytest.importorskip("transformers")
    from fasttrain.bench.workloads import make_workload

    hf = make_workload("hf-gpt2", device="cpu", batch_size=2).make_model()
    assert G.model_package_dir(hf) == os.path.dirname(os.path.abspath(transformers.__file__))
    assert G.model_package_dir(make_workload("gpt", device="cpu", batch_size=2).make_model()) is None
    run = _run("eager", model_host_reads_after_warmup=5, host_reads_after_warmup=G.sync_budget(_run("eager")))
    assert G.judge([run], CPU) == []
    assert "| 7 (+5 model) | 7 |" in G._row(run)


def test_size_table_can_be_chosen(capsys):
    assert G.parse_args(["--device", "cpu", "--sizes", "cuda"]).sizes == "cuda"
    with pytest.raises(SystemExit):
        G.parse_args(["--device", "cpu", "--sizes", "huge"])
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_cuda_syncs_are_attributed_to_the_frame_that_made_them(tmp_path, monkeypatch):
    """On CUDA, torch's C++ sync check warns from inside the Tensor method, and the innermost
    Python frame is the host-read counter's wrapper: the warning's ``filename`` names
    fasttrain/bench/counters.py whoever read, so transformers' 32 attention-mask syncs per eager
    hf-gpt2 run were held against the budget. Here a C function that warns (``warnings.warn``
    through ``functools.partial``: no Python frame of its own) stands in for that check."""
    import functools
    import warnings

    from fasttrain.bench.counters import RecompileCounter, SyncCounter

    package = tmp_path / "thirdparty_model"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "modeling.py").write_text("def check_mask(mask):\n    return mask.item()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from thirdparty_model import modeling

    sync_check = functools.partial(warnings.warn, "called a synchronizing CUDA operation", UserWarning, 1)
    monkeypatch.setattr(torch.Tensor, "item", sync_check)
    mask = torch.ones(1)
    counter, recompiles = SyncCounter(cuda=False), RecompileCounter()
    with G.WarningLog() as log, counter, recompiles:
        probe = G._Probe(counter, log, recompiles, str(package))
        probe._mark("warm")
        for _ in range(3):
            modeling.check_mask(mask)  # the model's own read
        mask.item()  # the trainer's (this file's) read
        warnings.warn("a fallback, not a sync")
        probe._mark("end")
    # the warning itself names the wrapper, for the model's reads and the trainer's alike
    assert {os.path.basename(w.filename) for w in log if "synchroniz" in str(w.message)} == {"counters.py"}
    warm, end = probe.marks["warm"], probe.marks["end"]
    cuda, model_cuda = end[2] - warm[2], end[7] - warm[7]
    reads, model_reads = end[1] - warm[1], end[6] - warm[6]
    assert (cuda, model_cuda) == (1, 3) and (reads, model_reads) == (1, 3)
    sites = probe.cuda_sites["end"] - probe.cuda_sites["warm"]
    assert sites == {f"{package / 'modeling.py'}:2": 3, f"{os.path.abspath(__file__)}:{_line_of('mask.item()  # the trainer')}": 1}
    assert len(log.records) == 5 and str(log.records[-1].message) == "a fallback, not a sync"


def _line_of(text):
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


def test_syncs_made_while_torch_compiles_are_told_from_the_steps():
    """The first updates of a compiled step compile it; inductor's autotuning waits for the device
    between its timings, and sync-debug mode reports each wait like a host read in the step
    (2139 in the first update of a GPU test). A sync made with the compiler on the stack is the
    compiler's: the log says so. Here a function whose module is inductor's benchmarking module
    stands in for it."""
    import warnings

    sync = functools.partial(warnings.warn, "called a synchronizing CUDA operation", UserWarning, 1)
    compiler = {"__name__": "torch._inductor.runtime.benchmarking", "sync": sync}
    exec(compile("def benchmark(step):\n    sync()\n    step()\n", "benchmarking.py", "exec"), compiler)
    with G.WarningLog() as log:
        compiler["benchmark"](sync)  # two syncs under the autotuner: its own and the step's it times
        sync()  # the step's, with no compiler on the stack
        warnings.warn("not a sync")
    assert log.compiling == [True, True, False, False]
    assert len(log.syncs()) == 3 and len(log.syncs(compiling=True)) == 2 and len(log.syncs(compiling=False)) == 1
