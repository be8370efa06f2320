"""``trainer.strategy`` as LightningModule code and Lightning's callbacks use it, backed by
accelerate (the process group, the loss scaler) and fasttrain's trainer.

``LightningOptimizer.step`` (manual optimization, or an overridden ``optimizer_step`` that calls
``optimizer.step(closure=...)``) lands in :meth:`Strategy.optimizer_step`, which runs Lightning's
sequence: the optimizer's step with a closure that runs the given one, then
``on_before_optimizer_step`` and clipping (automatic optimization only).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Strategy:
    handles_gradient_accumulation = False

    def __init__(self, trainer):
        self._trainer = trainer  # fasttrain.lightning.Trainer
        self._lightning_optimizers: list = []

    def __getstate__(self) -> dict:
        # the wrappers' classes are built per optimizer class and cannot be pickled by name;
        # the trainer rebuilds them when it is loaded
        return {**self.__dict__, "_lightning_optimizers": []}

    # ------------------------------------------------------------------ placement
    @property
    def root_device(self) -> torch.device:
        return self._trainer._device

    @property
    def lightning_module(self):
        return self._trainer.lightning_module

    @property
    def model(self):
        return self._trainer.model

    @property
    def precision_plugin(self):
        return self._trainer.precision_plugin

    @property
    def is_global_zero(self) -> bool:
        return self._trainer.is_global_zero

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[str] = "mean"):
        if not isinstance(tensor, torch.Tensor) or not _distributed():
            return tensor
        op = str(reduce_op).lower() if reduce_op is not None else "mean"
        ops = {"mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"reduce_op must be one of {sorted(ops)}, got {reduce_op!r}")
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=ops[op], group=group)
        if op in ("mean", "avg"):
            tensor = tensor / dist.get_world_size(group)
        return tensor

    def broadcast(self, obj, src: int = 0):
        if not _distributed():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed():
            dist.barrier()

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        if not _distributed():
            return decision
        # a callback's decision (early stopping, saving) must agree across processes
        flag = torch.tensor(int(bool(decision)), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        count = int(flag.item())  # SYNC(callback): once per decision, read after the all-reduce
        return count == dist.get_world_size() if all else count > 0

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if not _distributed():
            return tensor
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return torch.stack(out)

    def remove_checkpoint(self, filepath) -> None:
        if not self.is_global_zero:
            return
        io = self._trainer._checkpoint_io
        if io is not None:  # a CheckpointIO plugin removes its own files
            io.remove_checkpoint(filepath)
        elif os.path.exists(filepath):
            os.remove(filepath)

    @property
    def checkpoint_io(self):
        """The ``CheckpointIO`` plugin given to the Trainer (None: fasttrain's own file writing)."""
        return self._trainer._checkpoint_io

    # ------------------------------------------------------------------ the step
    def backward(self, closure_loss, optimizer=None, *args, **kwargs):
        """``on_before_backward`` -> the module's ``backward`` (scaled under fp16) ->
        ``on_after_backward``, as Lightning's strategy runs them."""
        trainer = self._trainer
        hooks = trainer._hooks
        hooks("on_before_backward", closure_loss)
        scaler = trainer._scaler()
        loss = scaler.scale(closure_loss) if scaler is not None else closure_loss
        hooks.module_hook("backward", loss, *args, **kwargs)
        hooks("on_after_backward")
        return closure_loss

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's precision plugins' step: the optimizer's ``step`` gets a closure that runs
        ``closure`` and then ``on_before_optimizer_step`` and clipping, so an optimizer that
        evaluates the closure several times (LBFGS) works; returns what the optimizer's ``step``
        returns. Under fp16 the closure runs first and the scaler steps, as in Lightning's
        ``MixedPrecision``."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        scaler = self._trainer._scaler()
        if scaler is None:
            def closure_then_hooks():
                result = closure()
                self._after_closure(optimizer)
                return result

            return optimizer.step(closure=closure_then_hooks, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure()
        scaler.unscale_(optimizer)
        self._after_closure(optimizer)
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    def _after_closure(self, optimizer) -> None:
        trainer = self._trainer
        trainer._hooks("on_before_optimizer_step", optimizer)
        if trainer.lightning_module.automatic_optimization:
            trainer._hooks.module_hook(
                "configure_gradient_clipping", optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm
            )
