"""Run under ``torchrun --nproc_per_node 2``: fit a LightningModule with fasttrain.lightning's
Trainer over two gloo processes (DDP through accelerate) and save what the test compares,
including what the trainer reported of the processes in the fit's set-up hooks.

Usage: ddp_worker.py OUT_DIR [STRATEGY [NODES [PRECISION]]]   (STRATEGY: ddp, the default, or
fsdp; NODES: 1, the default, or 2 for two torchrun launches of one process each, as two nodes;
PRECISION: Lightning's, 32-true by default)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_modules import QUIET, Classifier, ReturnsLogits, classification_data, loader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402


class SyncedClassifier(Classifier):
    """Validation metrics averaged over the processes (sync_dist=True)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)


class RecordingClassifier(SyncedClassifier):
    """Records, in the set-up hooks of the first run (the fit), what the trainer says of this
    process: ``(world_size, global_rank, local_rank, is_global_zero)`` per hook. A hook that did
    not run in this process has no entry."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def _record(self, hook: str) -> None:
        trainer = self.trainer
        self.seen.setdefault(
            hook, (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.is_global_zero)
        )

    def prepare_data(self):
        self._record("prepare_data")

    def setup(self, stage):
        self._record("setup")

    def configure_model(self):
        self._record("configure_model")


class HandsOnLogits(ReturnsLogits, RecordingClassifier):
    """Returns its logits beside the loss and records the dtypes ``on_train_batch_end`` is handed."""


def _full(value):
    """A sharded (FSDP2) parameter gathered whole; anything else as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def main(out: Path, strategy: str, nodes: int = 1, precision: str = "32-true") -> None:
    torch.manual_seed(0)
    module = RecordingClassifier() if precision == "32-true" else HandsOnLogits()
    trainer = Trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, strategy=strategy,
                      devices=2 // nodes, num_nodes=nodes, accelerator="cpu", precision=precision, **QUIET)
    # per process 4 samples a batch: the two processes together take the reference's batch of 8
    trainer.fit(module, loader(classification_data(), batch_size=4), loader(classification_data(n=16, seed=1), 4))
    validated = trainer.validate(module, loader(classification_data(n=16, seed=1), 4))
    result = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "state_dict": {k: _full(v.detach()).clone() for k, v in module.state_dict().items()},
        "sharded": any(hasattr(p, "full_tensor") for p in module.parameters()),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "validated": validated,
        "seen": module.seen,
        "node_rank": trainer.node_rank,
        "num_nodes": trainer.num_nodes,
        "device_ids": trainer.device_ids,
        "handed": getattr(module, "handed", None),
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ddp", int(sys.argv[3]) if len(sys.argv) > 3 else 1,
         sys.argv[4] if len(sys.argv) > 4 else "32-true")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    from worker_common import finish_worker

    finish_worker()
