"""The run's counters (fasttrain/progress.py:TrainProgress): their state dict, their reset, and
that the Trainer's counters are the ones in ``trainer.progress``."""

import dataclasses

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from fasttrain.progress import TrainProgress
from fasttrain.resume import ResumePosition

from tiny_regression import NO_WORKERS


def _advanced() -> TrainProgress:
    """A TrainProgress with every field away from its default."""
    return TrainProgress(
        num_updates=12,
        skipped_updates=3,
        step_in_epoch=5,
        run_first_epoch=2,
        epoch_in_progress=4,
        epoch_start_rng={"torch": torch.get_rng_state()},
        epoch_start_loader_iteration=1,
        resume_position=ResumePosition(4, "mid_epoch", 5, {}, None, 0.0, 0, None),
        resumed_from="states/step_4",
        nonfinite_applied=True,
    )


def test_every_field_of_the_test_progress_is_set():
    advanced, fresh = _advanced(), TrainProgress()
    assert [f.name for f in dataclasses.fields(TrainProgress) if getattr(advanced, f.name) == getattr(fresh, f.name)] == []


def test_state_dict_round_trip(tmp_path):
    saved = _advanced()
    state = saved.state_dict()
    assert state == {"num_updates": 12, "skipped_updates": 3}  # the training state's metadata keys
    torch.save(state, tmp_path / "progress.pt")
    restored = TrainProgress()
    restored.load_state_dict(torch.load(tmp_path / "progress.pt", weights_only=True))
    assert restored.state_dict() == state
    # the rest is where the run stands, rebuilt by train() from the saved position
    assert dataclasses.replace(restored, num_updates=0, skipped_updates=0) == TrainProgress()


def test_load_state_dict_reads_a_whole_metadata_and_older_states():
    progress = TrainProgress()
    progress.load_state_dict({"current_epoch": 3, "phase": "epoch_start", "num_updates": 7, "skipped_updates": 1})
    assert (progress.num_updates, progress.skipped_updates) == (7, 1)
    progress.load_state_dict({"current_epoch": 3})  # a state from before the counts were saved
    assert (progress.num_updates, progress.skipped_updates) == (0, 0)


def test_reset_restores_the_defaults_in_place():
    progress = _advanced()
    same = progress
    progress.reset()
    assert progress is same and progress == TrainProgress()


# ----------------------------------------------------------------------------- in a Trainer
class CounterLog(TrainerCallback):
    """The counters as the trainer and its progress show them after each micro-step and flush."""

    def __init__(self):
        self.steps = []
        self.flushes = []

    def on_train_step_end(self, trainer, step, **kwargs):
        progress = trainer.progress
        self.steps.append((step, progress.step_in_epoch, trainer.num_updates, progress.num_updates))

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if metrics.phase == "train":
            self.flushes.append((metrics.num_updates, metrics.skipped_updates, trainer.progress.skipped_updates))


def _nan_dataset() -> TensorDataset:
    """16 samples; sample 9 (batch 2 in batches of 4) makes that batch's gradients NaN."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    y = torch.randn(16, 4, generator=generator)
    x[9, 1] = float("nan")
    return TensorDataset(x, y)


def _trainer(log, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return Trainer(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05), callbacks=[log], engine="eager", **kwargs
    )


def _train(trainer, **kwargs):
    kwargs.setdefault("num_epochs", 2)
    trainer.train(
        _nan_dataset(), per_device_batch_size=4, gradient_accumulation_steps=2,
        train_dataloader_kwargs=NO_WORKERS, **kwargs,
    )


def test_a_trainers_counters_are_those_of_its_progress():
    log = CounterLog()
    trainer = _trainer(log, nonfinite="skip", log_every_n_steps=1)
    progress = trainer.progress
    _train(trainer)
    assert trainer.progress is progress  # reset in place, not replaced
    # 4 batches an epoch, 2 per update, 2 epochs; the window holding the NaN batch is skipped
    assert trainer.num_updates == progress.num_updates == 4
    assert trainer.skipped_updates == progress.skipped_updates == 2
    assert trainer.stop_reason is None
    assert log.steps == [
        (0, 1, 0, 0), (1, 2, 1, 1), (2, 3, 1, 1), (3, 4, 2, 2),
        (0, 1, 2, 2), (1, 2, 3, 3), (2, 3, 3, 3), (3, 4, 4, 4),
    ]
    # a flush after every update and at each epoch end, with the progress's counts
    assert log.flushes == [(1, 0, 0), (2, 1, 1), (2, 1, 1), (3, 1, 1), (4, 2, 2), (4, 2, 2)]
    assert progress.step_in_epoch == 4
    assert progress.run_first_epoch == 1
    assert progress.epoch_in_progress == 2 == trainer.run_history.current_epoch - 1
    assert isinstance(progress.epoch_start_rng["torch"], torch.Tensor)
    assert progress.resume_position is None and not progress.nonfinite_applied


def test_every_train_starts_its_counters_again():
    trainer = _trainer(CounterLog(), nonfinite="skip")
    _train(trainer)
    _train(trainer, num_epochs=1, reset_run_history=False)
    assert trainer.num_updates == trainer.progress.num_updates == 2
    assert trainer.skipped_updates == trainer.progress.skipped_updates == 1
    assert trainer.progress.run_first_epoch == 3 and trainer.progress.epoch_in_progress == 3


def test_a_training_state_keeps_the_progress_counts(tmp_path):
    trainer = _trainer(CounterLog(), nonfinite="skip")
    _train(trainer)
    trainer.save_training_state(tmp_path / "state")
    metadata = torch.load(tmp_path / "state" / "trainer_state.pt", weights_only=True)
    assert (metadata["num_updates"], metadata["skipped_updates"]) == (4, 2)
    other = _trainer(CounterLog(), nonfinite="skip")
    other.load_training_state(tmp_path / "state")
    assert other.progress.state_dict() == trainer.progress.state_dict() == {"num_updates": 4, "skipped_updates": 2}
    assert (other.num_updates, other.skipped_updates) == (4, 2)


def test_a_nonfinite_stop_is_recorded_in_the_progress(tmp_path):
    trainer = _trainer(CounterLog())  # nonfinite="stop"
    _train(trainer)
    assert trainer.stop_reason == "nonfinite_loss" and trainer.progress.nonfinite_applied
    assert trainer.run_history.get_latest_metric("stopped_nonfinite_loss") == trainer.progress.num_updates
    assert trainer.save_training_state(tmp_path / "state") is False
