"""The compiled step engine: the trainer's hooks run through ``torch.compile``.

It calls the three compiled functions of :mod:`fasttrain.engine.compiled_functions` (the
training forward, the update, the evaluation forward); the scheduler step and
``optimizer_zero_grad`` stay eager, between compiled calls, in the eager engine's order, and the
optimizer's tensor hyperparameters are lent to its groups for each compiled call only
(:mod:`fasttrain.engine.hyperparams`).

Shapes are static (``dynamic=False`` unless ``compile_options`` says otherwise): the last,
smaller batch of an epoch gets its own graph, compiled once, so it costs one extra compile per
function and keeps the exact loss; later epochs and later ``train()`` calls hit the cache.

The forward hooks are traced whole first (``fullgraph=True``): a hook that cannot be (a graph
break, ``.item()``, branching on a device value) raises while it is traced, before anything runs,
and is then compiled with graph breaks allowed, with one warning naming the breaks and the graph
count (:mod:`fasttrain.engine.graph_report`); only where that compile fails too does the engine
fall back to the eager engine. ``compile_options={"fullgraph": True}`` goes to eager directly.
The update's hooks keep the numbers they read as constants (a forward's that keep changing become
symbolic, :mod:`fasttrain.engine.symbolic_ints`): where one keeps changing (a counter in
``optimizer_step``, a branch on Lightning's ``global_step`` in ``on_before_optimizer_step``), the
update compiled again for each value, so after its third the update runs uncompiled for the rest
of the run, with one warning, and the forward and backward stay compiled.
Until the first update has succeeded, each micro-step is guarded by a snapshot of everything it
can mutate, so a failure in the middle of a step is undone before the fallback redoes it.

A model wrapped by DDP or sharded by FSDP2 is compiled with graph breaks allowed in the forward:
dynamo breaks at DDP's wrapper and at FSDP2's per-module hooks on purpose, and compiles what lies
between (for FSDP2, each sharded block) as graphs of their own; the collectives stay eager
(docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from fasttrain.engine.compile_cache import separate_compile_cache_per_process
from fasttrain.engine.compiled_functions import (
    EVAL_HOOK,
    TRAIN_HOOK,
    UPDATE,
    CompileSettings,
    compiled_functions,
    settings_for_engine,
    _update,
)
from fasttrain.engine.base import StepEngine
from fasttrain.errors import StopTrainingError
from fasttrain.sharding import is_fsdp2
from fasttrain.engine.context import StepContext
from fasttrain.engine.eager import EagerEngine
from fasttrain.engine.hyperparams import TensorHyperparams, inner_optimizer, settings_advice, steps_in_fused_kernels
from fasttrain.engine import recompile_limit
from fasttrain.engine.graph_report import HookGraphs
from fasttrain.engine.snapshot import StepSnapshot
from fasttrain.engine.symbolic_ints import ChangingValues
from fasttrain.regional import compiled_region_names


def describe_error(error: BaseException) -> str:
    """A short reason for a warning: the exception type, its first line and, for dynamo's
    errors, the line of user code that caused it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    for line in lines[1:]:
        if line.startswith("Caused by:"):
            reason += f" ({line})"
            break
    return reason[:600]


