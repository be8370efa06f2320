"""`fasttrain bench`: the CLI end to end, its output files, and the counters it reports."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from fasttrain.bench.counters import RecompileCounter, SyncCounter
from fasttrain.bench.peers import BASELINE, resolve_peers
from fasttrain.bench.report import CSV_FIELDS, summarize
from fasttrain.bench.runner import BenchResult, PeerResult
from fasttrain.bench.workloads import make_workload
from fasttrain.cli import main

PEERS = "bare,pytorch-accelerated,fasttrain-eager,cudagraph"


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    """Trainers here initialise accelerate's process-wide state with mixed_precision="no"; clear
    it afterwards so a later test in the session may ask for another precision."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    threads = torch.get_num_threads()
    try:
        rc = main([
            "bench", "--workload", "mlp", "--size", "tiny", "--steps", "8", "--warmup", "2",
            "--repeats", "2", "--peers", PEERS, "--out", str(out), "--no-progress",
        ])
    finally:
        torch.set_num_threads(threads)
    return rc, out


def test_cli_runs_end_to_end(bench_run):
    rc, out = bench_run
    assert rc == 0
    written = set(os.listdir(out))
    assert {"mlp-tiny.csv", "mlp-tiny.json", "mlp-tiny.md"} <= written
    assert written <= {"mlp-tiny.csv", "mlp-tiny.json", "mlp-tiny.md", "mlp-tiny.png"}  # png: with matplotlib


def test_json_schema(bench_run):
    _, out = bench_run
    data = json.loads((out / "mlp-tiny.json").read_text())
    assert set(data) == {"environment", "workload", "settings", "peers", "summary", "interrupted", "completed_repeats"}
    assert data["interrupted"] is False and data["completed_repeats"] == 2
    # the command that was run, as typed (main() was called with these arguments)
    assert data["settings"]["command"].startswith("fasttrain bench --workload mlp --size tiny --steps 8")
    assert data["workload"]["workload"] == "mlp" and data["workload"]["size"] == "tiny"
    assert data["settings"]["steps"] == 8 and data["settings"]["repeats"] == 2
    assert data["settings"]["threads"] == 1  # the CPU default
    assert data["settings"]["clock"] == "cpu"  # single-threaded CPU run: process CPU time
    assert data["environment"]["torch"] == torch.__version__
    peers = {p["name"]: p for p in data["peers"]}
    assert list(peers) == ["bare", "pytorch-accelerated", "fasttrain-eager", "cudagraph"]
    bare = peers["bare"]
    assert bare["status"] == "ok" and len(bare["step_times"]) + bare["invalid_repeats"] == 2
    assert bare["host_syncs_per_step"] == 0
    assert peers["cudagraph"]["status"] == "unavailable" and "CUDA" in peers["cudagraph"]["reason"]
    # pytorch-accelerated reads the loss with .item() every step (and checks NaN with bool()).
    assert peers["pytorch-accelerated"]["sync_methods"]["item"] == 1
    for row in data["summary"]:
        assert set(row) == set(CSV_FIELDS)
    summary = {r["peer"]: r for r in data["summary"]}
    if summary["bare"]["status"] == "ok":
        assert summary["bare"]["ratio_vs_bare"] == pytest.approx(1.0)


