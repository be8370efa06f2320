"""Behaviour that scripts written for pytorch-accelerated 0.1.61 rely on: loader devices, step-based
saves, uneven-evaluation warnings, per-step NaN checks, error types, private helpers and resume."""

import io
import warnings
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer, prepare
from fasttrain.callbacks import (
    LimitEvalStepsCallback,
    LogMetricsCallback,
    MoveModulesToDeviceCallback,
    ProgressBarCallback,
    SaveTrainingStateCallback,
    StopTrainingError,
    TerminateOnNaNCallback,
    TrainerCallback,
    WSDCheckpointCallback,
)
from fasttrain.data import DeviceLoader, with_device_attribute
from fasttrain.finetuning import ModelFreezer, _module_is_batch_norm
from fasttrain.run_config import uneven_eval_batches_message
from fasttrain.schedulers import (
    CosineLrScheduler,
    SchedulerConfigError,
    StatefulSchedulerBase,
    WSDLrScheduler,
)
from fasttrain.tracking import InMemoryRunHistory

NO_WORKERS = {"num_workers": 0}


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _trainer(callbacks=(), cls=Trainer):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return cls(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=list(callbacks))


def _train(trainer, n=12, **kwargs):
    kwargs.setdefault("num_epochs", 1)
    trainer.train(
        _data(n),
        per_device_batch_size=2,
        train_dataloader_kwargs=dict(NO_WORKERS),
        eval_dataloader_kwargs=dict(NO_WORKERS),
        **kwargs,
    )


# ----------------------------------------------------------------------------- loader devices
class _RecordDevices(TrainerCallback):
    def __init__(self):
        self.devices = []

    def on_train_epoch_start(self, trainer, **kwargs):
        self.devices.append(("train", trainer._train_dataloader.device))

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.devices.append(("eval", trainer._eval_dataloader.device))


def test_loaders_have_the_device_of_a_prepared_loader():
    recorder = _RecordDevices()
    trainer = _trainer([recorder])
    _train(trainer, eval_dataset=_data(4, seed=1))
    trainer.evaluate(_data(4, seed=1), per_device_batch_size=2, dataloader_kwargs=dict(NO_WORKERS))
    assert recorder.devices == [("train", trainer.device), ("eval", trainer.device), ("eval", trainer.device)]


def test_a_limited_eval_loader_keeps_the_device():
    # LimitEvalStepsCallback swaps in a slice of the loader at eval-epoch start, before the
    # recorder runs
    recorder = _RecordDevices()
    trainer = _trainer([LimitEvalStepsCallback(1), recorder])
    _train(trainer, eval_dataset=_data(4, seed=1))
    assert recorder.devices[-1] == ("eval", trainer.device)


def test_a_loader_that_refuses_attributes_is_wrapped():
    class Frozen:
        __slots__ = ("batches",)

        def __init__(self):
            self.batches = [torch.ones(1)]

        def __iter__(self):
            return iter(self.batches)

        def __len__(self):
            return 1

    loader = with_device_attribute(Frozen(), torch.device("cpu"))
    assert isinstance(loader, DeviceLoader) and loader.device == torch.device("cpu")
    assert [b.tolist() for b in loader] == [[1.0]]
    plain = torch.utils.data.DataLoader(_data(2))
    assert with_device_attribute(plain, torch.device("cpu")) is plain and plain.device == torch.device("cpu")


# ----------------------------------------------------------------------------- step-based saves
def test_save_every_n_steps_counts_batches(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=3, save_at_end=False)
    _train(_trainer([saver]), n=24, gradient_accumulation_steps=2)  # 12 batches, 6 updates
    names = sorted((p.name for p in tmp_path.iterdir()), key=lambda name: int(name[5:]))
    assert names == ["step_3", "step_6", "step_9", "step_12"]
    metadata = torch.load(tmp_path / "step_3" / "trainer_state.pt", weights_only=True)
    assert (metadata["global_step"], metadata["step_in_epoch"], metadata["num_updates"]) == (3, 3, 1)


