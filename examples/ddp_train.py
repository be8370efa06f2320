"""Data-parallel training with fasttrain: one script, any number of processes.

The script contains nothing distributed: the trainer runs on accelerate, which reads the launcher's
environment, wraps the model in DistributedDataParallel and gives every process its own share of
the batches. Synthetic data, so it runs anywhere::

    # one process (CPU, or the first GPU)
    python examples/ddp_train.py

    # every GPU of this machine
    accelerate launch --multi_gpu --num_processes 4 examples/ddp_train.py
    torchrun --nproc_per_node 4 examples/ddp_train.py

    # two nodes of 8 GPUs (run on each node; NODE0 is the first node's address)
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint NODE0:29500 \\
        --rdzv_id job42 examples/ddp_train.py

    # two processes on the CPU (gloo backend), for trying things out and for tests
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/ddp_train.py

See docs/distributed.md for what the batch size, the accumulation and ``max_num_train_steps`` mean
with several processes.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fasttrain import Trainer, TrainerPlaceholderValues
from fasttrain.schedulers import CosineLrScheduler

NUM_FEATURES = 32
NUM_CLASSES = 4


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    """Gaussian clusters, one per class. Generated from a fixed seed, so every process builds the
    same dataset; accelerate then hands each process a different part of it."""
    g = torch.Generator().manual_seed(seed)
    # overlapping clusters, so that the loss stays well above zero
    centres = 0.3 * torch.randn(NUM_CLASSES, NUM_FEATURES, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=g)
    features = centres[labels] + torch.randn(num_samples, NUM_FEATURES, generator=g)
    return TensorDataset(features, labels)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, 128),
        nn.GELU(),
        nn.Linear(128, 128),
        nn.GELU(),
        nn.Linear(128, NUM_CLASSES),
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer update")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer updates (overrides --epochs)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--engine", default="auto", help="eager, compiled, cudagraph or auto")
    parser.add_argument("--num-workers", type=int, default=0, help="dataloader workers per process")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    train_ds = make_dataset(args.num_samples, seed=1)
    # an odd size: the processes get different numbers of evaluation samples, and the reported
    # loss is still the mean over exactly these samples
    eval_ds = make_dataset(args.num_samples // 4 + 1, seed=2)

    # the same initial weights everywhere (DDP would also broadcast those of process 0)
    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # per-process updates: each process steps its own scheduler once per optimizer update
    scheduler_fn = CosineLrScheduler.create_scheduler_fn(
        num_update_steps_per_epoch=TrainerPlaceholderValues.PER_PROCESS_NUM_UPDATE_STEPS_PER_EPOCH,
        num_warmup_epochs=1 if args.epochs > 1 else 0,
    )

    # seed= gives every process a different random stream (dropout, augmentation)
    trainer = Trainer(model, nn.CrossEntropyLoss(), optimizer, engine=args.engine, seed=args.seed)
    trainer.train(
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        num_epochs=args.epochs,
        max_num_train_steps=args.max_steps,
        per_device_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        gradient_clip_norm=args.clip_norm,
        create_scheduler_fn=scheduler_fn,
        train_dataloader_kwargs={"num_workers": args.num_workers},
        eval_dataloader_kwargs={"num_workers": args.num_workers},
    )

    config = trainer.run_config
    eval_loss = trainer.run_history.get_latest_metric("eval_loss_epoch")
    trainer.print(
        f"{config.num_processes} process(es), {config.train_total_batch_size} samples per update "
        f"({config.train_per_device_batch_size} per process x {config.num_processes} x "
        f"{config.gradient_accumulation_steps} micro-steps), {trainer.num_updates} updates, "
        f"eval loss {eval_loss:.4f} (chance: {math.log(NUM_CLASSES):.4f})"
    )
    return trainer


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
