"""Sharded (FSDP2) training with fasttrain: parameters, gradients and optimizer state split
across the processes.

The Trainer is given accelerate's FSDP2 plugin; accelerate applies torch's ``fully_shard`` to
every ``Block`` (its own all-gather and reduce-scatter group) and to the whole model. With one
process nothing is sharded and the script trains as usual. Synthetic data, so it runs anywhere::

    # two processes on the CPU (gloo backend), for trying things out and for tests
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/fsdp2_train.py

    # every GPU of this machine
    torchrun --nproc_per_node 4 examples/fsdp2_train.py

The same configuration can come from an accelerate config file instead (docs/distributed.md):
drop ``accelerator_kwargs`` and run ``accelerate launch --config_file fsdp2.yaml
examples/fsdp2_train.py``.
"""

from __future__ import annotations

import argparse

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer

NUM_FEATURES = 32
WIDTH = 64


class Block(nn.Module):
    """A residual MLP block: the unit FSDP2 shards and gathers on its own."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def make_model(depth: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, WIDTH), *[Block(WIDTH) for _ in range(depth)], nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 1)
    )


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    """A noisy non-linear regression; every process builds the same dataset from the seed and
    accelerate hands each a different part of it."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(NUM_FEATURES, 1, generator=torch.Generator().manual_seed(0))
    x = torch.randn(num_samples, NUM_FEATURES, generator=g)
    return TensorDataset(x, torch.sin(x @ w) + 0.1 * torch.randn(num_samples, 1, generator=g))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer update")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--engine", default="auto", help="eager, compiled, cudagraph or auto")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    model = make_model()
    # after sharding each process holds its shard of every parameter; accelerate points the
    # optimizer built here at the shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    fsdp2 = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,  # free each block's gathered parameters after its forward
    )
    trainer = Trainer(model, nn.MSELoss(), optimizer, engine=args.engine, accelerator_kwargs={"fsdp_plugin": fsdp2})
    trainer.train(
        train_dataset=make_dataset(args.num_samples, seed=1),
        eval_dataset=make_dataset(args.num_samples // 4, seed=2),
        num_epochs=args.epochs,
        per_device_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
    )
    config = trainer.run_config
    trainer.print(
        f"{config.num_processes} process(es), {trainer._accelerator.distributed_type.value}, "
        f"{config.train_total_batch_size} samples per update, {trainer.num_updates} updates, "
        f"eval loss {trainer.run_history.get_latest_metric('eval_loss_epoch'):.4f}"
    )
    return trainer


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
