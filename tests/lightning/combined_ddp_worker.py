"""Run under ``torchrun --nproc_per_node 2``: fit a LightningModule over a dict of two training
loaders (Lightning's default ``"max_size_cycle"``) and validate over a ``CombinedLoader``, with
fasttrain.lightning's Trainer over two gloo processes, and save what the test compares.

Usage: combined_ddp_worker.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from lightning_modules import QUIET, Classifier, classification_data, loader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402


class TwoSources(Classifier):
    """The loss of a combined batch: the mean of its two loaders' losses."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch_idx)
        loss = sum(F.cross_entropy(self(x), y) for x, y in batch.values()) / len(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = sum(F.cross_entropy(self(x), y) for x, y in batch.values()) / len(batch)
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def train_data(batch_size: int) -> dict:
    """32 and 16 samples: 4 and 2 batches of 8 in one process, the same per process in two
    processes of batches of 4."""
    return {"a": loader(classification_data(n=32, seed=0), batch_size), "b": loader(classification_data(n=16, seed=2), batch_size)}


def val_data(batch_size: int) -> CombinedLoader:
    return CombinedLoader({"x": loader(classification_data(n=16, seed=1), batch_size),
                           "y": loader(classification_data(n=16, seed=3), batch_size)}, "min_size")


def main(out: Path) -> None:
    torch.manual_seed(0)
    module = TwoSources()
    trainer = Trainer(max_epochs=2, strategy="ddp", devices=2, accelerator="cpu", **QUIET)
    # per process batches of 4: the two processes together take the reference's batches of 8
    trainer.fit(module, train_data(4), val_data(4))
    result = {
        "global_step": trainer.global_step,
        "num_training_batches": trainer.num_training_batches,
        "batches": module.batches,
        "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    from worker_common import finish_worker

    finish_worker()
