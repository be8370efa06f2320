"""AccelerateTrackerCallback end to end: TensorBoard event files and an MLflow file store read back."""

import importlib.util

import pytest
import torch

from fasttrain.callbacks import PER_STEP_EVENTS, TrainerCallback, get_default_callbacks
from fasttrain.callbacks.trackers import AccelerateTrackerCallback
from fasttrain.loggers import TensorBoardLoggerCallback
from fasttrain.trainer import Trainer

needs_tb = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="needs mlflow")


@pytest.fixture(scope="module", autouse=True)
def _release_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def _train(callback, engine="eager", epochs=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    train = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    valid = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    trainer = Trainer(
        model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
        callbacks=list(get_default_callbacks(progress_bar=False)) + [callback],
        engine=engine, log_every_n_steps=2,
    )
    trainer.train(train, num_epochs=epochs, eval_dataset=valid, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0}, eval_dataloader_kwargs={"num_workers": 0},
                  gradient_clip_value=None)
    return trainer


def _read_tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_no_per_step_events():
    for event in PER_STEP_EVENTS:
        assert getattr(AccelerateTrackerCallback, event) is getattr(TrainerCallback, event)


def test_unknown_tracker_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="not_a_tracker"):
        AccelerateTrackerCallback("not_a_tracker", logging_dir=tmp_path)
    with pytest.raises(TypeError, match="wandb"):
        AccelerateTrackerCallback("tensorboard", logging_dir=tmp_path, init_kwargs=["x"])


@needs_tb
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_tensorboard_events_read_back(tmp_path, engine):
    trainer = _train(TensorBoardLoggerCallback(tmp_path), engine=engine)
    scalars = _read_tensorboard(tmp_path)
    history = trainer.run_history
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))  # 4 steps x 2 epochs
    assert [s for s, _ in scalars["eval/loss"]] == list(range(1, 5))
    for name in ("train_loss_epoch", "eval_loss_epoch"):
        assert [s for s, _ in scalars[f"epoch/{name}"]] == [1, 2]
        torch.testing.assert_close([v for _, v in scalars[f"epoch/{name}"]], history.get_metric_values(name),
                                   rtol=1e-6, atol=0)  # stored as float32


@needs_mlflow
def test_mlflow_file_store_read_back(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the local, offline store
    cb = AccelerateTrackerCallback("mlflow", project_name="tiny", logging_dir=store,
                                   config={"lr": 0.01, "batch_size": 4}, finish_at_run_end=True)
    trainer = _train(cb)
    client = MlflowClient(tracking_uri=store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params == {"lr": "0.01", "batch_size": "4"}
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 9))
    epoch_losses = sorted(client.get_metric_history(run.info.run_id, "epoch/train_loss_epoch"), key=lambda m: m.step)
    assert [m.value for m in epoch_losses] == pytest.approx(trainer.run_history.get_metric_values("train_loss_epoch"))
    assert mlflow.active_run() is None


@needs_tb
def test_only_process_zero_starts_trackers(tmp_path):
    class _Rank1:
        class run_config:
            is_world_process_zero = False

        from fasttrain.tracking import InMemoryRunHistory

        run_history = InMemoryRunHistory()

    cb = AccelerateTrackerCallback("tensorboard", logging_dir=tmp_path)
    cb.on_training_run_start(_Rank1())
    cb.on_training_run_end(_Rank1())
    assert cb.trackers == [] and list(tmp_path.iterdir()) == []


@needs_tb
def test_evaluate_alone_writes_and_closes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cb = TensorBoardLoggerCallback(tmp_path)
    trainer = Trainer(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01),
                      callbacks=[cb], engine="eager")
    trainer.evaluate(torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), per_device_batch_size=4,
                     dataloader_kwargs={"num_workers": 0})
    assert cb.trackers == []
    scalars = _read_tensorboard(tmp_path)
    assert [v for _, v in scalars["epoch/evaluation_loss"]] == pytest.approx(
        trainer.run_history.get_metric_values("evaluation_loss"))
    assert [s for s, _ in scalars["eval/loss"]] == [1, 2]
