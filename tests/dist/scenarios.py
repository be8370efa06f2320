"""Training scenarios run by ``worker.py`` with one process (the reference) or two (under test).

Every scenario builds its data and model from fixed seeds, so that all processes and the
single-process reference start from the same weights and see the same samples, and returns plain
values (floats, lists, CPU tensors) that the worker saves with ``torch.save``.

How accelerate shards the training data, and why the reference sees the same samples: with
``split_batches=False`` (accelerate's default) the prepared dataloader cuts the dataset, in order
(``shuffle=False``), into batches of the per-process size and deals them out in turn: with two
processes and per-process batch ``b``, process 0 gets batches 0, 2, 4, ... and process 1 gets
batches 1, 3, 5, .... Micro-step ``j`` of both processes together therefore covers samples
``[2bj, 2bj + 2b)``, a contiguous block, and one optimizer update with ``k`` accumulation steps
covers the ``2bk`` samples ``[2bku, 2bk(u + 1))``. A single process with batch ``2bk`` and no
accumulation takes exactly those samples in update ``u``, so the natural order of the dataset is
already the right one. The scenarios record the sample indices of every micro-step so that the test
checks this instead of assuming it.
"""

from __future__ import annotations


import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback, get_default_callbacks

N_TRAIN = 32
N_EVAL = 13  # odd: two processes cannot split it evenly
FEATURES = 6
TOKENS = 5
LR = 0.05
LOADER = {"shuffle": False, "num_workers": 0}
EVAL_LOADER = {"num_workers": 0}

# name -> (loss kind, settings with two processes, settings of the one-process reference).
# Every pair takes 8 samples per optimizer update, so both runs make the same updates.
TRAIN_CASES = {
    "k1": ("mse", dict(bs=4, k=1), dict(bs=8, k=1)),
    # clipping is non-linear: only clipping the all-reduced gradient matches one process
    "k2_clip_norm": ("mse", dict(bs=2, k=2, clip_norm=0.05), dict(bs=8, k=1, clip_norm=0.05)),
    "k4_clip_value": ("mse", dict(bs=1, k=4, clip_value=0.02), dict(bs=8, k=1, clip_value=0.02)),
    "tokens_k1": ("tokens", dict(bs=4, k=1), dict(bs=8, k=1)),
    # token-normalised micro-steps: the reference accumulates the same micro-step unions
    "tokens_k2": ("tokens", dict(bs=2, k=2), dict(bs=4, k=2)),
    # 6 updates = 1.5 epochs of 4 updates: epochs = ceil(6 / 4) = 2, stopping mid-epoch
    "max_steps": ("mse", dict(bs=2, k=2, max_steps=6), dict(bs=8, k=1, max_steps=6)),
}
#: cases also run with the compiled engine (two processes), compared with the eager reference;
#: one case only, as compiling dominates the run time (accumulation, clipping and evaluation)
COMPILED_CASES = ("k2_clip_norm",)


def available_engines():
    """``eager``, plus ``compiled`` once fasttrain ships that engine."""
    from fasttrain.engine import ENGINES

    return ["eager"] + (["compiled"] if "compiled" in ENGINES else [])


# ------------------------------------------------------------------------------------ data, models
def regression_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y, torch.arange(n))


