"""FSDP2 scenarios, run in one process of a launch; each process saves what they produced.

Launched by ``tests/test_fsdp.py`` twice at the same time:

* ``ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 fsdp_worker.py OUT``:
  two gloo processes; the model is sharded by accelerate's own FSDP2 preparation (``fully_shard``
  on each ``Block`` and on the root), configured through ``Trainer(accelerator_kwargs=...)``;
* ``ACCELERATE_USE_CPU=1 python fsdp_worker.py OUT``: one plain process at twice the batch, the
  reference.

Each process writes ``OUT/rank{rank}_world{world}.pt``. How accelerate deals the batches out, and
why one process at batch ``2bk`` takes the same samples per update as two at ``b`` with ``k``
micro-steps, is in ``tests/dist/scenarios.py``.

``python fsdp_worker.py --bad-launch`` is what ``torchrun`` starts without ``ACCELERATE_USE_CPU``
on a machine without GPUs: building a Trainer must raise, in every process, without hanging.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from scenarios import FEATURES, regression_data
from worker_common import CaseResults, example_trainer, run_worker

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "fsdp2_train.py"

N_TRAIN = 32
N_EVAL = 13  # odd: padded to 14 under FSDP2 (the forward all-gathers, so batches must be even)
HIDDEN = 8
LR = 0.05
LOADER = {"shuffle": False, "num_workers": 0}

# name -> (engine, settings with two processes, settings of the one-process reference); every
# pair takes 8 samples per optimizer update. The accumulation cases also clip by value and by the
# global norm (together they change the weights: tested), so the compiled update is checked with the sharded
# clip's collective inside; the clipping tests cover the rest of clipping.
CLIP = 0.02
CLIP_VALUE = 0.05
CASES = {
    "k1": ("eager", dict(bs=4, k=1), dict(bs=8, k=1)),
    "k2": ("eager", dict(bs=2, k=2, clip=CLIP, clip_value=CLIP_VALUE), dict(bs=8, k=1, clip=CLIP, clip_value=CLIP_VALUE)),
    # compiling dominates the launch: one compiled case, with accumulation, clipping and evaluation
    "k2_compiled": ("compiled", dict(bs=2, k=2, clip=CLIP, clip_value=CLIP_VALUE), dict(bs=8, k=1, clip=CLIP, clip_value=CLIP_VALUE)),
}


# ------------------------------------------------------------------------------------ model
class Block(nn.Module):
    """The unit FSDP2 shards on its own (``transformer_cls_names_to_wrap``)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEATURES, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN), Block(HIDDEN)])
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return Net()


def fsdp2_plugin() -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )


def full_weights(trainer) -> dict:
    """The model's parameters, whole: shards gathered (every process must call it)."""
    state = trainer.get_model().state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def per_sample_losses(weights: dict, dataset: TensorDataset) -> torch.Tensor:
    model = make_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        x, y = dataset.tensors[0], dataset.tensors[1]
        return ((model(x) - y) ** 2).mean(dim=1)


