"""TrainerWithTimmScheduler tells a timm-style scheduler the update count and the epoch."""

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset


class RecordingScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.calls = []

    def step_update(self, num_updates):
        self.calls.append(("step_update", num_updates))

    def step(self, epoch):
        self.calls.append(("step", epoch))


def _run(lib):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model = nn.Linear(3, 1)
    trainer = lib.TrainerWithTimmScheduler(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=()
    )
    trainer.train(
        data,
        num_epochs=2,
        eval_dataset=data,
        per_device_batch_size=4,
        create_scheduler_fn=functools.partial(RecordingScheduler),
        train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
        eval_dataloader_kwargs={"num_workers": 0},
    )
    return trainer.scheduler.calls


def test_calls_match_the_documented_sequence():
    from fasttrain import trainer as ours

    # 3 batches per epoch: the count starts at epoch * batches and grows by one per update;
    # after each evaluation the scheduler is told the next epoch
    expected = [("step_update", n) for n in (4, 5, 6)] + [("step", 2)]
    expected += [("step_update", n) for n in (7, 8, 9)] + [("step", 3)]
    assert _run(ours) == expected


def test_calls_match_pytorch_accelerated():
    original = pytest.importorskip("pytorch_accelerated.trainer")
    from fasttrain import trainer as ours

    assert _run(ours) == _run(original)
