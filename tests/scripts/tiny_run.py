"""A tiny, deterministic training run shared by the reliability tests and their subprocesses.

The model has dropout (so the global random stream matters after a resume), the data loader
shuffles, the optimizer has state (momentum) and a OneCycle scheduler sized by placeholders, and
gradients are accumulated over two micro-steps: everything a step-exact resume must restore.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import Dataset, TensorDataset

from fasttrain import Trainer, TrainerPlaceholderValues
from fasttrain.callbacks import SaveTrainingStateCallback, StopTrainingError, TrainerCallback

#: train_kwargs for one epoch without evaluation or a scheduler
SMALL = dict(num_epochs=1, eval_data=False, scheduler=False)


def make_dataset(n: int = 24, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, y)


class CountingDataset(Dataset):
    """Counts how many samples were loaded."""

    def __init__(self, base):
        self.base = base
        self.loads = 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        self.loads += 1
        return self.base[index]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.25), nn.Linear(8, 4))

    def forward(self, x):
        return self.net(x)


class LossRecorder(TrainerCallback):
    """Collects ``(phase, epoch, step, loss)`` from the batched flushes (host values, no sync)."""

    def __init__(self):
        self.records: List[Tuple[str, int, int, float]] = []
        self.skipped: List[int] = []

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        for step, loss in zip(metrics.step_indices, metrics.losses):
            self.records.append((metrics.phase, metrics.epoch, step, loss))
        self.skipped.append(metrics.skipped_updates)


class SaveAndStop(TrainerCallback):
    """Saves the training state at a chosen moment and ends the run there, as a crash would
    right after a save. ``step`` is the 0-based micro-step of ``epoch``; with ``at_epoch_end``
    the state is taken in ``on_train_epoch_end`` of ``epoch``."""

    def __init__(self, path, epoch: int, step: int = None, at_epoch_end: bool = False, stop: bool = True):
        self.path, self.epoch, self.step = path, epoch, step
        self.at_epoch_end, self.stop = at_epoch_end, stop

    def _act(self, trainer):
        trainer.save_training_state(str(self.path))
        if self.stop:
            raise StopTrainingError("test: stopping right after the save")

    def on_train_step_end(self, trainer, step, **kwargs):
        if not self.at_epoch_end and trainer.run_history.current_epoch == self.epoch and step == self.step:
            self._act(trainer)

    def on_train_epoch_end(self, trainer, **kwargs):
        if self.at_epoch_end and trainer.run_history.current_epoch == self.epoch:
            self._act(trainer)


def build_trainer(model_seed: int = 0, callbacks=(), optimizer: str = "sgd", **trainer_kwargs):
    torch.manual_seed(model_seed)
    model = Net()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    recorder = LossRecorder()
    trainer_kwargs.setdefault("engine", "eager")
    trainer = Trainer(model, nn.MSELoss(), opt, callbacks=[recorder, *callbacks], **trainer_kwargs)
    return trainer, recorder


def train_kwargs(num_epochs: int = 3, scheduler: bool = True, eval_data: bool = True, **overrides) -> dict:
    kwargs = dict(
        train_dataset=make_dataset(24, seed=0),
        num_epochs=num_epochs,
        eval_dataset=make_dataset(8, seed=1) if eval_data else None,
        per_device_batch_size=4,
        gradient_accumulation_steps=2,
        train_dataloader_kwargs={"num_workers": 0},
        eval_dataloader_kwargs={"num_workers": 0},
    )
    if scheduler:
        kwargs["create_scheduler_fn"] = functools.partial(
            OneCycleLR,
            max_lr=0.1,
            epochs=TrainerPlaceholderValues.NUM_EPOCHS,
            steps_per_epoch=TrainerPlaceholderValues.NUM_UPDATE_STEPS_PER_EPOCH,
        )
    kwargs.update(overrides)
    return kwargs


def trained_small() -> Trainer:
    """A trainer after one :data:`SMALL` run."""
    trainer, _ = build_trainer()
    torch.manual_seed(0)
    trainer.train(**train_kwargs(**SMALL))
    return trainer


class StopAtUpdate(TrainerCallback):
    """Ends the run after update ``n``."""

    def __init__(self, n: int):
        self.n = n

    def on_train_step_end(self, trainer, **kwargs):
        if trainer.num_updates == self.n:
            raise StopTrainingError("stop")


def keep_last_two_run(save_dir, stop_at_update: int = None, resume_from=None) -> None:
    """Two epochs without evaluation or a scheduler, saving the training state into ``save_dir``
    after every update and keeping the last two; ended after ``stop_at_update`` if given (after
    that update's save), resumed from ``resume_from`` if given."""
    saver = SaveTrainingStateCallback(save_dir=str(save_dir), save_every_n_steps=1, max_checkpoints=2, save_at_end=False)
    stop = [] if stop_at_update is None else [StopAtUpdate(stop_at_update)]
    trainer, _ = build_trainer(callbacks=[saver, *stop])
    resume = {} if resume_from is None else {"resume_from": str(resume_from)}
    trainer.train(**train_kwargs(num_epochs=2, eval_data=False, scheduler=False), **resume)


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()}