def test_csv_schema(bench_run):
    _, out = bench_run
    with open(out / "mlp-tiny.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        rows = list(reader)
    assert [r["peer"] for r in rows] == ["bare", "pytorch-accelerated", "fasttrain-eager", "cudagraph"]
    assert rows[-1]["status"] == "unavailable"
    assert rows[0]["items"] == "samples"


def test_table_is_printed(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        main(["bench", "--size", "tiny", "--steps", "4", "--warmup", "1", "--repeats", "1",
              "--peers", "bare", "--out", str(tmp_path), "--no-progress", "--threads", "2"])
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "x bare" in text and "syncs/step" in text and "\nbare " in text
    settings = json.loads((tmp_path / "mlp-tiny.json").read_text())["settings"]
    assert settings["threads"] == 2 and settings["clock"] == "wall"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "must be at least 1"),
        (["--repeats", "x"], "expected a whole number"),
        (["--peers", "bare,nope"], "unknown peer 'nope'"),
        (["--workload", "mlp", "--size", "124m"], "choose one of tiny, small"),
        (["--channels-last"], "convnet only"),
        (["--workload", "resnet"], "invalid choice"),
    ],
)
def test_bad_input_says_what_to_change(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench"] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_console_script_reports_bad_device():
    if torch.cuda.is_available():
        pytest.skip("the error is for machines without CUDA")
    proc = subprocess.run(
        [sys.executable, "-m", "fasttrain.cli", "bench", "--device", "cuda"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "use --device cpu" in proc.stderr


def test_baseline_always_first():
    assert resolve_peers("fasttrain-eager,pta")[0] == BASELINE
    assert resolve_peers("pta,bare") == ["bare", "pytorch-accelerated"]
    assert resolve_peers(None)[0] == BASELINE


def test_summary_ratios():
    bench = BenchResult(
        workload={"workload": "mlp", "size": "tiny", "items": "samples", "items_per_step": 10,
                  "flops_per_step": 100.0},
        settings={},
        peers=[
            PeerResult("bare", step_times=[0.01, 0.02, 0.04]),
            PeerResult("pytorch-accelerated", step_times=[0.04, 0.04, 0.04]),
            PeerResult("fasttrain-eager", step_times=[0.02, 0.02, 0.02]),
            PeerResult("lightning", status="unavailable", reason="not installed"),
        ],
    )
    rows = {r["peer"]: r for r in summarize(bench, peak_flops=1000.0)}
    assert rows["bare"]["steps_per_s_median"] == pytest.approx(50.0)
    assert (rows["bare"]["steps_per_s_min"], rows["bare"]["steps_per_s_max"]) == pytest.approx((25.0, 100.0))
    assert rows["bare"]["items_per_s_median"] == pytest.approx(500.0)
    assert rows["fasttrain-eager"]["ratio_vs_bare"] == pytest.approx(1.0)
    assert rows["fasttrain-eager"]["ratio_vs_pytorch_accelerated"] == pytest.approx(2.0)
    assert rows["pytorch-accelerated"]["mfu"] == pytest.approx(100.0 * 25 / 1000)
    assert rows["lightning"]["status"] == "unavailable" and rows["lightning"]["steps_per_s_median"] is None
    assert rows["fasttrain-eager"]["notes"] is None


def test_a_rows_notes_say_what_compiled_after_warm_up():
    peer = PeerResult("fasttrain-lightning", step_times=[0.01], recompiles=4, notes=["ran on 'cudagraph'"],
                      recompile_reasons={"training_step: ___check_obj_id(self.trainer, 1)": 3})
    bench = BenchResult(workload={"workload": "mlp", "size": "tiny", "items": "samples", "items_per_step": 10},
                        settings={}, peers=[PeerResult("bare", step_times=[0.01]), peer])
    row = {r["peer"]: r for r in summarize(bench)}["fasttrain-lightning"]
    assert row["recompiles_after_warmup"] == 4
    assert row["notes"] == (
        "ran on 'cudagraph'; 4 compile(s) after warm-up: training_step: ___check_obj_id(self.trainer, 1) (x3); "
        "1 frame(s) compiled for the first time"
    )


# ------------------------------------------------------------------------------ workloads


def test_workload_batches_are_views_and_peers_start_equal():
    wl = make_workload("mlp", size="tiny", batch_size=4)
    x, y = wl.dataset.__getitems__([4, 5, 6, 7])
    assert x.shape == (4, 32) and y.shape == (4,)
    assert x.untyped_storage().data_ptr() == wl.dataset.inputs.untyped_storage().data_ptr()
    xs, ys = wl.dataset.__getitems__([7, 1])  # any other order still works
    assert torch.equal(xs[1], wl.dataset.inputs[1]) and torch.equal(ys[0], wl.dataset.targets[7])
    a, b = wl.make_model(), wl.make_model()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_gpt_flops_per_token():
    wl = make_workload("gpt", size="tiny")
    cfg = wl.config
    assert wl.flops_per_token == 6 * cfg["params"] + 12 * cfg["n_layers"] * cfg["d_model"] * cfg["seq_len"]
    assert wl.items_name == "tokens" and wl.items_per_step == wl.batch_size * cfg["seq_len"]
    logits = wl.make_model()(wl.dataset.inputs[:2])
    assert logits.shape == (2, cfg["seq_len"], cfg["vocab"])


# ------------------------------------------------------------------------------ counters


def _train_loop(steps, read_loss):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # AdamW reads its CPU step count with .item(): internal, not counted
        opt.zero_grad()
        if read_loss:
            loss.item()


@pytest.mark.parametrize("steps", [1, 7])
def test_sync_counter_one_per_step(steps):
    with SyncCounter() as counter:
        _train_loop(steps, read_loss=True)
    assert counter.count == steps
    assert dict(counter.by_method) == {"item": steps}


def test_sync_counter_zero_without_reads():
    with SyncCounter() as counter:
        _train_loop(5, read_loss=False)
    assert counter.count == 0


def test_sync_counter_methods_prefix_and_restore():
    t = torch.ones(())
    with SyncCounter() as counter:
        bool(t), float(t), int(t), t.tolist(), t.numpy(), t.cpu()
        if t:
            pass
    assert counter.by_method == {"__bool__": 2, "__float__": 1, "__int__": 1, "tolist": 1, "numpy": 1, "cpu": 1}
    with SyncCounter(path_prefix=os.path.join(os.path.dirname(torch.__file__), "nn")) as elsewhere:
        t.item()
    assert elsewhere.count == 0
    with SyncCounter(skip_cpu_tensors=True) as gpu_only:
        t.item()
    assert gpu_only.count == 0
    for name in ("item", "__bool__", "cpu"):
        assert name not in torch.Tensor.__dict__  # the original (inherited) methods are back
    assert float(t) == 1.0


def test_recompile_counter_stable_and_shape_change():
    torch._dynamo.reset()

    def f(x):
        return torch.sin(x) * 2

    compiled = torch.compile(f, backend="eager")
    compiled(torch.randn(4, 3))  # warm-up
    with RecompileCounter() as stable:
        for _ in range(5):
            compiled(torch.randn(4, 3))
    assert stable.recompiles == 0 and stable.new_graphs == 0
    with RecompileCounter() as changed:
        compiled(torch.randn(5, 3))
    assert changed.recompiles > 0
    assert changed.new_graphs > 0
    assert stable.reasons == []
    assert len(changed.reasons) == 1 and changed.reasons[0].startswith("f: ")
    assert "size" in changed.reasons[0]  # dynamo's words for the guard on the input's shape


class _Scaled:
    scale = 2.0


def test_recompile_counter_names_a_frame_compiled_for_a_changed_python_value():
    torch._dynamo.reset()

    def scaled_sum(x):
        return (x * _Scaled.scale).sum()

    compiled = torch.compile(scaled_sum, backend="eager")
    compiled(torch.ones(3))
    try:
        with RecompileCounter() as first_and_again:
            compiled2 = torch.compile(lambda x: x + 1, backend="eager")
            compiled2(torch.ones(3))  # a frame compiled for the first time: no guard failed
            _Scaled.scale = 3.0
            assert compiled(torch.ones(3)).item() == 9.0
    finally:
        _Scaled.scale = 2.0
    assert first_and_again.recompiles == 2
    assert len(first_and_again.reasons) == 1 and first_and_again.reasons[0].startswith("scaled_sum: ")
    assert "scale" in first_and_again.reasons[0]
