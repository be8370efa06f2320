"""Training script driven by tests/test_reliability_signals.py in a subprocess.

usage: sigterm_train.py MODE STATE_DIR OUT [READY]

* ``full``: train to the end; write the losses and final weights to OUT.
* ``slow``: load with two worker processes; after update 3, create READY and slow every step
  down so that the test can send SIGTERM mid-run; the interrupted run saves its state to
  STATE_DIR and its losses next to it.
* ``linger``: as ``slow``, and on the interruption create READY.interrupted and wait, so that
  the test can send a second SIGTERM.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_run import build_trainer, train_kwargs, weights  # noqa: E402

from fasttrain.callbacks import TrainerCallback  # noqa: E402


class Slow(TrainerCallback):
    def __init__(self, ready: Path, linger: bool):
        self.ready, self.linger = ready, linger
        self.recorder = None

    def on_train_step_end(self, trainer, **kwargs):
        if trainer.num_updates >= 3:
            self.ready.touch()
            time.sleep(0.2)

    def on_training_interrupted(self, trainer, signal_number, **kwargs):
        if self.linger:
            torch.save(self.recorder.records, f"{self.ready}.losses.pt")
            Path(f"{self.ready}.interrupted").touch()
            time.sleep(30)  # the test's second SIGTERM ends the process here


def main(mode: str, state_dir: str, out: str, ready: str = None) -> int:
    state_dir, out = Path(state_dir), Path(out)
    losses_before = state_dir.with_name(state_dir.name + ".losses.pt")
    callbacks = [Slow(Path(ready), linger=mode == "linger")] if mode in ("slow", "linger") else []
    trainer, recorder = build_trainer(callbacks=callbacks, interrupt_save_dir=str(state_dir))
    for callback in callbacks:
        callback.recorder = recorder
    torch.manual_seed(123)
    # "slow" loads with workers: the test signals the whole process group, as a terminal's
    # Ctrl-C or a cluster scheduler does, and the workers must not take the run down
    workers = {"train_dataloader_kwargs": {"num_workers": 2}} if mode == "slow" else {}
    trainer.train(**train_kwargs(**workers))
    if trainer.stop_reason == "interrupted":
        torch.save(recorder.records, losses_before)
        return 0
    torch.save({"losses": recorder.records, "weights": weights(trainer)}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
