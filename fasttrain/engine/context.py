"""What an engine is given to run a step: the one contract between the Trainer and the engines.

The Trainer builds a :class:`StepContext` once per ``train()``/``evaluate()``, after accelerate
has prepared the model and optimizer, and hands it to :func:`fasttrain.engine.create_engine`.
Engines read the hooks through ``ctx.trainer`` by their public names only (``model``,
``optimizer`` and ``scheduler`` are read live there, since callbacks may swap them), and reach
every piece of set-up (loss scaling, clipping, ``no_sync``, what blocks graph capture) through
the fields below. Nothing under ``fasttrain.engine`` imports the Trainer, so the dependencies
point one way: trainer -> engine -> kernels.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, FrozenSet, Optional, Tuple

import torch

#: the hooks an engine calls, in the order a stepping micro-step calls them
STEP_HOOKS = (
    "calculate_train_batch_loss",
    "backward_step",
    "optimizer_step",
    "scheduler_step",
    "optimizer_zero_grad",
    "calculate_eval_batch_loss",
)


class HostEffects:
    """Python side effects of a step that a CUDA graph's replay does not redo, redone by the
    graphed engine after each replay. A replay runs the kernels the capture recorded, never the
    Python that issued them: whatever the step's Python leaves behind for the host (fasttrain.
    lightning's ``self.log`` calls recorded inside a compiled step) is taken when the step is
    captured and handed back after every replay. The default has none."""

    def mark(self) -> object:
        """Before a capture: where the effects of the captured step will start."""
        return None

    def taken_since(self, mark: object) -> object:
        """After the capture: the effects since ``mark``, taken away (the replay that follows
        the capture hands them back, like every replay)."""
        return None

    def redo(self, effects: object) -> None:
        """After a replay: the captured step's effects again, with the replay's values."""

    def discard(self, mark: object) -> None:
        """After a capture that failed: drop what it left (it refers to nothing that ran)."""

    def guarded_calls(self) -> list:
        """Right after a training step's capture: the compiled functions its hooks' own code ran
        besides the engine's, ``(hook, code, frame_locals)`` as for
        :class:`~fasttrain.engine.step_guards.ReplayGuards`, whose guards are checked before each
        replay with the engine's. May raise ``CaptureRefused`` where a hook's Python ran that no
        guard checks."""
        return []

    def kept_apart(self) -> ContextManager:
        """Around hooks compiled apart from the step's forward (the update's, compiled, captured
        or not; fasttrain.lightning's backward hooks on the graphed engine): the effects they make
        are kept apart from those of the forward while they run, so that their compiled code never
        sees how many the forward made (dynamo would guard on that, and the guards are checked
        again before each replay), and joined to them after."""
        return contextlib.nullcontext()


NO_HOST_EFFECTS = HostEffects()


@dataclass(frozen=True)
class StepContext:
    """Everything an engine needs, decided once at set-up.

    :param trainer: the object whose public hooks and attributes the step runs (``model``,
        ``optimizer``, ``scheduler``, ``device``, ``run_config``, ``log_every_n_steps``,
        ``compile_options`` and the hooks of :data:`STEP_HOOKS`).
    :param loss_for_backward: ``batch_output -> loss`` as backward sees it (scaled for gradient
        accumulation and token-normalised losses).
    :param clip: clips the accumulated gradients once per update; returns the global norm as a
        device tensor, or None.
    :param step_was_skipped: True when the last optimizer step did not run (a loss scaler found
        non-finite gradients), in which case the scheduler does not step either.
    :param no_sync: ``update -> context``: suppresses the gradient all-reduce on micro-steps
        that do not update.
    :param overridden_hooks: the hooks of :data:`STEP_HOOKS` that the trainer's class overrides.
    :param capture_blockers: why the training step cannot be captured in a CUDA graph whatever
        the optimizer (host-side loss scaling, DeepSpeed); empty when nothing blocks it.
    :param training: False for ``evaluate()``, which sets up no training step.
    :param step_in_epoch: the index of the micro-step about to run in the current epoch.
    :param train_batches: the number of batches of a training epoch (None when unknown).
    :param last_batch: whether the micro-step about to run is its epoch's last, where the loop
        knows it better than ``step_in_epoch`` and ``train_batches`` tell (a batch limit, a
        loader of unknown length read one batch ahead); None: from those two.
    :param mutated_flags: the device flags the clipping kernels raise in place, restored with
        the rest of the step when a failed step is undone.
    :param keeps_model_outputs: ``phase -> bool`` ("train", "eval"): whether a callback reads
        ``batch_output["model_outputs"]`` of that phase's steps. The graphed engine keeps a
        captured graph's model outputs alive (graph memory, one set per graph) only then.
    :param update_read_host: True when the last optimizer update read a device value on the host
        (``nonfinite="skip"`` before its masked skip is armed): such an update cannot be captured.
    :param before_update_capture: called before a CUDA graph captures an update, outside the
        capture: builds what the capture cannot (the clipping kernels' chunk tables).
    :param host_effects: the step's Python side effects that a graph replay must redo
        (:class:`HostEffects`).
    :param zero_grad_before_step: a re-entrant context entered around each training step of the
        graphed engine, or None. fasttrain.lightning clears gradients at the first micro-step of
        each accumulation window, between the forward and the backward, as Lightning does (through
        the user's zero-grad hooks where they override them); a graph records no Python, so on
        entering this context the clearing runs before the step, eagerly, and the step's backward
        leaves it out.
    :param compile_owner: what the compiled functions are kept with, so that later runs reuse
        them (None: the trainer). fasttrain.lightning builds a trainer per ``fit()``; its
        compiled steps are kept with the LightningModule, so that another ``fit()`` of the same
        module compiles nothing again.
    """

    trainer: Any
    loss_for_backward: Callable[[dict], torch.Tensor]
    clip: Callable[[], Optional[torch.Tensor]]
    step_was_skipped: Callable[[], bool]
    no_sync: Callable[[bool], ContextManager]
    overridden_hooks: FrozenSet[str] = frozenset()
    capture_blockers: Tuple[str, ...] = ()
    training: bool = True
    step_in_epoch: Callable[[], int] = lambda: 0
    train_batches: Callable[[], Optional[int]] = lambda: None
    last_batch: Optional[Callable[[], bool]] = None
    mutated_flags: Callable[[], tuple] = lambda: ()
    update_read_host: Callable[[], bool] = lambda: False
    keeps_model_outputs: Callable[[str], bool] = lambda phase: True
    before_update_capture: Callable[[], None] = lambda: None
    host_effects: HostEffects = NO_HOST_EFFECTS
    zero_grad_before_step: Optional[ContextManager] = None
    compile_owner: Any = None

    def overrides(self, hook: str) -> bool:
        """True when the trainer's class overrides the default hook ``hook``."""
        return hook in self.overridden_hooks


def overridden_hooks(obj, base: type) -> FrozenSet[str]:
    """The hooks of :data:`STEP_HOOKS` that ``type(obj)`` defines differently from ``base``."""
    return frozenset(name for name in STEP_HOOKS if getattr(type(obj), name) is not getattr(base, name))


def optimizer_step_was_skipped(optimizer) -> bool:
    """accelerate's optimizer wrapper records a step its loss scaler skipped; other optimizers
    never skip."""
    return bool(getattr(optimizer, "step_was_skipped", False))


def no_sync_for(accelerator, model_of: Callable[[], torch.nn.Module], distributed: bool):
    """The ``no_sync`` field: DDP's ``no_sync`` of the current model on micro-steps that do not
    update, so that gradients are all-reduced once per optimizer update; nothing when training
    runs in one process."""
    if not distributed:
        return in_one_process

    def no_sync(update: bool):
        if update:
            return contextlib.nullcontext()
        return accelerator.no_sync(model_of())

    return no_sync


def in_one_process(update: bool):
    """The ``no_sync`` field of a run in one process: there is no all-reduce to suppress. An
    engine that sees it may run its micro-steps without entering a context at all."""
    return contextlib.nullcontext()
