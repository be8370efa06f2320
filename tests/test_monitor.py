"""ThroughputMonitorCallback: rates and MFU from flushed metrics, nothing per step."""


import pytest
import torch

from fasttrain.callbacks import PER_STEP_EVENTS, CallbackHandler, TrainerCallback
from fasttrain.metrics import FlushedMetrics
from fasttrain.monitor import ThroughputMonitorCallback, throughput
from fasttrain.tracking import InMemoryRunHistory


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    """Trainers here initialise accelerate's process-wide state with mixed_precision="no"; clear
    it afterwards so a later test in the session may ask for another precision."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _metrics(batch_sizes=(4, 4, 4), elapsed_s=2.0, num_items=None, phase="train"):
    n = len(batch_sizes)
    return FlushedMetrics(
        phase=phase, epoch=1, step_indices=list(range(n)), losses=[1.0] * n,
        batch_sizes=list(batch_sizes), num_updates=n, elapsed_s=elapsed_s, num_items=num_items,
    )


class _FakeTrainer:
    def __init__(self):
        self.run_history = InMemoryRunHistory()
        self.device = torch.device("cpu")
        self.run_config = None


def test_samples_per_second():
    assert throughput(_metrics()) == {"throughput_samples_per_s": 6.0}


def test_tokens_flops_and_mfu_from_tokens():
    out = throughput(_metrics(num_items=300), flops_per_token=10.0, flops_per_sample=1e9, peak_flops=3000.0)
    assert out["throughput_samples_per_s"] == pytest.approx(6.0)
    assert out["throughput_tokens_per_s"] == pytest.approx(150.0)
    assert out["flops_per_s"] == pytest.approx(1500.0)  # tokens win over the per-sample figure
    assert out["mfu"] == pytest.approx(0.5)


def test_flops_per_sample_and_no_peak():
    out = throughput(_metrics(batch_sizes=(8, 8), elapsed_s=0.5), flops_per_sample=100.0)
    assert out["throughput_samples_per_s"] == pytest.approx(32.0)
    assert out["flops_per_s"] == pytest.approx(3200.0)
    assert "mfu" not in out
    assert "throughput_tokens_per_s" not in out


def test_empty_flush_gives_nothing():
    assert throughput(_metrics(batch_sizes=(), elapsed_s=1.0)) == {}
    assert throughput(_metrics(elapsed_s=0.0)) == {}


def test_callback_records_into_run_history():
    trainer = _FakeTrainer()
    cb = ThroughputMonitorCallback(flops_per_token=10.0, peak_flops=3000.0, gpu_metrics=False)
    cb.on_training_run_start(trainer)
    cb.on_metrics_flush(trainer, _metrics(num_items=300))
    cb.on_metrics_flush(trainer, _metrics(batch_sizes=(4,), elapsed_s=1.0, num_items=60))
    cb.on_metrics_flush(trainer, _metrics(phase="eval"))  # eval flushes are not training throughput
    h = trainer.run_history
    assert h.get_metric_values("throughput_samples_per_s") == pytest.approx([6.0, 4.0])
    assert h.get_metric_values("throughput_tokens_per_s") == pytest.approx([150.0, 60.0])
    assert h.get_metric_values("mfu") == pytest.approx([0.5, 0.2])
    assert "gpu_utilization" not in h.get_metric_names()
    assert (cb.last_samples_per_s, cb.last_tokens_per_s, cb.last_mfu) == pytest.approx((4.0, 60.0, 0.2))
    assert cb.last_gpu_utilization is None
    cb.on_training_run_end(trainer)


def test_gpu_metrics_unavailable_is_reported_not_raised():
    trainer = _FakeTrainer()
    cb = ThroughputMonitorCallback()
    cb.on_training_run_start(trainer)
    assert cb.gpu_metrics_reason  # CPU device: says why there is no GPU sampling
    cb.on_metrics_flush(trainer, _metrics())
    assert trainer.run_history.get_metric_values("throughput_samples_per_s") == [6.0]
    cb.on_training_run_end(trainer)


def test_no_per_step_events():
    for event in PER_STEP_EVENTS:
        assert getattr(ThroughputMonitorCallback, event) is getattr(TrainerCallback, event)
    handler = CallbackHandler([ThroughputMonitorCallback(gpu_metrics=False)])
    for event in PER_STEP_EVENTS:
        assert handler.handlers(event) == []
    assert len(handler.handlers("on_metrics_flush")) == 1


@pytest.mark.parametrize("kwargs", [{"peak_flops": -1.0}, {"flops_per_sample": "many"}, {"flops_per_token": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="positive number"):
        ThroughputMonitorCallback(**kwargs)


def test_with_trainer():
    from fasttrain.callbacks import get_default_callbacks
    from fasttrain.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    monitor = ThroughputMonitorCallback(flops_per_sample=18.0, peak_flops=1e9)
    trainer = Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=list(get_default_callbacks(progress_bar=False)) + [monitor],
        engine="eager", log_every_n_steps=2,
    )
    trainer.train(data, num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0})
    values = trainer.run_history.get_metric_values("throughput_samples_per_s")
    assert len(values) == 5  # 10 updates / 2 per flush; the epoch-end flush is empty
    assert all(v > 0 for v in values)
    assert monitor.last_mfu == pytest.approx(monitor.last_samples_per_s * 18.0 / 1e9)