def token_data(n: int, seed: int) -> TensorDataset:
    """Sequences of ``TOKENS`` positions, of which a random number (at least one) are real."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, TOKENS, FEATURES, generator=g)
    w = torch.randn(FEATURES, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, TOKENS, generator=g)
    lengths = torch.randint(1, TOKENS + 1, (n,), generator=g)
    mask = (torch.arange(TOKENS) < lengths[:, None]).float()
    return TensorDataset(x, y, mask, torch.arange(n))


def make_model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    layers = [nn.Linear(FEATURES, 16), nn.Tanh()]
    if batch_norm:
        layers.append(nn.BatchNorm1d(16))
    layers.append(nn.Linear(16, 1))
    return nn.Sequential(*layers)


class TokenTrainer(Trainer):
    """A token-normalised loss: squared error summed over real tokens, divided by the number of
    real tokens in this micro-step on all processes (what ``num_items_in_batch`` declares)."""

    def calculate_train_batch_loss(self, batch):
        x, y, mask = batch[0], batch[1], batch[2]
        pred = self.model(x).squeeze(-1)
        local_tokens = mask.sum()
        tokens = local_tokens
        if self.run_config.is_distributed:
            # a collective, not a host read: the normaliser stays on the device
            tokens = self.gather(local_tokens.reshape(1)).sum()
        loss = ((pred - y) ** 2 * mask).sum() / tokens
        return {"loss": loss, "model_outputs": pred, "batch_size": x.size(0), "num_items_in_batch": local_tokens}


# ------------------------------------------------------------------------------------ callbacks
class CommCounter:
    """A DDP communication hook that counts gradient all-reduces, then does the default one.

    DDP calls the hook once per gradient bucket; ``bucket.is_last()`` is true for the last bucket
    of a backward pass, so ``rounds`` counts gradient synchronisations whatever the number of
    buckets, and ``calls == rounds * buckets`` cross-checks it.
    """

    def __init__(self):
        self.calls = 0
        self.rounds = 0

    def hook(self, state, bucket):
        self.calls += 1
        if bucket.is_last():
            self.rounds += 1
        return default_hooks.allreduce_hook(state, bucket)


def find_ddp(model):
    """The DistributedDataParallel module inside whatever wrappers an engine added."""
    seen = model
    for _ in range(5):
        if isinstance(seen, nn.parallel.DistributedDataParallel):
            return seen
        seen = getattr(seen, "_orig_mod", None) or getattr(seen, "module", None)
        if seen is None:
            break
    raise AssertionError(f"no DistributedDataParallel module in {type(model).__name__}")


def compiled_graphs() -> int:
    """Graphs dynamo has compiled so far in this process (recompiles included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class Recorder(TrainerCallback):
    """Records the sample indices of each micro-step and eval step (the last batch element), the
    flushes, and optionally registers a comm hook once the model is wrapped."""

    def __init__(self, comm_counter: CommCounter = None, record_indices: bool = True):
        self.comm_counter = comm_counter
        self.record_indices = record_indices
        self.train_steps = []  # (epoch, step, num_updates after the step, indices)
        self.eval_indices = []
        self.train_step_count = 0
        self.eval_step_count = 0
        self.flushes = 0
        self.epoch_end_global_means = {}  # phase -> the flushed all-process epoch mean, per epoch
        self.phase = "setup"

    def on_training_run_start(self, trainer, **kwargs):
        if self.comm_counter is not None:
            find_ddp(trainer.model).register_comm_hook(None, self.comm_counter.hook)

    def on_train_epoch_start(self, trainer, **kwargs):
        self.phase = "train"
        if trainer.run_history.current_epoch == 2:
            self.graphs_before_epoch_2 = compiled_graphs()

    def on_training_run_end(self, trainer, **kwargs):
        self.graphs_at_end = compiled_graphs()

    def on_train_step_end(self, trainer, batch, batch_output, step, **kwargs):
        self.train_step_count += 1
        if self.record_indices:
            self.train_steps.append((trainer.run_history.current_epoch, step, trainer.num_updates, batch[-1].tolist()))

    def on_eval_epoch_start(self, trainer, **kwargs):
        self.phase = "eval"
        self.eval_batches_this_epoch = 0

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.eval_step_count += 1
        self.eval_batches_this_epoch += 1
        if self.record_indices:
            self.eval_indices.extend(batch[-1].tolist())

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        self.flushes += 1
        if metrics.is_epoch_end:
            self.epoch_end_global_means.setdefault(metrics.phase, []).append(metrics.global_epoch_mean_loss)


class MultiDeviceJoinGuard(TrainerCallback):
    """During evaluation epochs, makes accelerate believe it runs on several accelerators.

    On the CPU accelerate's ``join_uneven_inputs`` does nothing; on GPUs it wraps the loop in
    torch's ``Join``, whose DDP hook makes the processes that finish early post the all-reduces of
    a backward pass that never comes in evaluation, and the run hangs. Switching the GPU code path
    on here turns that hang into a test failure (timeout) should the trainer ever join again.
    """

    def on_eval_epoch_start(self, trainer, **kwargs):
        self._saved = Accelerator.__dict__["multi_device"]
        Accelerator.multi_device = property(lambda self: True)

    def on_eval_epoch_end(self, trainer, **kwargs):
        Accelerator.multi_device = self._saved


# ------------------------------------------------------------------------------------ scenarios
def _weights(trainer):
    model = trainer.get_model(keep_torch_compile=False)
    return {name: value.detach().clone().cpu() for name, value in model.state_dict().items()}


def _run_config(trainer):
    rc = trainer.run_config
    fields = (
        "num_epochs num_processes is_distributed train_per_device_batch_size eval_per_device_batch_size "
        "gradient_accumulation_steps train_total_batch_size eval_total_batch_size "
        "num_update_steps_per_epoch num_local_update_steps_per_epoch max_num_train_steps"
    ).split()
    return {name: getattr(rc, name) for name in fields}


def _engines_used(trainer) -> dict:
    """The engines that ran training and evaluation steps: a compiled engine that could not
    compile falls back to eager (with a warning), and the tests must notice."""
    engine = trainer._engine
    return {
        "train": getattr(engine, "active_engine", engine.name),
        "eval": getattr(engine, "active_eval_engine", engine.name),
    }


def train_case(name: str, world: int, engine: str = "eager") -> dict:
    kind, multi, single = TRAIN_CASES[name]
    cfg = multi if world > 1 else single
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    counter = CommCounter() if world > 1 else None
    recorder = Recorder(counter)
    trainer_cls = TokenTrainer if kind == "tokens" else Trainer
    trainer = trainer_cls(model, nn.MSELoss(), optimizer, callbacks=(recorder,), engine=engine)
    train_ds = token_data(N_TRAIN, 1) if kind == "tokens" else regression_data(N_TRAIN, 1)
    eval_ds = None if kind == "tokens" else regression_data(N_EVAL, 2)
    trainer.train(
        train_dataset=train_ds,
        num_epochs=2,
        eval_dataset=eval_ds,
        per_device_batch_size=cfg["bs"],
        max_num_train_steps=cfg.get("max_steps"),
        gradient_accumulation_steps=cfg["k"],
        gradient_clip_value=cfg.get("clip_value"),
        gradient_clip_norm=cfg.get("clip_norm"),
        train_dataloader_kwargs=LOADER,
        eval_dataloader_kwargs=EVAL_LOADER,
    )
    history = trainer.run_history
    return {
        "weights": _weights(trainer),
        "train_loss_epoch": history.get_metric_values("train_loss_epoch"),
        "eval_loss_epoch": history.get_metric_values("eval_loss_epoch") if eval_ds is not None else [],
        "num_updates": trainer.num_updates,
        "engines_used": _engines_used(trainer),
        "run_config": _run_config(trainer),
        "train_steps": recorder.train_steps,
        "eval_indices": recorder.eval_indices,
        # after the first epoch every shape has been seen: no graph is compiled again, although
        # micro-steps alternate between synced and no_sync
        "graphs_compiled_after_epoch_1": recorder.graphs_at_end
        - getattr(recorder, "graphs_before_epoch_2", recorder.graphs_at_end),
        "all_reduce_rounds": counter.rounds if counter else None,
        "all_reduce_calls": counter.calls if counter else None,
        "epoch_end_global_means": dict(recorder.epoch_end_global_means),
        "loader_devices": [
            str(loader.device) for loader in (trainer._train_dataloader, trainer._eval_dataloader) if loader is not None
        ],
        "device": str(trainer.device),
    }


def shuffled_case() -> dict:
    """The default training dataloader (``shuffle=True``) with ``Trainer(seed=0)``, which seeds
    every process differently: the processes must still agree on the permutation."""
    model = make_model()
    recorder = Recorder()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=LR), callbacks=(recorder,), seed=0)
    trainer.train(regression_data(N_TRAIN, 1), num_epochs=2, per_device_batch_size=4, train_dataloader_kwargs={"num_workers": 0})
    return {"train_steps": recorder.train_steps}