class CompiledEngine(StepEngine):
    """Runs each micro-step through compiled functions of the trainer's hooks."""

    name = "compiled"
    #: whether integers and floats the hooks read that keep changing are compiled as symbolic values
    #: (symbolic_ints.py); a captured graph would replay one as captured
    symbolic_ints = True
    #: switch Adam/AdamW to capturable=True on CUDA: a device-side step counter (no host reads),
    #: which a tensor learning rate needs with the foreach implementation
    capturable_optimizer = True
    #: compile the update when the optimizer steps with torch's fused kernels. Dynamo does not trace
    #: those: a compiled update would run the same kernel eagerly behind graph breaks, with guard
    #: checks on the optimizer's state before it, so this engine calls the update's hooks as the
    #: eager engine does. The graphed engine compiles it, to capture the update as one graph.
    compiles_fused_update = False

    def __init__(self, ctx: StepContext, settings: Optional[CompileSettings] = None):
        super().__init__(ctx)
        if settings is None:
            settings = CompileSettings.from_options(getattr(ctx.trainer, "compile_options", None))
        # a fallback is handed the settings of the engine it replaces, already made safe there
        self.settings = settings_for_engine(settings, self.name)
        self._functions: Optional[_CompiledFunctions] = None
        self._hparams: Optional[TensorHyperparams] = None
        self._train_fallback: Optional[StepEngine] = None
        self._eval_fallback: Optional[StepEngine] = None
        self._trusted = False
        self._clipper_noted = None
        #: the update runs uncompiled (see compiles_fused_update, and _uncompile_update)
        self._eager_update = False
        #: the numbers the compiled update's hooks read that keep changing (symbolic_ints.py)
        self._update_changes: Optional[ChangingValues] = None
        self.training = True
        self._warned_settings = False
        self._hits_seen = 0
        #: the hook running now, named in fallback warnings
        self._hook = "calculate_train_batch_loss"

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        trainer = self.trainer
        # evaluate() sets up an engine without a training dataloader
        training = self.training = self.ctx.training
        train_reason = self.unsupported_reason(training=True) if training else None
        eval_reason = self.unsupported_reason(training=False)
        if train_reason is None or eval_reason is None:
            if isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel):
                # DDP's forward cannot be traced whole: dynamo breaks the graph at DDP's reducer
                # bookkeeping on purpose and compiles the wrapped module's forward on its own,
                # split at gradient-bucket boundaries (DDPOptimizer) so that the all-reduces of
                # the backward overlap it. fullgraph=True would refuse that, falling back to eager.
                self.settings = dataclasses.replace(self.settings, fullgraph=False)
            elif is_fsdp2(trainer.model):
                # FSDP2's hooks on each sharded module (all-gather before its forward, reshard
                # after, reduce-scatter of its gradients in the backward) are skipped by dynamo
                # (torch._dynamo.config.skip_fsdp_hooks): the graph breaks at every sharded
                # module and the compute of each block between two breaks is compiled as a graph
                # of its own, while the collectives run eagerly from the hooks on FSDP2's
                # streams. fullgraph=True would refuse the first break and fall back to eager.
                self.settings = dataclasses.replace(self.settings, fullgraph=False)
                # shard shapes differ between processes: no graph from another's cache
                separate_compile_cache_per_process()
            elif compiled_region_names(trainer.model):
                self.settings = _settings_with_regions(self.settings)
            self._functions = compiled_functions(self.ctx.compile_owner or trainer, self.settings)
        recompile_limit.install()
        self._hits_seen = recompile_limit.hit_count()
        if training and train_reason is None and trainer.optimizer is not None:
            recompile_limit.reserve_for(inner_optimizer(trainer.optimizer))
            self._functions.update_for(inner_optimizer(trainer.optimizer))
            self._eager_update = not self.compiles_fused_update and steps_in_fused_kernels(trainer.optimizer)
            if not self._eager_update:  # an eager update reads the groups' own values
                self._hparams = TensorHyperparams(trainer.optimizer, capturable=self.capturable_optimizer)
                self._hparams.apply()
        warn = not self.quiet_setup_fallback
        if train_reason is not None:
            self._fall_back_train(None, train_reason, self.setup_fallback, warn=warn, redo=False)
        if eval_reason is not None:
            warn_eval = warn and eval_reason != train_reason
            self._fall_back_eval(None, eval_reason, self.setup_fallback, warn=warn_eval, redo=False)

    def unsupported_reason(self, training: bool) -> Optional[str]:
        """Why this engine cannot run the training (or evaluation) steps of this trainer at all;
        checked once, at setup."""
        return None

    #: the engine used when :meth:`unsupported_reason` gives a reason
    setup_fallback = EagerEngine
    #: set by ``engine="auto"``: falling back at setup is then a choice, not worth a warning
    quiet_setup_fallback = False

    @property
    def active_engine(self) -> str:
        """The engine that runs training steps now (differs from :attr:`name` after a fallback)."""
        if self._train_fallback is not None:
            return getattr(self._train_fallback, "active_engine", self._train_fallback.name)
        return self.name

    @property
    def active_eval_engine(self) -> str:
        if self._eval_fallback is not None:
            return getattr(self._eval_fallback, "active_eval_engine", self._eval_fallback.name)
        return self.name

    @property
    def compiled_graphs(self) -> Dict[str, HookGraphs]:
        """For each forward hook that runs compiled and has been traced: how many graphs it
        became and why it broke (the engine a hook fell back to answers for it)."""
        report = {}
        for hook, fallback in ((TRAIN_HOOK, self._train_fallback), (EVAL_HOOK, self._eval_fallback)):
            if fallback is not None:
                entry = fallback.compiled_graphs.get(hook)
            else:
                entry = self._functions.report(hook) if self._functions is not None else None
            if entry is not None:
                report[hook] = entry
        return report

    # ------------------------------------------------------------------ fallback
    def _make_fallback(self, engine_cls) -> StepEngine:
        if issubclass(engine_cls, CompiledEngine):
            # the settings this engine runs with, not the trainer's again: those may ask for
            # what this engine had to leave out (inductor's CUDA graphs)
            engine = engine_cls(self.ctx, settings=self.settings)
        else:
            engine = engine_cls(self.ctx)
        engine.setup()
        return engine

    def _fall_back_train(
        self, hook: Optional[str], reason: str, engine_cls=EagerEngine, warn: bool = True, redo: bool = True,
        advice: str = "",
    ) -> None:
        if engine_cls is EagerEngine and self._hparams is not None:
            # the eager engine steps with the groups' own values and a host-side step counter; a
            # compiled fallback holds tensors again (the same ones) in its setup
            self._hparams.release()
        self._hparams = None
        self._train_fallback = self._make_fallback(engine_cls)
        if warn:
            self._warn(hook, reason, self._train_fallback, redo=redo, advice=advice)

    def _fall_back_eval(
        self, hook: Optional[str], reason: str, engine_cls=EagerEngine, warn: bool = True, redo: bool = True,
        advice: str = "",
    ) -> None:
        train_fallback = self._train_fallback
        if train_fallback is not None and isinstance(train_fallback, engine_cls):
            self._eval_fallback = train_fallback
        else:
            self._eval_fallback = self._make_fallback(engine_cls)
        if warn:
            self._warn(hook, reason, self._eval_fallback, phase="evaluation", redo=redo, advice=advice)

    def _warn(
        self, hook: Optional[str], reason: str, fallback: StepEngine, phase: str = "training", redo: bool = True,
        advice: str = "",
    ) -> None:
        target = getattr(fallback, "active_engine", fallback.name)
        where = f"the {hook!r} hook cannot run in the {self.name!r} engine" if hook else (
            f"the {self.name!r} engine cannot run here"
        )
        redone = "; the step that failed was undone and runs there once" if redo else ""
        warnings.warn(
            f"fasttrain: {where} ({reason}); {phase} falls back to the {target!r} engine for "
            f"the rest of this run{redone}." + (f" {advice}" if advice else ""),
            RuntimeWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ training
    def train_step(self, batch, update: bool) -> dict:
        fallback = self._train_fallback
        if fallback is not None:
            batch_output = fallback.train_step(batch, update)
            self.last_grad_norm = fallback.last_grad_norm
            return batch_output
        if self._trusted:
            return self._guarded_forward_step(batch, update)
        return self._snapshot_step(batch, update)

    def _snapshot_step(self, batch, update: bool) -> dict:
        # Until the first update succeeded, any part of the step may fail after another part
        # ran: snapshot first, undo on failure, redo the step on the fallback engine. The
        # snapshot comes in two parts so that no copy of the parameters is held while the
        # activations are (peak memory): the forward part copies the buffers, and the gradients
        # only where a backward may fail after accumulating (graph breaks, a user backward_step);
        # with one forward graph, a failure of its backward comes from the compile, before it ran.
        trainer = self.trainer
        model, optimizer = trainer.model, inner_optimizer(trainer.optimizer)
        flags = self.ctx.mutated_flags()
        gradients = not self._functions.is_whole(TRAIN_HOOK) or self.ctx.overrides("backward_step")
        snapshots = [StepSnapshot.before_forward(model, optimizer, gradients, extra=flags)]
        forward_output = []

        def before_update(batch_output):
            forward_output.append(batch_output)
            snapshots.append(StepSnapshot.before_update(model, optimizer, extra=flags))

        try:
            batch_output = self._compiled_train_step(batch, update, before_update)
        except Exception as error:  # noqa: BLE001 - any failure falls back, the eager redo re-raises real bugs
            if _is_control_flow(error):
                raise
            error = error.error if isinstance(error, _ForwardFailed) else error
            if forward_output:
                # the update failed: the forward and backward stand (their gradients are in the
                # update's snapshot); undo the update and redo only it on the fallback
                snapshots[1].restore()
                for snapshot in snapshots:
                    snapshot.release()
                self._fall_back_train(self._hook, describe_error(error), EagerEngine)
                self._train_fallback.update_step()
                self.last_grad_norm = self._train_fallback.last_grad_norm
                return forward_output[0]
            snapshots[0].restore()
            snapshots[0].release()
            return self._train_elsewhere(batch, update, error)
        for snapshot in snapshots:
            snapshot.release()
        if update:
            self._trusted = True
        return batch_output

    def _guarded_forward_step(self, batch, update: bool) -> dict:
        # After the first update only a new shape (the last partial batch) traces again; a trace
        # fails before anything runs, so falling back needs no snapshot.
        try:
            return self._compiled_train_step(batch, update)
        except _ForwardFailed as failure:
            return self._train_elsewhere(batch, update, failure.error)

    def _train_elsewhere(self, batch, update: bool, error: BaseException) -> dict:
        # A step that failed, and was undone, runs again: with the forward's constants where its
        # copy with symbolic values failed to compile, compiled with graph breaks where the
        # whole trace of the forward met one (and fullgraph was not given), else eagerly.
        if self._hook == TRAIN_HOOK and self._functions.drop_symbolic(TRAIN_HOOK):
            return self.train_step(batch, update)
        if self._hook == TRAIN_HOOK and self._functions.may_break(TRAIN_HOOK, error):
            self._functions.allow_breaks(TRAIN_HOOK)
            batch_output = self.train_step(batch, update)
            if self._train_fallback is None:
                self._warn_breaks(TRAIN_HOOK, error)
            return batch_output
        reason, advice = self._describe_failure(error)
        self._fall_back_train(self._hook, reason, EagerEngine, advice=advice)
        return self.train_step(batch, update)

    def _warn_breaks(self, hook: str, error: BaseException) -> None:
        report = self._functions.report(hook)
        reasons = "; ".join(report.reasons) if report.reasons else describe_error(error)
        warnings.warn(
            f"fasttrain: the {hook!r} hook cannot be traced as one graph, so it runs in the "
            f"{self.name!r} engine compiled with graph breaks: {report.graphs} graph(s), "
            f"{report.breaks} break(s) ({reasons}). "
            "trainer.compiled_graphs has the counts; compile_options={'fullgraph': False} accepts "
            "breaks without this warning, {'fullgraph': True} runs such a hook eagerly instead.",
            RuntimeWarning,
            stacklevel=5,
        )

    def _compiled_train_step(self, batch, update: bool, before_update: Optional[Callable] = None) -> dict:
        trainer = self.trainer
        # DDP reads no_sync's flag in its forward, so the forward runs inside the context too
        with self.no_sync_context(update):
            self._hook = TRAIN_HOOK
            try:
                batch_output, loss = self._call(TRAIN_HOOK, batch)
            except Exception as error:  # noqa: BLE001
                if _is_control_flow(error):
                    raise
                raise _ForwardFailed(error) from error
            self._hook = "backward_step"
            try:
                trainer.backward_step(loss)
            except Exception as error:  # noqa: BLE001
                # AOTAutograd compiles a new shape's backward on its first call, before it runs:
                # with the whole forward in one graph, nothing was accumulated yet
                if _is_control_flow(error) or not self._functions.is_whole(TRAIN_HOOK):
                    raise
                raise _ForwardFailed(error) from error
        if update:
            if before_update is not None:
                before_update(batch_output)
            self._compiled_update()
        if recompile_limit.hit_count() != self._hits_seen:
            self._limit_hit(training=True)
        return batch_output

    def _describe_failure(self, error: BaseException) -> Tuple[str, str]:
        """``(reason, advice)`` for a forward hook that failed.

        A forward traced whole (fullgraph) meets the recompile limit as an exception whose text
        blames fullgraph; dynamo's log of the hit says which guard failed. Taking the hit here
        also keeps the other phase from reading it as its own after its next step."""
        if recompile_limit.is_limit_failure(error):
            hits = recompile_limit.new_hits(self._hits_seen)
            self._hits_seen = recompile_limit.hit_count()
            if hits:
                return hits[-1], recompile_limit.what_to_change(hits[-1])
        return describe_error(error), ""

    def _limit_hit(self, training: bool) -> None:
        # Dynamo now runs some function of this step uncompiled, silently: the step that just ran
        # is correct, but the next ones would be part eager (with the tensor hyperparameters of a
        # compiled step: a host read per step). Say so, and run the plain eager engine instead.
        hits = recompile_limit.new_hits(self._hits_seen)
        self._hits_seen = recompile_limit.hit_count()
        reason = f"{hits[0]}; it runs that function uncompiled from now on"
        advice = recompile_limit.what_to_change(hits[0])
        if training:
            self._fall_back_train(None, reason, EagerEngine, redo=False, advice=advice)
        else:
            self._fall_back_eval(None, reason, EagerEngine, redo=False, advice=advice)

    def _compiled_update(self) -> None:
        trainer = self.trainer
        hparams = self._hparams
        if hparams is not None and hparams.groups_replaced:
            hparams.apply()  # the optimizer's state was loaded: hold the new groups' values
        clipper = getattr(trainer, "_clipper", None)
        if clipper is not None and clipper is not self._clipper_noted:
            # the gradients exist now, before this run's first update is traced (engine/clipping.py)
            clipper.note_gradient_layout()
            self._clipper_noted = clipper
        self._hook = "optimizer_step"
        with self.ctx.host_effects.kept_apart():
            norm = self._call_update()
        if norm is not None:
            self.last_grad_norm = norm
        if trainer.scheduler is not None and not self.ctx.step_was_skipped():
            trainer.scheduler_step()  # with the groups' own values, as in eager
            if hparams is not None:
                self._check_settings(hparams)
        self._hook = "optimizer_zero_grad"
        self.zero_grad()

    def _call_update(self):
        if self._eager_update:
            return _update(self.ctx)  # the same hooks, uncompiled
        if not self.symbolic_ints:
            return self._call(UPDATE)
        changes = self._update_changes
        if changes is None:
            changes = self._update_changes = ChangingValues(self._functions.codes[UPDATE])
        else:
            changes.before_call()
        norm = self._call(UPDATE)
        if changes.newly_changing() is not None:
            self._uncompile_update(changes)
        return norm

    def _uncompile_update(self, changes: ChangingValues) -> None:
        # A number the update's hooks read took its third value, and each compiled the update
        # again: the rest of the run calls the hooks uncompiled (as for a fused optimizer), with
        # the groups' own values (the held tensors are given back, as by a fallback to eager).
        self._eager_update = True
        if self._hparams is not None:
            self._hparams.release()
            self._hparams = None
        reason = recompile_limit.short_reason(changes.marked_by) if changes.marked_by else "a changing number"
        if self._warned_settings:
            # on_settings_changed said which setting the scheduler changes, and what to do
            what, advice = "a setting the scheduler changes (above)", ""
        else:
            what = "a Python number that changes between updates"
            advice = (" Keep counters and other per-step state out of the update's hooks (in a callback, or in "
                      "scheduler_step, which runs eagerly) to have it compiled.")
        warnings.warn(
            f"fasttrain: the optimizer update's hooks read {what} ({reason}), and each new value compiled "
            f"the update again; it runs uncompiled from now on (the forward and backward stay compiled).{advice}",
            RuntimeWarning,
            stacklevel=6,
        )

    def zero_grad(self) -> None:
        self.trainer.optimizer_zero_grad()

    def _call(self, hook: str, *args):
        """The compiled function of ``hook`` called with ``(ctx, *args)``, with the learning rates
        (and Adam's betas) in the optimizer's groups as the held device tensors, which the
        compiled code reads as graph inputs; the groups show their own values again after it
        (engine/hyperparams.py). Then, where this engine takes them, the numbers that keep
        changing are noted (symbolic_ints.py)."""
        functions = self._functions
        compiled = functions.function(hook, self.symbolic_ints)
        if self.symbolic_ints:
            functions.before_call(hook)
        hparams = self._hparams
        if hparams is None:
            result = compiled(self.ctx, *args)
        else:
            hparams.write()
            result = hparams.lent(compiled, self.ctx, *args)
        if self.symbolic_ints:
            functions.note_call(hook)
        return result

    def _check_settings(self, hparams: TensorHyperparams) -> None:
        changes = hparams.changed_settings()
        if not changes:
            return
        hparams.accept_changes()
        self.on_settings_changed(changes)

    def on_settings_changed(self, changes) -> None:
        """A scheduler changed optimizer settings that are compiled in as constants."""
        if self._warned_settings:
            return
        self._warned_settings = True
        warnings.warn(
            f"fasttrain: the scheduler changes {changes[0]} (and maybe more) between updates; each "
            f"new value recompiles the optimizer step. {settings_advice(changes)}.",
            RuntimeWarning,
            stacklevel=5,
        )

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, batch) -> dict:
        fallback = self._eval_fallback
        if fallback is not None:
            return fallback.eval_step(batch)
        try:
            batch_output = self._call(EVAL_HOOK, batch)
        except Exception as error:  # noqa: BLE001 - evaluation mutates nothing: just redo it
            if _is_control_flow(error):
                raise
            if self._functions.drop_symbolic(EVAL_HOOK):
                return self.eval_step(batch)  # its constants, as in training
            if self._functions.may_break(EVAL_HOOK, error):
                self._functions.allow_breaks(EVAL_HOOK)
                batch_output = self.eval_step(batch)
                if self._eval_fallback is None:
                    self._warn_breaks(EVAL_HOOK, error)
                return batch_output
            reason, advice = self._describe_failure(error)
            self._fall_back_eval(EVAL_HOOK, reason, EagerEngine, advice=advice)
            return self.eval_step(batch)
        if recompile_limit.hit_count() != self._hits_seen:
            self._limit_hit(training=False)
        return batch_output


def _settings_with_regions(settings: CompileSettings) -> CompileSettings:
    # compile_regions blocks are graph breaks inside the step's trace (fasttrain/regional.py says
    # why they are not nested regions of one graph): the forward is several graphs by design
    if settings.fullgraph:
        raise ValueError(
            "compile_options={'fullgraph': True} cannot hold with compile_regions: inside the "
            "compiled engines each compiled block is a graph break (blocks nested in the step's "
            "graph get wrong gradients from torch 2.13's Inductor). Drop 'fullgraph' to compile "
            "the blocks on their own, or drop compile_regions to compile the whole step as one graph."
        )
    return dataclasses.replace(settings, fullgraph=False)


class _ForwardFailed(Exception):
    """The compiled forward (or its backward's first compile) failed before this micro-step
    changed any gradient or parameter: the step can be redone elsewhere as it is."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _is_control_flow(error: BaseException) -> bool:
    # StopTrainingError ends training on purpose; it is not a failure of the engine.
    return isinstance(error, StopTrainingError)
