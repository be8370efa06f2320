"""Batches Lightning skips under automatic optimization: ``training_step`` returning ``None``,
and a loader yielding ``None``.

Lightning still counts such a batch. A step that returns None is a stepping batch like any other
(``optimizer_step`` is called, ``global_step`` and the schedulers advance) whose closure runs no
backward: the optimizer steps on the gradients the window accumulated before it, and torch's
optimizers leave parameters without a gradient alone, so a window with no loss at all changes no
weight. A None batch runs no step at all: no update, no ``global_step``; the window's gradients
are dropped (Lightning zeroes them at the next window's first batch).

Whether a step returned None is a Python fact about each batch, decided on the host from the
return value, at no device cost. A compiled graph and a replayed CUDA graph each hold one Python
path, so a step whose own code can return None runs on the eager engine (:func:`may_return_none`,
read once per fit from its bytecode); a None the code hides (returned through a helper) raises
:class:`StepReturnedNone` inside the compiled engine, which then falls back to eager with its
warning and redoes the step there.
"""

from __future__ import annotations

import dis
from typing import NoReturn

import torch
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.utilities import rank_zero_warn

_NONE_STEP_WARNING = "`training_step` returned `None`. If this was on purpose, ignore this warning..."
_NONE_BATCH_WARNING = "train_dataloader yielded None. If this was on purpose, ignore this warning..."
_DISTRIBUTED_ERROR = (
    "Skipping the `training_step` by returning None in distributed training is not supported."
    " It is recommended that you rewrite your training logic to avoid having to skip the step in the first"
    " place."
)


class StepReturnedNone(Exception):
    """Raised by the training step of a batch whose ``training_step`` returned None: the engine
    stops before the backward, and the fit loop skips the batch as Lightning does."""

    def __init__(self, batch_idx: int):
        super().__init__(
            f"training_step returned None for batch {batch_idx} (Lightning skips that batch's update); "
            "a step whose Python path changes between batches cannot be one compiled graph"
        )


@torch.compiler.disable
def raise_step_returned_none(batch_idx: int) -> NoReturn:
    """Raise :class:`StepReturnedNone` from Python that no compiled graph traces: torch 2.11's
    dynamo fails on its own assertion when it traces this raise in the code it resumes after a
    graph break, so the fallback would name that assertion instead of the None."""
    raise StepReturnedNone(batch_idx)


def may_return_none(module) -> bool:
    """Whether ``module.training_step``'s own code can return None: a ``return None``, a bare
    ``return``, or an end reached without a return (what Python compiles to returning the
    constant None). A None returned by a function it calls is not seen here."""
    step = getattr(module, "training_step", None)
    code = getattr(getattr(step, "__func__", step), "__code__", None)
    if code is None:
        return False
    previous = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RETURN_CONST" and instruction.argval is None:
            return True
        if instruction.opname == "RETURN_VALUE" and previous is not None and (
            previous.opname == "LOAD_CONST" and previous.argval is None
        ):
            return True
        previous = instruction
    return False


def check_none_step(lt, batch_idx: int) -> None:
    """A step returned None: Lightning's error with several processes, else its warning, once per
    process (Lightning's own warning cache, shared with lightning.Trainer)."""
    if lt.world_size > 1:
        raise RuntimeError(_DISTRIBUTED_ERROR)
    Closure.warning_cache.warn(_NONE_STEP_WARNING)


def skip_step(lt, runner, update: bool, batch_idx: int) -> None:
    """The rest of a stepping or accumulating batch whose ``training_step`` returned None, on the
    host: Lightning's zero-grad hooks at a window's first batch, and on a stepping batch the
    update of whatever the window accumulated (``on_before_optimizer_step`` and clipping run as
    in Lightning's closure; the optimizer skips parameters without a gradient). Returns the
    batch's output: None."""
    check_none_step(lt, batch_idx)
    if runner.window_start:
        runner.zero_grad_at_window_start()
    if not update:
        return None
    scaler = runner._accelerator.scaler
    if scaler is not None:
        # Lightning's fp16 plugin steps nothing after a closure without a loss (the scaler has no
        # gradients to check): the hooks run, the optimizer does not step
        if lt._before_step_hooks:
            lt._hooks("on_before_optimizer_step", lt.optimizers[0])
        return None
    runner._step_context.clip()
    runner.optimizer_step()
    return None


def skip_none_batch(lt) -> None:
    """A ``None`` batch: Lightning's warning (once per trainer), and nothing else: no step, no
    update, and no clearing of the gradients (Lightning clears them in the closure of a window's
    first batch, which a None batch does not run, so that window adds to the last update's)."""
    if _NONE_BATCH_WARNING not in lt._said:
        lt._said.add(_NONE_BATCH_WARNING)
        rank_zero_warn(_NONE_BATCH_WARNING)
    return None
