"""A tiny stack of identical blocks, for the activation-checkpointing and regional-compile tests."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, blocks=3, dim=8, dropout=0.1):
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_losses(engine="eager", steps=6, dropout=0.1, **trainer_options):
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
    model = Stack(dropout=dropout)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 4), torch.randn(4 * steps, 1))
    losses = Losses()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[losses], engine=engine, log_every_n_steps=100, **trainer_options)
    torch.manual_seed(1)
    trainer.train(data, num_epochs=1, per_device_batch_size=4,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False})
    return losses.values, trainer


class CausalBlock(nn.Module):
    """A pre-norm causal self-attention block (no dropout: compiled and eager runs compare)."""

    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    """Four causal blocks and a final LayerNorm before the head: the shape of GPT-2 and Llama."""

    def __init__(self, vocab=32, dim=16, blocks=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def causal_lm_weights(engine="eager", batches=8, **trainer_options):
    """The weights of a seeded CausalLM after ``batches`` batches of 4 (accumulation 2, clipping
    by norm), trained through the Trainer."""
    from fasttrain.trainer import Trainer

    torch.manual_seed(0)
    model = CausalLM()
    tokens = torch.randint(0, 32, (4 * batches, 9))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    trainer = Trainer(model, token_loss, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                      callbacks=(), engine=engine, **trainer_options)
    trainer.train(data, num_epochs=1, per_device_batch_size=4, gradient_accumulation_steps=2,
                  gradient_clip_norm=1.0, train_dataloader_kwargs={"num_workers": 0, "shuffle": False})
    return {name: p.detach().clone() for name, p in model.named_parameters()}, trainer
