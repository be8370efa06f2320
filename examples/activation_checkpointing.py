"""Activation checkpointing: the same losses with less memory kept for the backward.

    python examples/activation_checkpointing.py

Trains the same seeded model with and without ``activation_checkpointing=Block`` and prints both
losses and the peak memory of one forward + backward, measured with the profiler.
"""

import argparse

import torch

from fasttrain import Trainer
from fasttrain.checkpoint_activations import apply_activation_checkpointing
from fasttrain.profiling import peak_cpu_memory_bytes

from _tiny import Block, Classifier, datasets


def train(checkpointing: bool, engine: str):
    torch.manual_seed(0)
    model = Classifier()
    train_set, _ = datasets()
    trainer = Trainer(model, torch.nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=0.01),
                      callbacks=[], engine=engine, activation_checkpointing=Block if checkpointing else None)
    trainer.train(train_set, num_epochs=1, per_device_batch_size=32,
                  train_dataloader_kwargs={"num_workers": 0, "shuffle": False})
    return trainer.run_history.get_latest_metric("train_loss_epoch")


def peak_bytes(checkpointing: bool, batch: int = 512) -> int:
    torch.manual_seed(0)
    model = Classifier(dim=64, blocks=8)
    if checkpointing:
        apply_activation_checkpointing(model, Block)
    x = torch.randn(batch, 16)
    return peak_cpu_memory_bytes(lambda: model(x).sum().backward())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="eager")
    args = parser.parse_args(argv)
    losses = {ac: train(ac, args.engine) for ac in (False, True)}
    peaks = {ac: peak_bytes(ac) for ac in (False, True)}
    print(f"train loss without / with checkpointing: {losses[False]:.7f} / {losses[True]:.7f}")
    print(f"peak memory of a step without / with:   {peaks[False] / 2**20:.1f} / {peaks[True] / 2**20:.1f} MiB")
    return losses, peaks


if __name__ == "__main__":
    main()
