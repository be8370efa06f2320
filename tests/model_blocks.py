"""A tiny stack of identical blocks, for the activation-checkpointing and regional-compile tests."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, blocks=3, dim=8):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_losses(engine="eager", steps=6, **trainer_options):
    """Per-step training losses of a seeded Stack (fp32) through the Trainer."""
    from fasttrain.callbacks import TrainerCallback
    from fasttrain.trainer import Trainer

    class Losses(TrainerCallback):
        def __init__(self):
            self.values = []

        def on_metrics_flush(self, trainer, metrics, **kwargs):
            if metrics.phase == "train":
                self.values.extend(metrics.losses)

    torch.manual_seed(0)
    model = Stack()
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1))
    losses = Losses()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[losses], engine=engine, log_every_n_steps=100, **trainer_options)
    torch.manual_seed(1)
    trainer.train(data, num_epochs=1, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False})
    return losses.values, trainer