def comm_case(k: int, engine: str = "eager") -> dict:
    """Two processes, 6 micro-batches each: k=1, 2, 4 give 6, 3 and 2 updates (the last one of
    k=4 is the short tail update after micro-steps 5 and 6)."""
    counter = CommCounter()
    model = make_model()
    trainer = Trainer(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=LR),
        callbacks=(Recorder(counter, record_indices=False),),
        engine=engine,
    )
    trainer.train(
        regression_data(12, 3),
        num_epochs=1,
        per_device_batch_size=1,
        gradient_accumulation_steps=k,
        gradient_clip_norm=1.0,
        train_dataloader_kwargs=LOADER,
    )
    return {
        "calls": counter.calls,
        "rounds": counter.rounds,
        "num_updates": trainer.num_updates,
        "engines_used": _engines_used(trainer),
    }


def uneven_eval_case(world: int) -> dict:
    """``evaluate`` over 13 samples in batches of 2: 7 batches, 4 on process 0 and 3 on process 1.
    The model has batch norm, whose buffers DDP broadcasts in forward."""
    model = make_model(batch_norm=True)
    recorder = Recorder()
    callbacks = (recorder, MultiDeviceJoinGuard()) if world > 1 else (recorder,)
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=LR), callbacks=callbacks, engine="eager")
    eval_ds = regression_data(N_EVAL, 2)
    trainer.evaluate(eval_ds, per_device_batch_size=2, dataloader_kwargs=EVAL_LOADER)
    result = {
        "evaluation_loss": trainer.run_history.get_latest_metric("evaluation_loss"),
        "eval_indices": list(recorder.eval_indices),
    }
    if world == 1:
        # the exact mean over real samples, computed in one batch outside the trainer
        net = trainer.get_model(keep_torch_compile=False).eval()
        with torch.no_grad():
            x, y, _ = eval_ds.tensors
            result["direct_mean"] = nn.functional.mse_loss(net(x), y).item()
    else:
        # training first (batch norm buffers change and DDP broadcasts them), then an uneven
        # evaluation epoch: must neither hang nor differ between the processes
        recorder.eval_indices.clear()
        trainer.train(
            regression_data(N_TRAIN, 1),
            num_epochs=1,
            eval_dataset=eval_ds,
            per_device_batch_size=2,
            train_dataloader_kwargs=LOADER,
            eval_dataloader_kwargs=EVAL_LOADER,
        )
        result["trained_eval_loss"] = trainer.run_history.get_latest_metric("eval_loss_epoch")
        result["trained_eval_indices"] = list(recorder.eval_indices)
    return result


