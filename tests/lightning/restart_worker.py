"""A Lightning fit that loses a process and is restarted by torchrun; launched by
tests/test_lightning_restart.py.

``ACCELERATE_USE_CPU=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run
--nproc_per_node 2 --max-restarts 1 --rdzv-backend c10d ... restart_worker.py OUT KILL_STEP KILL_RANK``

Every start runs the same ``fasttrain.lightning.Trainer.fit(..., ckpt_path="last")`` with a
``ModelCheckpoint(save_last=True)`` writing ``last.ckpt`` at each epoch's end (3 epochs of 6
batches a process, windows of 2). In the first start process KILL_RANK SIGKILLs itself after
training batch KILL_STEP (counted over the run, from 1; 0: nobody dies, the uninterrupted
reference, which then also records which checkpoint a fit loads when only process 1 sees a
last.ckpt). Each process that finishes writes ``OUT/rank{rank}.pt``: the whole weights, the
optimizer state, the global step, the checkpoint the fit resumed from and the restart count.
"""

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_worker import SyncedClassifier, _full  # noqa: E402
from lightning_modules import QUIET, classification_data, loader  # noqa: E402

from fasttrain.lightning import Trainer  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


class KillAfterBatch(Callback):
    def __init__(self, out: Path, step: int):
        self.out, self.step, self.batches = out, step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        if self.batches == self.step:
            torch.save({"time": time.time(), "rank": RANK}, self.out / "killed.pt")
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: Path, kill_step: int, kill_rank: int) -> None:
    callbacks = [ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)]
    if ATTEMPT == 0 and kill_step and RANK == kill_rank:
        callbacks.append(KillAfterBatch(out, kill_step))
    torch.manual_seed(0)  # the same weights at every start
    module = SyncedClassifier()
    quiet = {**QUIET, "enable_checkpointing": True}
    trainer = Trainer(max_epochs=3, accumulate_grad_batches=2, strategy="ddp", devices=2, accelerator="cpu",
                      callbacks=callbacks, **quiet)
    # not shuffled: a resume at an epoch's start then sees the batches of an uninterrupted run
    trainer.fit(module, loader(classification_data(), batch_size=4), ckpt_path="last")
    optimizer = trainer.optimizers[0]
    optimizer = getattr(optimizer, "optimizer", optimizer)
    result = {
        "attempt": ATTEMPT,
        "ckpt_path": trainer.ckpt_path,
        "global_step": trainer.global_step,
        "state_dict": {k: _full(v.detach()).clone() for k, v in module.state_dict().items()},
        "optimizer": [
            {k: _full(v).clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]
        ],
    }
    if not kill_step:
        result["chosen_with_different_views"] = _chosen_with_different_views(out)
    torch.save(result, out / f"rank{RANK}.pt")


def _chosen_with_different_views(out: Path):
    """The checkpoint a fit with ``ckpt_path="last"`` loads on this process when the processes see
    different folders (as on nodes with disks of their own): process 1 alone has a last.ckpt."""
    folder = out / f"view_of_rank{RANK}"
    folder.mkdir()
    if RANK == 1:
        shutil.copy(out / "checkpoints" / "last.ckpt", folder / "last.ckpt")
    torch.manual_seed(0)
    trainer = Trainer(max_epochs=1, limit_train_batches=1, strategy="ddp", devices=2, accelerator="cpu",
                      callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], **{**QUIET, "enable_checkpointing": True})
    trainer.fit(SyncedClassifier(), loader(classification_data(), batch_size=4), ckpt_path="last")
    return trainer.ckpt_path


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os._exit(0)  # gloo's teardown at exit sometimes aborts; the written results are what counts
