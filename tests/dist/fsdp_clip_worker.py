"""Clipping on FSDP2-sharded gradients, in one process of a launch; saves what it measured.

Launched by ``tests/test_fsdp_clip.py`` in two ways at the same time:

* ``ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 fsdp_clip_worker.py OUT``:
  two gloo processes; every scenario;
* ``ACCELERATE_USE_CPU=1 python fsdp_clip_worker.py OUT``: one process, the reference for the
  training scenarios (twice the per-process batch).

Each process writes ``OUT/rank{rank}_world{world}.pt``.
"""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

from fasttrain import Trainer
from fasttrain.callbacks import TrainerCallback
from worker_common import CaseResults, run_worker
from fasttrain.engine.clipping import GradientClipper

N_TRAIN, IN, OUT = 48, 7, 3
#: name -> train() keywords; the thresholds bite (the norms are ~0.3-1, the elements ~0.1)
TRAIN_CASES = {
    "norm_k1": dict(k=1, gradient_clip_norm=0.05),
    "norm_k2": dict(k=2, gradient_clip_norm=0.05),
    "value_k2": dict(k=2, gradient_clip_value=0.01),
    "value_norm_k1": dict(k=1, gradient_clip_value=0.02, gradient_clip_norm=0.05),
    "plain_k1": dict(k=1),
}
SKIP_AT_UPDATE = 3  # the update whose gradients one process makes infinite


def make_model() -> torch.nn.Module:
    # odd sizes: shards of unequal length (5 rows -> 3 + 2), and a bias of one element, whose
    # shard is empty on the second process
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 5), torch.nn.Tanh(), torch.nn.Linear(5, OUT), torch.nn.Tanh(), torch.nn.Linear(OUT, 1))


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_TRAIN, IN, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_grads(model):
    return {n: full(p.grad) for n, p in model.named_parameters()}


class CountCollectives(TorchDispatchMode):
    """Counts the collectives started inside the block, by op (``c10d.allreduce_``,
    ``_c10d_functional.all_reduce``, ``c10d._reduce_scatter_base_``, ...): every collective,
    whether torch.distributed's or a functional one, passes the dispatcher as one such op."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (wait_tensor and _wrap_tensor_autograd are a functional collective's bookkeeping)
        if func.namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(("wait", "_wrap")):
            self.counts[f"{func.namespace}.{func.__name__.split('.')[0]}"] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------- the clipper on its own
def _backward(model, rank, dtype=torch.float32):
    gen = torch.Generator().manual_seed(10 + rank)  # a different batch on each process
    x = torch.randn(6, IN, generator=gen).to(dtype)
    model(x).square().mean().backward()


def _graph_recorder(graphs):
    """A torch.compile backend that records the collectives of each graph, then runs it through
    AOTAutograd (functionalization and the ops' fake implementations, as inductor would)."""
    from torch._dynamo.backends.common import aot_autograd

    def backend(gm, example_inputs):
        graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)))
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    return backend


def norm_case(mesh_shape, clip_value=None, clip_norm=0.05, ignored=False, compiled=False, dtype=torch.float32) -> dict:
    """Sharded gradients (FSDP2 over a 1-D mesh, or HSDP over (replicate, shard)) clipped by
    fasttrain's clipper, against torch's clip_grad_value_/clip_grad_norm_ applied to the full,
    unsharded gradients; and the collectives the clip made."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = make_model().to(dtype)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    plain = {model[4].bias} if ignored else None  # FSDP leaves it a plain, unsynchronised tensor
    fully_shard(model, mesh=mesh, ignored_params=plain)
    clipper = GradientClipper(model.parameters(), clip_value=clip_value, clip_norm=clip_norm)
    graphs = []
    if compiled:
        clip = torch.compile(clipper, backend=_graph_recorder(graphs), fullgraph=True)
        _backward(model, rank)
        clip()  # traced and compiled here; the call below must reuse the graph
        model.zero_grad(set_to_none=True)
    _backward(model, rank, dtype)
    if ignored:  # gradients FSDP ignores are the user's to synchronise: replicated here
        dist.all_reduce(model[4].bias.grad, op=dist.ReduceOp.AVG)
    before = full_grads(model)
    # torch's clipping, in one process, on copies of the whole gradients: by value in their
    # dtype, by norm in fp32 (torch reduces bf16 gradients in bf16, fasttrain in fp32)
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in before.items()}
    for n, p in params.items():
        p.grad = before[n].clone()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(params.values(), clip_value)
    for p in params.values():
        p.data, p.grad = p.data.float(), p.grad.float()
    ref_norm = torch.nn.utils.clip_grad_norm_(params.values(), clip_norm) if clip_norm else None
    reference = {n: p.grad.to(dtype) for n, p in params.items()}
    if compiled:  # (a dispatch mode would stop torch.compile: the graphs say it instead)
        norm = clip()
        counts = {"graphs": len(graphs), "collectives_in_graph": graphs[0] if graphs else None}
    else:
        with CountCollectives() as comm:
            norm = clipper()
        counts = dict(comm.counts)
    return {
        "norm": None if norm is None else norm.detach().clone(),
        "reference_norm": ref_norm,
        "grads": full_grads(model),
        "reference_grads": reference,
        "before": before,
        "comm_counts": counts,
        "placements": [str(p.placements) if hasattr(p, "placements") else "plain" for p in model.parameters()],
        "group_size": clipper.sharding.group_size,
    }


def flag_case(check_only: bool) -> dict:
    """Only process 1's shards hold an infinite value: the flag is raised on both processes."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = make_model()
    fully_shard(model)
    _backward(model, rank)
    if rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    clipper = GradientClipper(model.parameters(), clip_value=None if check_only else 0.01)
    clipper(check_finite=True)
    return {"found_inf": clipper.found_inf.item()}


