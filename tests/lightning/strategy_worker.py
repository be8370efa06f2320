"""Run under ``torchrun --nproc_per_node 2``: fit a LightningModule with a layer its loss never
uses under each DDP strategy argument, and save what the test compares: the trainer's strategy
object as Lightning's callbacks see it, the weights, or the error a fit raised.

Usage: strategy_worker.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_modules import QUIET, Classifier, classification_data, loader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402


class WithUnusedLayer(Classifier):
    """A layer the loss never uses: DDP needs find_unused_parameters=True to train it."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(6, 6)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _seen(trainer) -> dict:
    strategy = trainer.strategy
    return {
        "class": [cls.__name__ for cls in type(strategy).__mro__ if cls.__module__.startswith("lightning")][0],
        "is_ddp": isinstance(strategy, DDPStrategy),
        "ranks": (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank),
        "sampler": strategy.distributed_sampler_kwargs,
        "root_device": str(strategy.root_device),
        "parallel_devices": [str(d) for d in strategy.parallel_devices],
        "ddp_kwargs": dict(strategy._ddp_kwargs),
        "device_ids": trainer.device_ids,
    }


def fit(strategy) -> dict:
    torch.manual_seed(0)
    module = WithUnusedLayer()
    trainer = Trainer(max_epochs=1, strategy=strategy, devices=2, accelerator="cpu", **QUIET)
    try:
        # per process 4 samples a batch: the two processes together take the reference's batch of 8
        trainer.fit(module, loader(classification_data(n=32), batch_size=4))
    except RuntimeError as error:
        return {"error": str(error), **_seen(trainer)}
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state_dict": state, "global_step": trainer.global_step, **_seen(trainer)}


def main(out: Path) -> None:
    results = {
        "name": fit("ddp_find_unused_parameters_true"),
        "object": fit(DDPStrategy(find_unused_parameters=True)),
        "plain": fit("ddp"),
    }
    rank = int(__import__("os").environ["RANK"])
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
    from worker_common import finish_worker

    finish_worker()