def test_a_mid_window_state_resumes_exactly(tmp_path):
    saver = SaveTrainingStateCallback(save_dir=str(tmp_path), save_every_n_steps=3, save_at_end=False)
    full = _trainer([saver])
    _train(full, n=16, gradient_accumulation_steps=2)
    resumed = _trainer()
    with torch.no_grad():
        resumed.model.weight.fill_(5.0)  # overwritten by the state
    _train(resumed, n=16, gradient_accumulation_steps=2, resume_from=str(tmp_path / "step_3"))
    for a, b in zip(full.get_model().parameters(), resumed.get_model().parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- uneven evaluation
def test_uneven_eval_messages():
    assert uneven_eval_batches_message(64, 8, 4) is None
    # 23 samples left for 4 processes of 8: the fourth gets none
    assert "without a batch" in uneven_eval_batches_message(64 + 23, 8, 4)
    # 25 left: all get a batch, one a smaller one
    assert "padding_value" in uneven_eval_batches_message(64 + 25, 8, 4)


class _FakeConfig:
    is_distributed = True
    eval_per_device_batch_size = 8
    num_processes = 4
    eval_total_batch_size = 32


def test_distributed_uneven_evaluation_warns_once_per_setup():
    trainer = _trainer()
    trainer.run_config = _FakeConfig()
    trainer.eval_dataset = list(range(64 + 23))
    with pytest.warns(UserWarning, match="waits forever") as record:
        prepare.check_eval_batch_size(trainer)
    assert len(record) == 1


def test_padded_evaluation_does_not_warn():
    class Sampler:
        even_batches = True

    class Loader:
        batch_sampler = Sampler()

    trainer = _trainer()
    trainer.run_config = _FakeConfig()
    trainer.eval_dataset = list(range(64 + 23))
    trainer._eval_dataloader = Loader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare.check_eval_batch_size(trainer)


# ----------------------------------------------------------------------------- per-step NaN check
def test_overridden_nan_check_runs_every_step_and_warns_once():
    with pytest.warns(UserWarning, match="check_for_nan_after_batch") as record:

        class Counting(TerminateOnNaNCallback):
            def __init__(self):
                super().__init__()
                self.calls = []

            def check_for_nan_after_batch(self, batch_output, step=None):
                self.calls.append(step)
                super().check_for_nan_after_batch(batch_output, step)

    assert len(record) == 1
    callback = Counting()
    _train(_trainer([callback]), n=6, eval_dataset=_data(4, seed=1))
    assert callback.calls == ["training"] * 3 + ["validation"] * 2


def test_overridden_nan_check_can_stop_training():
    with pytest.warns(UserWarning):

        class StopAtSecond(TerminateOnNaNCallback):
            seen = 0

            def check_for_nan_after_batch(self, batch_output, step=None):
                self.seen += 1
                if self.seen == 2:
                    self.triggered = True
                    raise StopTrainingError("custom stop")

    callback = StopAtSecond()
    trainer = _trainer([callback])
    _train(trainer, n=12)
    assert trainer.num_updates == 2 and callback.triggered
    assert trainer.stop_reason == "stop_training_error"


def test_the_inherited_check_raises_on_a_non_finite_loss():
    callback = TerminateOnNaNCallback()
    callback.check_for_nan_after_batch({"loss": torch.tensor(1.0)}, step="training")
    with pytest.raises(StopTrainingError, match="non-finite loss in a training step"):
        callback.check_for_nan_after_batch({"loss": torch.tensor(float("nan"))}, step="training")
    assert callback.triggered


def test_the_default_callback_has_no_per_step_handler():
    # the default stays sync-free: it is not dispatched per step
    assert TerminateOnNaNCallback.on_train_step_end is TrainerCallback.on_train_step_end


# ----------------------------------------------------------------------------- error types
@pytest.mark.parametrize(
    "make",
    [
        lambda opt: WSDLrScheduler(opt, total_steps=100, decay_phase_ratio=1.5),
        lambda opt: WSDLrScheduler(opt, total_steps=0),
        lambda opt: WSDLrScheduler(opt, total_steps=100, lr_min=-0.1),
        lambda opt: CosineLrScheduler(opt, total_num_epochs=0, num_update_steps_per_epoch=3),
    ],
)
def test_scheduler_configuration_errors_are_value_and_assertion_errors(make):
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.01)
    with pytest.raises(SchedulerConfigError) as info:
        make(optimizer)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)


# ----------------------------------------------------------------------------- private helpers
def test_private_helpers_of_the_original():
    assert _module_is_batch_norm(nn.BatchNorm2d(2)) and not _module_is_batch_norm(nn.Linear(1, 1))
    freezer = ModelFreezer(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)))
    assert freezer._convert_idxs(-1, 0) == (0, 2)
    assert freezer._convert_idxs(1, -2) == (1, 1)
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.01)
    scheduler = WSDLrScheduler(optimizer, total_steps=100, num_checkpoints=3, decay_phase_ratio=0.2)
    scheduler._get_checkpoint_info.cache_clear()
    assert scheduler._get_checkpoint_info(30) == (25, 5)  # second period: 25..50
    history = InMemoryRunHistory()
    assert isinstance(history._metrics, defaultdict)
    history._metrics["m"].extend([1, 2])
    assert history.get_metric_values("m") == [1, 2]
    assert history.get_metric_values("never") == [] and "never" not in history.get_metric_names()
    history.reset()
    assert isinstance(history._metrics, defaultdict)


