"""A run that loses a process and is restarted by torchrun; launched by tests/test_torchrun_restart.py.

``ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 --max-restarts 1
restart_worker.py OUT MODE SCENARIO KILL_STEP KILL_RANK``

MODE is ``ddp`` or ``fsdp2``. Every start of the script is the same ``train(...,
resume_from="latest")`` with periodic states every 3 steps (2 epochs of 6 batches a process,
windows of 2: the states after steps 3 and 9 are inside a window). In the first start
(``TORCHELASTIC_RESTART_COUNT=0``) SCENARIO decides how a process dies:

* ``none``: nobody dies (the uninterrupted reference); afterwards the processes record what
  each raises when the first one fails to choose a state;
* ``after_step``: process KILL_RANK is SIGKILLed after training step KILL_STEP;
* ``during_save``: process 0 is SIGKILLed inside the save of ``step_6``, after every file and
  the manifest were written to the staging folder and before it takes the state's name.

Each process that finishes writes ``OUT/rank{rank}.pt``: the whole weights and optimizer states,
the state it resumed from, the restart count, the port of the store its process group started
from, and the wall-clock times of its start (``Moments``); the killed process writes the moment it kills itself (and the port) to ``OUT/killed.pt``.
"""

import time

STARTED = time.time()  # before the imports: they are part of what a restart costs

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from datetime import timedelta  # noqa: E402

from accelerate.utils import FullyShardedDataParallelPlugin, InitProcessGroupKwargs  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from fasttrain import Trainer, auto_resume, checkpointing  # noqa: E402
from fasttrain.callbacks import SaveTrainingStateCallback, TrainerCallback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_ckpt_worker import build_model, snapshot  # noqa: E402
from worker_common import dump_stacks_when_stalled, finish_worker  # noqa: E402

IMPORTED = time.time()

NUM_SAMPLES, PER_DEVICE_BATCH, ACCUMULATION, EPOCHS, SAVE_EVERY = 48, 4, 2, 2, 3
#: how long a collective waits for a process that hangs without dying (torch's default for gloo
#: is 30 minutes, for NCCL 10): a hung run then fails, and torchrun restarts it
PROCESS_GROUP_TIMEOUT_S = 120
#: a process still running this long writes its stacks into the launch's log (again each time):
#: before its peer's collective times out, so that a stall shows where it was
STALL_S = PROCESS_GROUP_TIMEOUT_S / 2
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def _die(out: Path, **record) -> None:
    record.update(time=time.time(), rank=RANK, store_port=os.environ["MASTER_PORT"])
    torch.save(record, out / "killed.pt")
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfterStep(TrainerCallback):
    """SIGKILLs this process after its ``step``-th training step of the first start (after the
    periodic save of that step, which comes first in the callback list)."""

    def __init__(self, out: Path, step: int):
        self.out, self.step, self.steps = out, step, 0

    def on_train_step_end(self, trainer, **kwargs):
        self.steps += 1
        if self.steps == self.step:
            _die(self.out)


class Moments(TrainerCallback):
    """Wall-clock times of this start: the script began, its imports were done, the Trainer was
    built (the process group started), the state was loaded and training began, the first
    training step ended."""

    def __init__(self):
        self.times = {"started": STARTED, "imported": IMPORTED}

    def mark(self, name: str) -> None:
        self.times.setdefault(name, time.time())

    def on_training_run_start(self, trainer, **kwargs):
        self.mark("run_started")

    def on_train_step_end(self, trainer, **kwargs):
        self.mark("first_step")


def _kill_during_save(out: Path, name: str) -> None:
    swap = checkpointing._swap_into_place

    def swap_or_die(staging, output_dir):
        if Path(output_dir).name == name:
            _die(out, staging=sorted(p.name for p in Path(staging).iterdir()))
        swap(staging, output_dir)

    checkpointing._swap_into_place = swap_or_die


def main(out: Path, mode: str, scenario: str, kill_step: int, kill_rank: int) -> None:
    moments = Moments()
    callbacks = [
        SaveTrainingStateCallback(str(out / "states"), save_every_n_steps=SAVE_EVERY, save_at_end=False, max_checkpoints=2),
        moments,
    ]
    if ATTEMPT == 0 and scenario == "after_step" and RANK == kill_rank:
        callbacks.append(KillAfterStep(out, kill_step))
    if ATTEMPT == 0 and scenario == "during_save" and RANK == 0:
        _kill_during_save(out, "step_6")
    # the same weights at every start: a run that starts from scratch again equals the reference
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = {"kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))]}
    if mode == "fsdp2":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
    trainer = Trainer(model, torch.nn.MSELoss(), optimizer, callbacks=callbacks, engine="eager", accelerator_kwargs=kwargs)
    moments.mark("trainer_built")
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(NUM_SAMPLES, 8, generator=generator), torch.randn(NUM_SAMPLES, 4, generator=generator))
    trainer.train(
        data,
        num_epochs=EPOCHS,
        per_device_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        train_dataloader_kwargs={"shuffle": True},
        resume_from="latest",
    )
    result = snapshot(trainer)
    result.update(
        attempt=ATTEMPT,
        resumed_from=trainer.progress.resumed_from,
        times=moments.times,
        store_port=os.environ["MASTER_PORT"],
        process_group_timeout=torch.distributed.group.WORLD._get_backend(torch.device("cpu")).options._timeout,
        states=sorted(p.name for p in (out / "states").iterdir()),
    )
    if scenario == "none":
        result["decision_errors"] = _decision_errors(out)
    torch.save(result, out / f"rank{RANK}.pt")


def _decision_errors(out: Path) -> list:
    """What each process raises when the first process fails to choose the state to resume from
    (an unreadable state directory): ``(type, message)``."""

    def unreadable():
        raise PermissionError(f"[Errno 13] Permission denied: '{out / 'states'}'")

    try:
        auto_resume.decided_by_first_process(unreadable)
    except Exception as e:  # recorded for the test
        return [type(e).__name__, str(e)]
    return [None, ""]


if __name__ == "__main__":
    dump_stacks_when_stalled(STALL_S)
    out_dir, mode_arg, scenario_arg, step_arg, rank_arg = sys.argv[1:]
    main(Path(out_dir), mode_arg, scenario_arg, int(step_arg), int(rank_arg))
    finish_worker()
