"""ProfilerCallback writes traces of the scheduled steps with any engine; bench --profile reports
top operators and the host-side gap per step."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from fasttrain.bench.profile import StepGap, step_gaps
from fasttrain.profiling import ProfilerCallback, peak_cpu_memory_bytes
from fasttrain.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _train(callback, engine, sync_counter=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
                      callbacks=[callback], engine=engine, log_every_n_steps=100)
    trainer.train(data, num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0})
    return trainer


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_chrome_trace_holds_the_active_steps(tmp_path, engine):
    seen = []
    cb = ProfilerCallback(tmp_path, wait=1, warmup=1, active=3, skip_first=1,
                          on_window=lambda prof: seen.append(len(step_gaps(prof.events()))))
    _train(cb, engine)
    assert cb.trace_paths == [str(tmp_path / "trace_0.json")]
    trace = json.loads((tmp_path / "trace_0.json").read_text())
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    # skip 1, wait 1, warm up 1: steps 3, 4 and 5 are recorded
    assert sorted(e["name"] for e in steps) == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])
    assert seen == [3]


def test_profiling_adds_no_sync_to_the_step(tmp_path, sync_counter):
    counts = []

    class Count(ProfilerCallback):
        def on_train_step_end(self, trainer, **kwargs):
            super().on_train_step_end(trainer, **kwargs)
            counts.append(sync_counter["n"])

    _train(Count(tmp_path, wait=0, warmup=1, active=2, repeat=2), "eager")
    assert len(counts) == 8 and counts[0] == counts[-1]


def test_tensorboard_trace_and_memory_timeline(tmp_path):
    cb = ProfilerCallback(tmp_path, wait=0, warmup=0, active=1, trace="tensorboard", record_memory=True)
    _train(cb, "eager")
    assert [p.endswith(".pt.trace.json") for p in cb.trace_paths] == [True, False]
    assert cb.trace_paths[1].endswith("memory_0.html")


def test_bad_schedule_says_what_to_change():
    with pytest.raises(ValueError, match="active must be an int >= 1"):
        ProfilerCallback(active=0)
    with pytest.raises(ValueError, match="trace must be one of"):
        ProfilerCallback(trace="perfetto")


def _event(name, start, end, device=DeviceType.CPU):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)


def test_step_gap_is_the_time_nothing_runs_on_the_device():
    events = [
        _event("ProfilerStep*", 0, 1000), _event("ProfilerStep*", 1000, 3000),
        # overlapping kernels count once; a kernel crossing the step boundary is split
        _event("k1", 100, 400, DeviceType.CUDA), _event("k2", 300, 500, DeviceType.CUDA),
        _event("k3", 900, 1200, DeviceType.CUDA),
        _event("aten::mm", 0, 1000),  # host ops are ignored when kernels exist
    ]
    assert step_gaps(events) == [StepGap(0, 1.0, 0.5), StepGap(1, 2.0, 0.2)]
    assert step_gaps(events)[1].gap_ms == pytest.approx(1.8)


def test_bench_profile_prints_top_operators_and_gaps(tmp_path, capsys):
    from fasttrain.cli import main

    assert main(["bench", "--profile", "--workload", "mlp", "--device", "cpu", "--engine", "eager",
                 "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Top operators by self time" in out and "aten::" in out
    gap_rows = out.split("Host-side gap per step (device idle):")[1].strip().splitlines()[1:3]
    assert [row.split()[0] for row in gap_rows] == ["0", "1"]
    assert (tmp_path / "profile" / "trace_0.json").exists()


def test_peak_cpu_memory_counts_live_tensors():
    def hold():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a * 2  # 4 MiB more while a is alive
        return b.sum()

    assert 8 * 2**20 <= peak_cpu_memory_bytes(hold) < 9 * 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphed_steps_show_their_kernels(tmp_path, capsys):
    from fasttrain.cli import main

    assert main(["bench", "--profile", "--workload", "mlp", "--device", "cuda", "--engine", "cudagraph",
                 "--warmup", "3", "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = out.split("Host-side gap per step (device idle):")[1].strip().splitlines()[1:4]
    busy = [float(row.split()[2]) for row in rows]
    assert len(busy) == 3 and all(b > 0 for b in busy)  # kernels ran inside each recorded step
