"""TrainerWithTimmScheduler tells a timm-style scheduler the update count and the epoch.

(The same calls as pytorch-accelerated's are checked in test_differential.py.)"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from differential_scripts import TimmLikeScheduler
from fasttrain.trainer import TrainerWithTimmScheduler


def test_calls_match_the_documented_sequence():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
    model = nn.Linear(3, 1)
    trainer = TrainerWithTimmScheduler(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1), callbacks=())
    trainer.train(
        data,
        num_epochs=2,
        eval_dataset=data,
        per_device_batch_size=4,
        create_scheduler_fn=TimmLikeScheduler,
        train_dataloader_kwargs={"num_workers": 0, "shuffle": False},
        eval_dataloader_kwargs={"num_workers": 0},
    )
    # 3 batches per epoch: the count starts at epoch * batches and grows by one per update;
    # after each evaluation the scheduler is told the next epoch
    expected = [("step_update", n) for n in (4, 5, 6)] + [("step", 2)]
    expected += [("step_update", n) for n in (7, 8, 9)] + [("step", 3)]
    assert trainer.scheduler.calls == expected
