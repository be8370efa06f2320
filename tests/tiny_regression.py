"""A tiny regression set-up (3 features, one target) and the train() call the Trainer, callback and
step-bookkeeping tests make with it."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

NO_WORKERS = {"num_workers": 0, "shuffle": False}


def sum_data(n, seed=0) -> TensorDataset:
    """``n`` samples of 3 features whose target is their sum plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def tanh_mlp() -> nn.Module:
    """3 -> 8 -> 1 with a tanh, the same weights every time."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def train_on(trainer, train_dataset, eval_dataset=None, bs=4, dl=NO_WORKERS, **kwargs):
    """``trainer.train`` on the datasets in order, in the main process, for two epochs unless
    ``num_epochs`` says otherwise; ``dl``: the training loader's options. Returns the trainer."""
    kwargs.setdefault("num_epochs", 2)
    trainer.train(
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        per_device_batch_size=bs,
        train_dataloader_kwargs=dl,
        eval_dataloader_kwargs=NO_WORKERS,
        **kwargs,
    )
    return trainer