def layout_errors_case() -> dict:
    """Layouts one all-reduce cannot serve: the message each raises (None: accepted)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (2,))
    square = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))

    def param(t):
        p = torch.nn.Parameter(t)
        p.grad = torch.ones_like(t)
        return p

    layouts = {
        "two_shard_dims": [param(distribute_tensor(torch.ones(4, 2), square, [Shard(0), Shard(1)]))],
        "partial": [param(DTensor.from_local(torch.ones(4), flat, [Partial()]))],
        "two_groups": [param(distribute_tensor(torch.ones(4), flat, [Shard(0)])),
                       param(distribute_tensor(torch.ones(4), square, [Replicate(), Shard(0)]))],
        "replicated_only": [param(distribute_tensor(torch.ones(4), flat, [Replicate()]))],
    }
    out = {}
    for name, params in layouts.items():
        try:
            clipper = GradientClipper(params, clip_norm=1.0)
            out[name] = ("accepted", clipper.clip_norm and clipper().item())
        except ValueError as error:
            out[name] = ("raised", str(error))
    # without clipping, set-up accepts any layout; checking the gradients raises the same error
    clipper = GradientClipper(layouts["two_shard_dims"])
    try:
        clipper(check_finite=True)
        out["deferred"] = ("accepted", None)
    except ValueError as error:
        out["deferred"] = ("raised", str(error))
    return out


# ------------------------------------------------------------------- training through the Trainer
class Record(TrainerCallback):
    def __init__(self):
        self.grad_norms = []

    def on_metrics_flush(self, trainer, metrics, **kwargs):
        if metrics.phase == "train":
            self.grad_norms.extend(metrics.grad_norms)


class InjectInf(Trainer):
    """On process ``rank`` (the only process of a one-process run), the gradient shard of
    update ``SKIP_AT_UPDATE`` gets an infinite element after the backward pass."""

    inject_on_rank = 1

    def backward_step(self, loss):
        super().backward_step(loss)
        self._backwards = getattr(self, "_backwards", 0) + 1
        rank = dist.get_rank() if dist.is_initialized() else self.inject_on_rank
        if self._backwards == SKIP_AT_UPDATE and rank == self.inject_on_rank:
            grad = self.model[0].weight.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            # the last row of the full gradient: process 1's shard, but not process 0's
            grad[-1, 0] = float("inf")


def train_case(world: int, k: int = 1, nonfinite: str = "ignore", skip: bool = False, fused: bool = False,
               count: bool = False, **clip) -> dict:
    from accelerate.utils import FullyShardedDataParallelPlugin

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    kwargs = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)} if world > 1 else None
    record = Record()
    trainer = (InjectInf if skip else Trainer)(
        model, torch.nn.MSELoss(), optimizer, callbacks=(record,), engine="eager",
        accelerator_kwargs=kwargs, nonfinite=nonfinite,
    )
    comm = CountCollectives() if count else None
    with comm if comm is not None else contextlib.nullcontext():
        trainer.train(
            dataset(), num_epochs=2, per_device_batch_size=8 // world, gradient_accumulation_steps=k,
            train_dataloader_kwargs={"shuffle": False}, **clip,
        )
    weights = {n: full(p) for n, p in trainer.model.named_parameters()}
    result = {
        "weights": weights,
        "grad_norms": record.grad_norms,
        "num_updates": trainer.num_updates,
        "skipped_updates": trainer.skipped_updates,
        "sharded": any(hasattr(p, "placements") for p in trainer.model.parameters()),
    }
    if comm is not None:
        result["comm_counts"] = dict(comm.counts)
    return result


def main(argv):
    results = CaseResults()
    record, world = results.record, results.world
    for name, case in TRAIN_CASES.items():
        case = dict(case)
        record(f"train/{name}", train_case, world, case.pop("k"), **case)
    record("skip", train_case, world, nonfinite="skip", skip=True, gradient_clip_norm=0.05)
    record("skip_value", train_case, world, nonfinite="skip", skip=True, gradient_clip_value=0.01)
    record("skip_fused", train_case, world, nonfinite="skip", skip=True, fused=True)
    if world > 1:
        record("norm/fsdp", norm_case, (2,))
        record("norm/fsdp_no_bite", norm_case, (2,), clip_norm=100.0)
        record("norm/fsdp_value", norm_case, (2,), clip_value=0.02)
        record("norm/value_only", norm_case, (2,), clip_value=0.02, clip_norm=None)
        record("norm/ignored", norm_case, (2,), ignored=True)
        record("norm/hsdp", norm_case, (2, 1))
        record("norm/bf16", norm_case, (2,), clip_value=0.02, dtype=torch.bfloat16)
        record("norm/compiled", norm_case, (2,), clip_value=0.02, compiled=True)
        record("layouts", layout_errors_case)
        record("flag/check", flag_case, True)
        record("flag/value", flag_case, False)
        record("count/clip", train_case, world, count=True, gradient_clip_norm=0.05)
        record("count/plain", train_case, world, count=True)
    results.save(Path(argv[0]))


if __name__ == "__main__":
    run_worker(main, "fsdp_clip_worker")
