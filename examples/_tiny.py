"""The small model and synthetic data the tool examples share: a stack of residual MLP blocks
classifying random points, so each example runs in seconds on a CPU."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Classifier(nn.Module):
    def __init__(self, features: int = 16, dim: int = 32, blocks: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def datasets(n_train: int = 256, n_eval: int = 64, features: int = 16, classes: int = 4, seed: int = 0):
    """Points whose class is the sign pattern of a fixed projection: learnable, so metrics move."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_eval, features, generator=g)
    y = (x[:, :2] > 0).long() @ torch.tensor([1, 2]) % classes
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])