# ------------------------------------------------------------------------------------ counting
class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched while ``active`` (torch's c10d operators, which every
    ``torch.distributed`` call and FSDP2's hooks go through), with the bytes each sends from this
    process: the shard an all-gather contributes, the whole tensor a reduce-scatter or an
    all-reduce reduces. DDP's reducer calls the process group from C++, past the dispatcher:
    ``comm_case`` counts it with a communication hook."""

    def __init__(self):
        super().__init__()
        self.active = False
        self.calls = {}
        self.bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if self.active and namespace in ("c10d", "_c10d_functional"):
            name = func.__name__.split(".")[0].rstrip("_")
            # the input: second argument of the gathers and scatters, first of the others
            sent = args[1] if ("gather" in name or "scatter" in name) and namespace == "c10d" else args[0]
            tensors = sent if isinstance(sent, (list, tuple)) else [sent]
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **kwargs)


class Recorder(TrainerCallback):
    """Sample indices of every micro-step and eval step, and the collectives issued inside
    training steps (flushes and epoch ends, which make their own, lie outside them)."""

    def __init__(self, collectives: Collectives = None):
        self.collectives = collectives
        self.train_indices = []
        self.eval_indices = []
        self.distributed_type_at_start = None

    def on_training_run_start(self, trainer, **kwargs):
        self.distributed_type_at_start = str(trainer._accelerator.distributed_type)

    def on_train_epoch_start(self, trainer, **kwargs):
        if trainer.run_history.current_epoch == 2:
            self.graphs_before_epoch_2 = compiled_graphs()

    def on_train_step_start(self, trainer, **kwargs):
        if self.collectives is not None:
            self.collectives.active = True

    def on_train_step_end(self, trainer, batch, batch_output, **kwargs):
        if self.collectives is not None:
            self.collectives.active = False
        self.train_indices.append(batch[-1].tolist())

    def on_eval_step_end(self, trainer, batch, batch_output, **kwargs):
        self.eval_indices.extend(batch[-1].tolist())


def engines_used(trainer) -> dict:
    engine = trainer._engine
    return {
        "train": getattr(engine, "active_engine", engine.name),
        "eval": getattr(engine, "active_eval_engine", engine.name),
    }


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ------------------------------------------------------------------------------------ scenarios
def train_twice_case(world: int) -> dict:
    """Two train() calls, each ending with an evaluation, the second clipping by norm: after an
    evaluation the root group holds unsharded parameters, which the second run's set-up
    (accelerate's optimizer remapping, the clipper) must not take for the model's."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    kwargs = {"fsdp_plugin": fsdp2_plugin()} if world > 1 else None
    trainer = Trainer(model, nn.MSELoss(), optimizer, callbacks=(), engine="eager", accelerator_kwargs=kwargs)
    for clip in (None, CLIP):
        trainer.train(
            regression_data(N_TRAIN, 1), num_epochs=1, eval_dataset=regression_data(N_EVAL, 2),
            per_device_batch_size=8 // world, gradient_clip_norm=clip, train_dataloader_kwargs=LOADER,
            eval_dataloader_kwargs={"num_workers": 0},
        )
    return {"weights": full_weights(trainer)}


def train_case(name: str, world: int) -> dict:
    engine, multi, single = CASES[name]
    cfg = multi if world > 1 else single
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    recorder = Recorder()
    kwargs = {"fsdp_plugin": fsdp2_plugin()} if world > 1 else None
    eval_ds = regression_data(N_EVAL, 2)
    trainer = Trainer(
        model, nn.MSELoss(), optimizer, callbacks=(recorder,), engine=engine if world > 1 else "eager",
        accelerator_kwargs=kwargs,
    )
    graphs_before = compiled_graphs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        trainer.train(
            regression_data(N_TRAIN, 1), num_epochs=2, eval_dataset=eval_ds, per_device_batch_size=cfg["bs"],
            gradient_accumulation_steps=cfg["k"], gradient_clip_norm=cfg.get("clip"), gradient_clip_value=cfg.get("clip_value"),
            train_dataloader_kwargs=LOADER,
            eval_dataloader_kwargs={"num_workers": 0},
        )
    weights = full_weights(trainer)
    history = trainer.run_history
    return {
        "weights": weights,
        "train_loss_epoch": history.get_metric_values("train_loss_epoch"),
        "eval_loss_epoch": history.get_metric_values("eval_loss_epoch"),
        # the eval loss of the final model, recomputed without the trainer per sample
        "eval_per_sample": per_sample_losses(weights, eval_ds),
        "eval_indices": recorder.eval_indices,
        "train_indices": recorder.train_indices,
        "num_updates": trainer.num_updates,
        "engines_used": engines_used(trainer),
        "runtime_warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "graphs_compiled": compiled_graphs() - graphs_before,
        # every shape (full and last batches, synced and no-sync micro-steps, eval) is seen in
        # the first epoch: nothing compiles again in the second
        "graphs_compiled_in_epoch_2": compiled_graphs() - recorder.graphs_before_epoch_2,
        "model_class": type(trainer.model).__name__,
        "distributed_type": str(trainer._accelerator.distributed_type),
        "state_distributed_type": str(AcceleratorState().distributed_type),
        "distributed_type_at_start": recorder.distributed_type_at_start,
    }


def cudagraph_case() -> dict:
    """``engine="cudagraph"`` with FSDP2: the decision not to capture is taken from the sharding,
    on every device: one warning, and the compiled engine runs the steps (dynamo's "eager"
    backend: the decision is under test here, inductor's code is in the compiled case)."""
    model = make_model()
    trainer = Trainer(
        model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=LR), callbacks=None, engine="cudagraph",
        accelerator_kwargs={"fsdp_plugin": fsdp2_plugin()}, compile_options={"backend": "eager"},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(regression_data(8, 1), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=LOADER)
    return {
        "engines_used": engines_used(trainer),
        "warnings": [str(w.message) for w in caught if "fasttrain" in str(w.message)],
    }


def later_trainer_case() -> dict:
    """A Trainer built without a plugin after an FSDP2 one: the plugin was that Trainer's only."""
    model = make_model()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=LR), callbacks=None, engine="eager")
    trainer.train(regression_data(8, 1), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=LOADER)
    return {"distributed_type": str(trainer._accelerator.distributed_type), "model_class": type(trainer.model).__name__}


def ddp_kwargs_case() -> dict:
    """DDP's own options, through ``accelerator_kwargs``: they reach the DDP module, and the run
    (``k1``'s settings) still equals the one-process reference. With accumulation, torch's DDP
    cannot build its static graph (the first iteration runs under no_sync): refused up front."""
    from accelerate.utils import DistributedDataParallelKwargs

    _, cfg, _ = CASES["k1"]

    def trainer_with_options():
        model = make_model()
        handler = DistributedDataParallelKwargs(static_graph=True, gradient_as_bucket_view=True)
        return Trainer(
            model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=LR), callbacks=None, engine="eager",
            accelerator_kwargs={"kwargs_handlers": [handler]},
        )

    trainer = trainer_with_options()
    trainer.train(regression_data(N_TRAIN, 1), num_epochs=2, per_device_batch_size=cfg["bs"], train_dataloader_kwargs=LOADER)
    ddp = trainer.model
    accumulation_error = None
    try:
        trainer_with_options().train(
            regression_data(N_TRAIN, 1), num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=2
        )
    except ValueError as error:
        accumulation_error = str(error)
    return {
        "model_class": type(ddp).__name__,
        "static_graph": getattr(ddp, "static_graph", None),
        "gradient_as_bucket_view": getattr(ddp, "gradient_as_bucket_view", None),
        "weights": {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()},
        "accumulation_error": accumulation_error,
    }