def sync_case(engine: str, k: int) -> dict:
    """One epoch of 200 micro-steps per process (800 samples, batch 2, two processes) with the
    default callbacks and ``log_every_n_steps=50``, then evaluation; records every host read
    fasttrain makes, with the trainer's position at that moment."""
    from syncs import SyncRecorder

    model = make_model()
    recorder = Recorder(record_indices=False)
    trainer = Trainer(
        model,
        nn.MSELoss(),
        torch.optim.SGD(model.parameters(), lr=LR),
        callbacks=(*get_default_callbacks(progress_bar=True), recorder),
        engine=engine,
    )

    def context():
        return (recorder.phase, trainer.num_updates, trainer.progress.step_in_epoch, getattr(recorder, "eval_batches_this_epoch", 0))

    syncs = SyncRecorder(context)
    with syncs:
        trainer.train(
            regression_data(800, 4),
            num_epochs=1,
            eval_dataset=regression_data(N_EVAL, 2),
            per_device_batch_size=2,
            gradient_accumulation_steps=k,
            gradient_clip_norm=1.0,
            train_dataloader_kwargs=LOADER,
            eval_dataloader_kwargs=EVAL_LOADER,
        )
    return {
        "events": syncs.events,
        "train_steps": recorder.train_step_count,
        "eval_steps": recorder.eval_step_count,
        "train_batches": len(trainer._train_dataloader),
        "eval_batches": recorder.eval_batches_this_epoch,
        "flushes": recorder.flushes,
        "num_updates": trainer.num_updates,
        "log_every_n_steps": trainer.log_every_n_steps,
        "engines_used": _engines_used(trainer),
    }