def test_perform_forward_and_backward_passes_scales_like_the_step_loop():
    trainer = _trainer()
    _train(trainer, n=4, gradient_accumulation_steps=2)
    trainer.model.zero_grad()
    x, y = torch.ones(2, 3), torch.zeros(2, 1)
    output = trainer._perform_forward_and_backward_passes((x, y), step=0)
    expected = nn.MSELoss()(trainer.model(x), y) / 2
    grad = torch.autograd.grad(expected, trainer.model.weight)[0]
    torch.testing.assert_close(trainer.model.weight.grad, grad)
    assert output["batch_size"] == 2


def test_overriding_perform_forward_and_backward_passes_warns():
    with pytest.warns(UserWarning, match="does not call: override calculate_train_batch_loss"):

        class Custom(Trainer):
            def _perform_forward_and_backward_passes(self, batch, step):
                pass

    assert issubclass(Custom, Trainer)


# ----------------------------------------------------------------------------- extension points
def test_a_metrics_logger_may_override_how_the_latest_metrics_are_read():
    logged = []

    class Rounded(LogMetricsCallback):
        def _get_latest_metrics(self, trainer, metric_names):
            latest = super()._get_latest_metrics(trainer, metric_names=metric_names)
            return {name: round(value, 1) for name, value in latest.items()}

        def log_metrics(self, trainer, metrics):
            logged.append(metrics)

    _train(_trainer([Rounded]), num_epochs=2)
    assert [list(m) for m in logged] == [["train_loss_epoch"], ["train_loss_epoch"]]
    assert all(v == round(v, 1) for m in logged for v in m.values())


def test_the_modules_moved_to_the_device_may_be_chosen_by_a_subclass():
    asked = []

    class OnlyLoss(MoveModulesToDeviceCallback):
        def _get_modules(self, trainer):
            asked.append(dict(super()._get_modules(trainer=trainer)))
            return [("loss_func", trainer.loss_func)]

    trainer = _trainer([OnlyLoss])
    _train(trainer)
    assert set(asked[0]) >= {"model", "loss_func"}


def test_wsd_checkpoint_paths_may_be_chosen_by_a_subclass(tmp_path):
    class Flat(WSDCheckpointCallback):
        def _get_export_checkpoint_path(self, step, checkpoint_type):
            return self.save_dir / f"{checkpoint_type}-{step}.pt"

    saved = []

    class Recorder:
        run_config = None

        def save_checkpoint(self, path, **kwargs):
            saved.append(path)

        def print(self, *args):
            pass

    callback = Flat(save_dir=tmp_path)
    assert WSDCheckpointCallback(save_dir=tmp_path)._get_training_state_path(5, "wsd_pre_decay") == (
        tmp_path / "checkpoint_5_wsd_pre_decay"
    )
    Recorder.run_config = type("Config", (), {"max_num_train_steps": 10})()
    callback._save_post_decay(Recorder(), 10)
    assert saved == [tmp_path / "wsd_post_decay-10.pt"]


def test_the_progress_bar_advances_when_called_without_a_step():
    bar = ProgressBarCallback(file=io.StringIO())

    class Config:
        max_num_train_steps = None

    class Host:
        class _accelerator:
            is_local_main_process = True

        _train_dataloader = [0, 1, 2]
        run_config = Config()

    bar.on_train_epoch_start(Host())
    bar.on_train_step_end(Host())
    bar.on_train_step_end(Host(), batch=None, batch_output=None)
    assert bar.pbar.n == 2
    bar.on_train_step_end(Host(), step=2)
    assert bar.pbar.n == 3
    bar.pbar.close()


def test_a_stateful_scheduler_takes_its_state_by_the_original_keyword():
    class Constant(StatefulSchedulerBase):
        def get_updated_values(self, num_updates):
            return 0.1

        def state_dict(self):
            return {"_num_updates": self._num_updates}

        def load_state_dict(self, scheduler_state_dict):
            self._num_updates = scheduler_state_dict["_num_updates"]

    scheduler = Constant(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.01))
    scheduler.load_state_dict(scheduler_state_dict={"_num_updates": 7})
    assert scheduler._num_updates == 7
    with pytest.raises(NotImplementedError):  # the abstract method binds the keyword too
        StatefulSchedulerBase.load_state_dict(scheduler, scheduler_state_dict={})


# ----------------------------------------------------------------------------- resume metadata
def test_resume_sets_the_epoch_from_minimal_metadata():
    class MinimalState(Trainer):
        def load_training_state(self, input_dir):
            return {"current_epoch": 3}

    class Epochs(TrainerCallback):
        def __init__(self):
            self.epochs = []

        def on_train_epoch_start(self, trainer, **kwargs):
            self.epochs.append(trainer.run_history.current_epoch)

    recorder = Epochs()
    trainer = _trainer([recorder], cls=MinimalState)
    _train(trainer, n=4, resume_from="unused")
    assert recorder.epochs == [3]