def comm_case(k: int, sharded: bool) -> dict:
    """Collectives per optimizer update: FSDP2 (counted at torch.distributed's functions) or DDP
    (counted by a communication hook, since DDP's reducer all-reduces from C++). Two processes,
    batch 2, 4 micro-steps of training."""
    model = make_model()
    recorder = Recorder(Collectives())
    kwargs = {"fsdp_plugin": fsdp2_plugin()} if sharded else None
    trainer = Trainer(
        model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=LR), callbacks=(recorder,), engine="eager",
        accelerator_kwargs=kwargs,
    )
    ddp_buckets = []

    class HookCounter(TrainerCallback):
        def on_training_run_start(self, trainer, **kwargs):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def hook(state, bucket):
                ddp_buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
                return default_hooks.allreduce_hook(state, bucket)

            trainer.model.register_comm_hook(None, hook)

    if not sharded:
        trainer.callback_handler.add_callback(HookCounter())
    with recorder.collectives:
        trainer.train(regression_data(16, 1), num_epochs=1, per_device_batch_size=2, gradient_accumulation_steps=k,
                      train_dataloader_kwargs=LOADER)
    collectives = recorder.collectives
    if not sharded:
        collectives.calls["all_reduce (DDP buckets)"] = len(ddp_buckets)
        collectives.bytes["all_reduce (DDP buckets)"] = sum(ddp_buckets)
    parameter_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    return {
        "updates": trainer.num_updates,
        "micro_steps": len(recorder.train_indices),
        "calls": dict(collectives.calls),
        "bytes": dict(collectives.bytes),
        "parameter_bytes": parameter_bytes,
        "fsdp_groups": sum(1 for m in trainer.model.modules() if type(m).__name__.startswith("FSDP")),
    }


def run_example() -> dict:
    trainer = example_trainer(EXAMPLE, ["--epochs", "2", "--num-samples", "128", "--batch-size", "8", "--grad-accum", "2"])
    return {
        "distributed_type": str(trainer._accelerator.distributed_type),
        "eval_loss_epoch": trainer.run_history.get_metric_values("eval_loss_epoch"),
        "num_updates": trainer.num_updates,
    }


def bad_launch() -> None:
    model = nn.Linear(2, 1)
    try:
        Trainer(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=LR), callbacks=None)
    except RuntimeError as error:
        print(f"REFUSED: {error}", flush=True)
        sys.exit(3)
    print("ACCEPTED", flush=True)


def config_file_launch(out_dir: Path) -> None:
    """Under ``accelerate launch --config_file`` with an FSDP2 config: a Trainer given no plugin
    follows the launcher's environment."""
    model = make_model()
    trainer = Trainer(model, nn.MSELoss(), torch.optim.AdamW(model.parameters(), lr=LR), callbacks=None, engine="eager")
    trainer.train(regression_data(N_TRAIN, 1), num_epochs=1, per_device_batch_size=4, train_dataloader_kwargs=LOADER)
    result = {
        "world": trainer.run_config.num_processes,
        "distributed_type": str(trainer._accelerator.distributed_type),
        "sharded_modules": sorted(type(m).__name__ for m in trainer.model.modules() if type(m).__name__.startswith("FSDP")),
        "num_updates": trainer.num_updates,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(result, out_dir / f"config_launch_rank{os.environ.get('RANK', '0')}.pt")


def main(argv):
    if argv[0] == "--bad-launch":
        return bad_launch()
    if argv[0] == "--config-file-launch":
        return config_file_launch(Path(argv[1]))
    if argv[0] == "--compiled-again":
        # the compiled case once more, started with the compile cache the first launch filled
        rank = int(os.environ["RANK"])
        result = train_case("k2_compiled", int(os.environ["WORLD_SIZE"]))
        return torch.save(result, Path(argv[1]) / f"compiled_again_rank{rank}.pt")
    results = CaseResults()
    record, world = results.record, results.world
    for name in CASES:
        if world > 1 or CASES[name][0] == "eager":  # the reference is eager
            record(f"train/{name}", train_case, name, world)
    record("train_twice", train_twice_case, world)
    if world > 1:
        record("later_trainer", later_trainer_case)
        record("ddp_kwargs", ddp_kwargs_case)
        record("cudagraph", cudagraph_case)
        for k in (1, 2, 4):
            record(f"comm/fsdp2/k{k}", comm_case, k, True)
            record(f"comm/ddp/k{k}", comm_case, k, False)
        record("example", run_example)
    results.save(Path(argv[0]))


if __name__ == "__main__":
    run_worker(main, "fsdp worker")
