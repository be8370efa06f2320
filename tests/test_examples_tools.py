"""Each tool example runs at its tiny size and shows what it claims."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module", autouse=True)
def _examples_on_path():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_tracking_example(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trainer = _load("tracking").main(["--out", str(tmp_path), "--epochs", "1"])
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard" / "tracking-example").iterdir())
    if importlib.util.find_spec("mlflow"):
        assert (tmp_path / "mlruns").is_dir()
    assert len(trainer.run_history.get_metric_values("eval_loss_epoch")) == 1


def test_profiling_example(tmp_path):
    profiler = _load("profiling").main(["--out", str(tmp_path), "--engine", "eager"])
    assert profiler.trace_paths == [str(tmp_path / "trace_0.json")]


def test_activation_checkpointing_example():
    losses, peaks = _load("activation_checkpointing").main([])
    assert losses[True] == pytest.approx(losses[False], abs=1e-6)
    assert peaks[True] < 0.6 * peaks[False]


def test_regional_compile_example():
    torch._dynamo.reset()
    trainer = _load("regional_compile").main(["--blocks", "2"])
    assert len(trainer.run_history.get_metric_values("train_loss_epoch")) == 1


@pytest.mark.skipif(importlib.util.find_spec("torchmetrics") is None, reason="needs torchmetrics")
def test_device_metrics_example():
    trainer = _load("device_metrics").main()
    accuracy = trainer.run_history.get_metric_values("eval_accuracy_epoch")
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
