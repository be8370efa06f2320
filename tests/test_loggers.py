"""CSV and TensorBoard loggers: they write exactly what was flushed, and epoch metrics."""

import csv
import importlib.util

import pytest
import torch

from fasttrain.callbacks import PER_STEP_EVENTS, TrainerCallback
from fasttrain.loggers import CSVLoggerCallback, TensorBoardLoggerCallback
from fasttrain.metrics import FlushedMetrics
from fasttrain.tracking import InMemoryRunHistory


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    """Trainers here initialise accelerate's process-wide state with mixed_precision="no"; clear
    it afterwards so a later test in the session may ask for another precision."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


class _FakeTrainer:
    def __init__(self):
        self.run_history = InMemoryRunHistory()
        self.run_config = None


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_writes_exactly_what_was_flushed(tmp_path):
    path = tmp_path / "logs" / "metrics.csv"
    trainer = _FakeTrainer()
    cb = CSVLoggerCallback(path)
    cb.on_training_run_start(trainer)
    losses1 = [0.1 + 1e-17, 2.0 / 3.0, float("nan")]
    cb.on_metrics_flush(trainer, FlushedMetrics(
        phase="train", epoch=1, step_indices=[0, 1, 2], losses=losses1, batch_sizes=[4, 4, 4],
        num_updates=3, grad_norms=[1.5, 0.25, 1e-30]))
    losses2 = [3.25]
    cb.on_metrics_flush(trainer, FlushedMetrics(
        phase="train", epoch=1, step_indices=[3], losses=losses2, batch_sizes=[2], num_updates=4,
        grad_norms=[7.0]))
    cb.on_metrics_flush(trainer, FlushedMetrics(
        phase="eval", epoch=1, step_indices=[0, 1], losses=[0.5, 0.75], batch_sizes=[4, 4], num_updates=4))
    trainer.run_history.update_metric("train_loss_epoch", 1.0 / 3.0)
    cb.on_train_epoch_end(trainer)

    rows = _read(path)
    assert list(rows[0]) == ["phase", "epoch", "kind", "step", "name", "value"]
    train_losses = [r for r in rows if r["phase"] == "train" and r["name"] == "loss"]
    assert [int(r["step"]) for r in train_losses] == [1, 2, 3, 4]
    assert all(r["kind"] == "micro_step" and r["epoch"] == "1" for r in train_losses)
    written = [float(r["value"]) for r in train_losses]
    expected = losses1 + losses2
    assert written[:2] + written[3:] == expected[:2] + expected[3:]  # bit-exact round trip
    assert written[2] != written[2]  # NaN stays NaN
    norms = [(int(r["step"]), float(r["value"])) for r in rows if r["name"] == "grad_norm"]
    assert norms == [(1, 1.5), (2, 0.25), (3, 1e-30), (4, 7.0)]
    assert all(r["kind"] == "update" for r in rows if r["name"] == "grad_norm")
    eval_losses = [(int(r["step"]), float(r["value"])) for r in rows if r["phase"] == "eval"]
    assert eval_losses == [(1, 0.5), (2, 0.75)]
    epoch_rows = [r for r in rows if r["kind"] == "epoch"]
    assert [(r["name"], float(r["value"]), r["step"]) for r in epoch_rows] == [("train_loss_epoch", 1.0 / 3.0, "1")]
    assert len(rows) == 4 + 4 + 2 + 1

    cb.on_training_run_end(trainer)  # nothing new in the history: nothing more written
    assert len(_read(path)) == len(rows)


def test_csv_no_per_step_events():
    for cls in (CSVLoggerCallback, TensorBoardLoggerCallback):
        for event in PER_STEP_EVENTS:
            assert getattr(cls, event) is getattr(TrainerCallback, event)


def test_csv_with_trainer(tmp_path):
    from fasttrain.callbacks import get_default_callbacks
    from fasttrain.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    train = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.randn(24, 1))
    valid = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    path = tmp_path / "run.csv"
    trainer = Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=list(get_default_callbacks(progress_bar=False)) + [CSVLoggerCallback(path)],
        engine="eager", log_every_n_steps=4,
    )
    trainer.train(train, num_epochs=2, eval_dataset=valid, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0},
                  gradient_clip_value=None)
    rows = _read(path)
    train_steps = [int(r["step"]) for r in rows if r["phase"] == "train" and r["name"] == "loss"]
    assert train_steps == list(range(1, 13))  # 6 steps per epoch, 2 epochs
    eval_steps = [r for r in rows if r["phase"] == "eval" and r["name"] == "loss"]
    assert len(eval_steps) == 4
    epoch = {(r["name"], r["step"]): float(r["value"]) for r in rows if r["kind"] == "epoch"}
    history = trainer.run_history
    assert [epoch[("train_loss_epoch", str(e))] for e in (1, 2)] == history.get_metric_values("train_loss_epoch")
    assert [epoch[("eval_loss_epoch", str(e))] for e in (1, 2)] == history.get_metric_values("eval_loss_epoch")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_says_how_to_install(tmp_path):
    with pytest.raises(ImportError, match=r"pip install fasttrain\[tensorboard\]"):
        TensorBoardLoggerCallback(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writes_events(tmp_path):
    trainer = _FakeTrainer()
    cb = TensorBoardLoggerCallback(tmp_path)
    cb.on_training_run_start(trainer)
    cb.on_metrics_flush(trainer, FlushedMetrics(
        phase="train", epoch=1, step_indices=[0], losses=[1.0], batch_sizes=[1], num_updates=1))
    cb.on_training_run_end(trainer)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
