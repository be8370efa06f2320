"""The CUDA-graphed step engine: whole micro-steps captured once and replayed.

Two training graphs are captured, lazily, the first time each is needed after warm-up:

* a non-update micro-step: forward + loss (the compiled ``calculate_train_batch_loss``) and
  ``backward_step``, accumulating into the gradients;
* an update micro-step: the same, then gradient clipping, ``optimizer_step`` and
  ``zero_grad(set_to_none=False)``;

and one evaluation graph (the compiled ``calculate_eval_batch_loss`` under ``no_grad``;
:mod:`fasttrain.engine.graph_eval`). Each graph also writes its loss (and grad norm, token count)
into a device ring with the fused ``accumulate_loss_`` kernel, so the host gets views it can keep
until the next flush. When a step is captured, and why one is not: :mod:`fasttrain.engine.capture_policy`.

A replay is: copy the batch into the static input buffers, replay, hand back ring views. The
scheduler step and callbacks run on the host between replays; a learning rate the scheduler set
is copied into the tensor the graph reads before the next replay (:mod:`fasttrain.engine.hyperparams`). Nothing in the captured region may read a device value
on the host: capture runs under ``torch.cuda.set_sync_debug_mode("error")``, so such a read
raises before it happens, and the engine falls back to the compiled engine with one warning
naming the hook. The first steps (warm-up) run the compiled engine's path on a side stream;
that also compiles the functions the graphs then capture, so capture triggers no compilation.

The epoch's last, smaller batch gets graphs of its own, captured into the same memory pool, so
that it adds no activations beside the pool's. Its first run compiles its shape; before that run
every graph is dropped and its memory handed back (one ``empty_cache``, a device sync, once per
run), and the graphs are captured again, with no further warm-up, when their shapes come next.
From the second epoch on every batch replays a graph.

Requirements: a CUDA device, one process (DDP capture needs DDP built on a side stream, which
accelerate does not do; FSDP2 steps are never captured, see ``FSDP2_REASON``), SGD/Adam/AdamW
(foreach ones captured with ``capturable=True``, fused ones as they are), no fp16 loss scaling, batches of one shape and the epoch's
last, smaller one (any other change of shape falls back to the compiled engine), and hooks whose
Python control flow does not change between steps and that change no Python state inside the
step (a graph replays the kernels recorded at capture; :mod:`fasttrain.engine.host_state`). Before
each replay dynamo's guards of the compiled code the capture ran are checked on the host
(:mod:`fasttrain.engine.step_guards`): a step whose Python values changed since is not replayed.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, Optional

import torch

from fasttrain.engine.capture_policy import (
    FSDP2_REASON,
    MAX_OFF_GRAPH_SHAPES,
    MAX_RECAPTURES,
    MIN_WARMUP_STEPS,
    OVERLAPPING_BATCH_REASON,
    WARM_RUNS_OF_THE_LAST_SHAPE,
    WARMUP_STEPS_PER_SHAPE,
    WARMUP_UPDATES,
    CaptureRefused,
    failing_hook,
    recaptured_too_often,
    refusal_reason,
    refuse_changed,
)
from fasttrain.engine.compiled import CompiledEngine, _is_control_flow
from fasttrain.engine.compiled_functions import TRAIN_HOOK, UPDATE, CompileSettings
from fasttrain.engine.compile_events import (
    CHANGING_VALUE_ADVICE,
    CompileMark,
    StaleCapture,
    StaleCaptures,
    compiling_hook,
    is_stale,
    stale_capture_reason,
)
from fasttrain.engine.context import StepContext
from fasttrain.sharding import is_fsdp2
from fasttrain.engine.graph_capture import DeviceCapture
from fasttrain.engine.graph_buffers import CapturedStep, StaticBatch, StepRing, batch_signature
from fasttrain.engine.graph_grads import GradientKeeper
from fasttrain.engine.hyperparams import CAPTURABLE_OPTIMIZERS, TensorHyperparams, inner_optimizer, settings_advice
from fasttrain.engine.long_lived import LongLivedTensors
from fasttrain.engine.graph_eval import GraphedEvaluation
from fasttrain.engine.host_state import HostStateWatch
from fasttrain.engine.replay_guard import CaptureRecord
from fasttrain.engine.snapshot import ReferenceSnapshot
from fasttrain.engine.step_guards import FramesRun, ReplayGuards, changed_value_reason, unverifiable_reason
from fasttrain.kernels import hold_chunk_tables

class CudaGraphEngine(DeviceCapture, GraphedEvaluation, CompiledEngine):
    """Replays captured CUDA graphs of whole micro-steps; see the module docstring."""

    name = "cudagraph"
    setup_fallback = CompiledEngine
    # a symbolic integer would be replayed at its captured value: the graphs' code keeps its
    # constants and its guards, checked before each replay (step_guards.py)
    symbolic_ints = False
    # the update is captured through its compiled function (its guards are the replay's guards)
    compiles_fused_update = True

    def __init__(self, ctx: StepContext, settings: Optional[CompileSettings] = None):
        super().__init__(ctx, settings)
        #: graphs of the batch shape, by update; those of the epoch's last, partial batch
        self._train_graphs: Dict[bool, CapturedStep] = {}
        self._last_graphs: Dict[bool, CapturedStep] = {}
        self._static: Optional[StaticBatch] = None
        self._last_static: Optional[StaticBatch] = None
        self._train_ring: Optional[StepRing] = None
        self._init_eval_graphs()
        self._warm = Counter()
        self._warm_steps = 0
        self._warm_updates = 0
        #: warm updates that read nothing on the host (the masked skip armed, or no check)
        self._sync_free_updates = 0
        self._off_graph_shapes = set()
        self._stream = None
        self._pool = None
        self._own_zero_grad = True
        #: the gradient tensors the graphs write into, kept across hooks that set them to None
        self._grads = GradientKeeper()
        #: gradients moved out of the warm-up's activation memory (the state is made apart)
        self._long_lived = LongLivedTensors()
        # the model each graph was captured with (a callback may swap trainer.model)
        self._graphed_model = None
        self._last_trainable = ()
        self._recaptures = 0
        #: per graph, the captures in a row during which the hooks compiled again
        self._stale = StaleCaptures()

    # ------------------------------------------------------------------ setup
    def _device_reason(self) -> Optional[str]:
        device = torch.device(self.trainer.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"CUDA graphs need a CUDA device; the trainer runs on {device}"
        return None

    def unsupported_reason(self, training: bool) -> Optional[str]:
        trainer = self.trainer
        # before the device: the sharded set-up decides on every device, so the CPU tests see it
        if is_fsdp2(trainer.model):
            return FSDP2_REASON
        reason = self._device_reason()
        if reason is not None:
            return reason
        if trainer.run_config is not None and trainer.run_config.is_distributed:
            return (
                "capturing DDP needs DDP constructed on a side stream and NCCL's async error "
                "handling off, which accelerate's setup does not do"
            )
        if not training:
            return None
        if self.ctx.capture_blockers:
            return self.ctx.capture_blockers[0]
        optimizer = inner_optimizer(trainer.optimizer)
        if not isinstance(optimizer, CAPTURABLE_OPTIMIZERS):
            return (
                f"{type(optimizer).__name__} has no capturable (sync-free) step; fasttrain "
                "captures SGD, Adam and AdamW"
            )
        for group in optimizer.param_groups:
            # A fused step keeps its step counters on the device and takes the learning rate as a
            # device tensor (TensorHyperparams holds it so): it reads nothing on the host, and is
            # captured as it is. A differentiable one keeps autograd history across steps.
            if group.get("differentiable"):
                return "differentiable optimizers are not captured; use the default (foreach) or fused=True"
        return None

    def setup(self) -> None:
        super().setup()
        trainer = self.trainer
        if self._train_fallback is not None and self._eval_fallback is not None:
            return
        device = torch.device(trainer.device)
        self._create_stream_and_pool(device)
        config = trainer.run_config
        if self.training and self._train_fallback is None:
            # every micro-step between two flushes needs its own slot
            accumulation = config.gradient_accumulation_steps
            self._train_ring = StepRing(trainer.log_every_n_steps * accumulation + accumulation, device)
            self._train_ring.warm_up()
            self._own_zero_grad = not self.ctx.overrides("optimizer_zero_grad")
        if self._eval_fallback is None:
            self._eval_ring = StepRing(trainer.log_every_n_steps + 1, device)
            self._eval_ring.warm_up()

    def zero_grad(self) -> None:
        # Warm-up updates (the compiled engine's path). Graphs write into the gradient tensors
        # that existed at capture: keep them, zeroed.
        optimizer = inner_optimizer(self.trainer.optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = self._grads
        grads.remember(params)
        if self._own_zero_grad:
            optimizer.zero_grad(set_to_none=False)
        else:
            before = [(p, p.grad) for p in params]
            self.trainer.optimizer_zero_grad()
            grads.note_hook(before)  # whether the hook drops gradients: see _captured_zero_grad

    def _captured_zero_grad(self):
        """What an update graph records in the zero-grad hook's place."""
        if self._own_zero_grad:
            optimizer = inner_optimizer(self.trainer.optimizer)
            return lambda: optimizer.zero_grad(set_to_none=False)
        if self._grads.cleared:
            # the hook drops gradients, which a graph cannot record: it runs after each replay
            # (see _replay), and the graph zeroes in place what it drops (graph_grads.py)
            return self._grads.zero_cleared
        return self.trainer.optimizer_zero_grad

    # ------------------------------------------------------------------ training
    def train_step(self, batch, update: bool) -> dict:
        if self._train_fallback is not None:
            return super().train_step(batch, update)
        if self._graphed_model is not None and self.trainer.model is not self._graphed_model:
            # a callback swapped the model in (an EMA model, say): the graphs hold the other
            # one's tensors, so this step runs through the compiled path
            return super().train_step(batch, update)
        ahead = self.ctx.zero_grad_before_step
        if ahead is None:
            return self._graphed_train_step(batch, update)
        with ahead:  # the trainer's clearing of the gradients, before the step (context.py)
            return self._graphed_train_step(batch, update)

    def _graphed_train_step(self, batch, update: bool) -> dict:
        if self.ctx.step_in_epoch() == 0:
            self._check_trainable()
            self._check_model_parameters()
        signature = batch_signature(batch)
        captured = self._train_graphs.get(update)
        if captured is not None and signature == self._static.signature:
            return self._replay(captured, batch, update)
        if self._static is not None and signature != self._static.signature:
            return self._off_graph_step(batch, update, signature)
        if self._ready_to_capture(update, signature):
            return self._capture_and_replay(batch, update, signature)
        return self._warmup_step(batch, update, signature)

    def _trainable(self) -> tuple:
        return tuple(p.requires_grad for p in self.trainer.model.parameters())

    def _check_trainable(self) -> None:
        # Freezing or unfreezing layers (finetuning callbacks do it at epoch starts) changes what
        # backward computes, which a graph would not see: checked once per epoch, at its first
        # step, and the graphs are captured again. A newly frozen parameter also loses its
        # zeroed gradient, so that the optimizer skips it as it does after zero_grad() in eager
        # (a zero gradient would still move it by momentum and weight decay).
        trainable = self._trainable()
        if self._last_trainable and trainable != self._last_trainable:
            for p, requires_grad in zip(self.trainer.model.parameters(), trainable):
                if not requires_grad:
                    p.grad = None
            self._drop_graphs()
        self._last_trainable = trainable

    def _is_last_batch(self) -> bool:
        last = self.ctx.last_batch
        if last is not None:
            return last()
        batches = self.ctx.train_batches()
        return batches is not None and self.ctx.step_in_epoch() + 1 == batches

    def _ready_to_capture(self, update: bool, signature) -> bool:
        # The update graph waits for a second warm update: the first creates the optimizer
        # state and may take another path through the hooks (nonfinite="skip" checks it on the
        # host until the state exists), so the second is the first to compile what is captured.
        # An update is captured only after one ran without a host read: updates whose gradients
        # were not finite before the masked skip could arm (no optimizer state yet) were checked
        # on the host, and a capture of that check would fail and end capturing for good.
        return (
            self._warm_steps >= MIN_WARMUP_STEPS
            and self._warm_updates >= (WARMUP_UPDATES if update else 1)
            and (not update or self._sync_free_updates >= 1)
            and self._warm[signature] >= WARMUP_STEPS_PER_SHAPE
            and not self._is_last_batch()  # the last batch may be partial: never capture it
        )

    def _warmup_step(self, batch, update: bool, signature) -> dict:
        # Warm-up runs the compiled path on the side stream the graphs are captured on, so that
        # lazily created per-stream state (cuBLAS workspaces, the compiled kernels) exists.
        with self._on_side_stream():
            batch_output = super().train_step(batch, update)
        if self._train_fallback is None:
            self._warm[signature] += 1
            self._warm_steps += 1
            self._warm_updates += int(update)
            self._sync_free_updates += int(update and not self.ctx.update_read_host())
        return batch_output

    def _compiled_update(self) -> None:
        # The update that creates the optimizer's state allocates it with the tensors that
        # outlive the captures (long_lived.py): made in the default pool just after backward
        # freed the activations, the state would pin their segments. (It cannot be moved later:
        # the compiled update is specialised to the state tensors it was traced with.)
        if self._train_fallback is None and self._state_missing():
            with self._long_lived_allocations():
                super()._compiled_update()
        else:
            super()._compiled_update()

    def _state_missing(self) -> bool:
        optimizer = inner_optimizer(self.trainer.optimizer)
        state = optimizer.state
        return any(p.grad is not None and not state.get(p) for g in optimizer.param_groups for p in g["params"])

    def _off_graph_step(self, batch, update: bool, signature) -> dict:
        # A batch of another shape than the captured one. The epoch's last, partial batch gets
        # graphs of its own in the shared pool (exact loss, no second set of activations); shapes
        # that keep changing mean dynamic shapes.
        self._off_graph_shapes.add(signature)
        if not self._is_last_batch() or len(self._off_graph_shapes) > MAX_OFF_GRAPH_SHAPES:
            self._fall_back_train(
                "calculate_train_batch_loss",
                "the batches change shape (dynamic shapes); a CUDA graph replays one shape. Pad "
                "or bucket the batches to keep graphs",
                CompiledEngine,
                redo=False,
            )
            return super().train_step(batch, update)
        captured = self._last_graphs.get(update)
        if captured is not None:
            return self._replay(captured, batch, update)
        if self._warm[signature] >= WARM_RUNS_OF_THE_LAST_SHAPE:
            return self._capture_and_replay(batch, update, signature, last=True)
        # Its first run compiles the shape and takes a full set of activations: not beside the
        # pool the graphs hold, so they go first and are captured again when their shapes come
        self._release_graphs()
        return self._warmup_step(batch, update, signature)

    def _capture_and_replay(self, batch, update: bool, signature, last: bool = False) -> dict:
        optimizer = inner_optimizer(self.trainer.optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self._pool is None or not self._graphs_held():
            # this capture takes a new pool: first the tensors that outlive it leave the
            # warm-up's activation memory, so that the pool's empty_cache can hand it back
            with self._long_lived_allocations():
                self._long_lived.move(params, self._grads.kept)
        static = self._last_static if last else self._static
        if static is None:
            with self._long_lived_allocations():
                static = StaticBatch(batch)
            if static.signature != signature:
                self._fall_back_train("calculate_train_batch_loss", OVERLAPPING_BATCH_REASON, CompiledEngine, redo=False)
                return self.train_step(batch, update)
            if last:
                self._last_static = static
            else:
                self._static = static
        graphs = self._last_graphs if last else self._train_graphs
        # gradients a hook set to None get their tensors back (zeroed) for the graph to write into
        self._grads.restore(params)
        references = ReferenceSnapshot(optimizer)
        grads = [(p, p.grad) for p in params]
        if update:
            self.ctx.before_update_capture()
        effects = self.ctx.host_effects
        mark = effects.mark()
        compiles = CompileMark()
        host_state = HostStateWatch(self._hook_owners())
        try:
            # the clip kernels' chunk tables are addressed by the graph: it keeps them alive
            with hold_chunk_tables() as tables:
                zero_grad = self._captured_zero_grad()
                frames = FramesRun(lambda: self._hook)
                graph, (batch_output, norm) = self._capture_lent(
                    lambda: frames.run(lambda: self._train_body(static.tree, update, zero_grad))
                )
            taken = effects.taken_since(mark)  # raises where a replay could not redo them
            if any(p.grad is not grad for p, grad in grads):
                raise CaptureRefused(
                    "a hook replaced or removed gradient tensors during capture; call "
                    "zero_grad(set_to_none=False) in optimizer_zero_grad"
                )
            refuse_changed(host_state)
            if compiles.saw_changed_values():
                # the warm-up compiled everything a capture runs, unless the step's Python reads a
                # value that changed since (compile_events.py): that value would replay for good
                raise StaleCapture(stale_capture_reason(compiles))
            guards = self._replay_guards(static.tree, update, frames)
            self._refuse_unreplayable(guards, frames)
        except Exception as error:  # noqa: BLE001 - capture only records: nothing ran, redo on the fallback
            effects.discard(mark)
            if _is_control_flow(error):
                raise
            references.restore()
            host_state.restore()  # the step that runs instead changes them once
            self._drop_graphs()
            stale = is_stale(error, compiles, CaptureRefused)
            if stale and self._stale.capture_again_later(("train", last, update)):
                return self._warmup_step(batch, update, signature)
            reason = stale_capture_reason(compiles) if stale else refusal_reason(error)
            hook = compiling_hook(compiles, self._hook) if stale else failing_hook(error, self._hook)
            self._fall_back_train(hook, reason, CompiledEngine)
            return self.train_step(batch, update)
        self._stale.kept(("train", last, update))
        self._grads.remember(params)  # the tensors this graph writes into
        captured = graphs[update] = CapturedStep(
            graph, batch_output, norm, self._train_ring, tables, keep_model_outputs=self.ctx.keeps_model_outputs("train")
        )
        captured.effects = taken
        del batch_output  # what the step keeps is in the CapturedStep
        captured.static = static
        captured.record = CaptureRecord(self.trainer.model, optimizer)
        captured.guards = guards
        self._graphed_model = self.trainer.model
        return self._replay(captured, batch, update)

    def _replay_guards(self, batch, update: bool, frames: FramesRun) -> ReplayGuards:
        # Right after a capture: the guards of the compiled variants it ran, with the arguments
        # each call gets (the graph reads its batch from the static buffers; step_guards.py), and
        # those of the other compiled frames it ran (after graph breaks, compiled regions)
        codes, ctx = self._functions.codes, self.ctx
        calls = [(TRAIN_HOOK, codes[TRAIN_HOOK], lambda: {"ctx": ctx, "batch": batch})]
        if update:
            calls.append((UPDATE, codes[UPDATE], lambda: {"ctx": ctx}))
        # the hooks the step's eager code calls compiled (fasttrain.lightning: on_before_backward
        # and on_after_backward, the module's and the callbacks')
        calls += ctx.host_effects.guarded_calls()
        return ReplayGuards.taken(calls, frames)

    def _values_changed(self, captured: CapturedStep) -> Optional[tuple]:
        # ``(hook, guard)`` where the step's Python would now run other compiled code than the
        # graph's. Checked with the hyperparameter tensors lent to the groups, as the capture ran.
        guards = captured.guards
        if guards is None:
            return None
        return self._guards_failure(guards)

    def _guards_failure(self, guards: ReplayGuards) -> Optional[tuple]:
        hparams = self._hparams
        return guards.failure() if hparams is None else hparams.lent(guards.failure)

    def _refuse_unreplayable(self, guards: ReplayGuards, frames: FramesRun) -> None:
        # Right after a capture (training's or evaluation's), what no check before a replay could
        # tell from a stale replay refuses it (the reasons say more): the user's code that ran
        # uncompiled, which no guard checks; and a guard that fails already, when nothing outside
        # the step has run, so reads what the step itself sets and clears
        uncompiled = frames.uncompiled_reason()
        if uncompiled is not None:
            self._hook = frames.uncompiled[0]
            raise CaptureRefused(uncompiled)
        failed = self._guards_failure(guards)
        if failed is not None:
            self._hook = failed[0]
            raise CaptureRefused(unverifiable_reason(failed[1]))

    def _capture_lent(self, body):
        # The compiled functions are captured reading the held hyperparameter tensors, lent to
        # the groups for the body (host work, nothing recorded); the groups' values are copied
        # into them before the capture (a copy inside it would be recorded, and every replay
        # would write that value again), as before each replay.
        hparams = self._hparams
        if hparams is None:
            return self._capture(body)
        hparams.write()
        return self._capture(lambda: hparams.lent(body))

    def _hook_owners(self) -> list:
        # the objects whose attributes the step's hooks may change: the trainer, its model and
        # the module under a wrapper (DDP's, or the step module of a LightningModule)
        model = self.trainer.model
        owners = [self.trainer, model, getattr(model, "module", None)]
        return [(owner, type(owner).__name__) for owner in owners if owner is not None]

    def _train_body(self, batch, update: bool, zero_grad):
        trainer = self.trainer
        functions = self._functions
        with self.no_sync_context(update):
            self._hook = "calculate_train_batch_loss"
            batch_output, loss = functions.train_forward(self.ctx, batch)
            self._hook = "backward_step"
            trainer.backward_step(loss)
        norm = None
        if update:
            self._hook = "optimizer_step"
            with self.ctx.host_effects.kept_apart():
                norm = functions.update(self.ctx)
            self._hook = "optimizer_zero_grad"
            zero_grad()
        self._hook = "loss accumulation"
        self._train_ring.record(batch_output, norm)
        return batch_output, norm

    def _replay(self, captured: CapturedStep, batch, update: bool) -> dict:
        hparams = self._hparams
        if hparams.groups_replaced:
            # the optimizer's state was loaded: the graphs hold the old tensors; warm up again
            self._drop_graphs()
            hparams.apply()
            return self.train_step(batch, update)
        if not self._replay_safe(captured):
            return self.train_step(batch, update)
        hparams.write()  # the scheduler's new values, into the tensors the graph reads
        changed = self._values_changed(captured)
        if changed is not None:
            # the step's Python would run another compiled variant: this step runs compiled, and
            # the graphs are captured again (or, where that keeps happening, no longer)
            hook, guard = changed
            self._recapture(changed_value_reason(guard), inner_optimizer(self.trainer.optimizer), hook, CHANGING_VALUE_ADVICE)
            return self.train_step(batch, update)
        captured.static.load(batch)
        batch_output, norm = captured.replay()
        if captured.effects is not None:
            self.ctx.host_effects.redo(captured.effects)
        if update:
            self.last_grad_norm = norm
            if self._grads.cleared and not self._own_zero_grad:
                # the zero-grad hook that drops gradients runs here, eagerly (graph_grads.py)
                self.trainer.optimizer_zero_grad()
                self._grads.after_hook_following_a_replay()
            trainer = self.trainer
            if trainer.scheduler is not None:
                trainer.scheduler_step()
                self._check_settings(hparams)
        return batch_output

    def _replay_safe(self, captured: CapturedStep) -> bool:
        # Host-only identity checks (replay_guard.py): a hook or callback between replays may
        # have rebound gradients (put back, with the value it meant) or changed what the graph
        # was captured with (captured again). A replay never runs on stale tensors.
        record = captured.record
        optimizer = inner_optimizer(self.trainer.optimizer)
        known_zero = self._grads.take_known_zero()  # valid for this replay only
        reason = record.structure_change(optimizer)
        if reason is None and record.grads_rebound():
            reason = record.restore_grads(known_zero)
        if reason is None:
            return True
        self._recapture(reason, optimizer)
        return False

    def _check_model_parameters(self) -> None:
        # walks the module tree, so once per epoch (with the requires_grad check) and not per replay
        captured = next(iter(self._train_graphs.values()), None)
        if captured is None or self.trainer.model is not self._graphed_model:
            return
        reason = captured.record.model_change(self.trainer.model)
        if reason is not None:
            # the evaluation graphs' forward read the same parameters
            self._drop_eval_graphs()
            self._eval_warm.clear()
            self._eval_off_graph_shapes.clear()
            self._recapture(reason, inner_optimizer(self.trainer.optimizer))

    def _recapture(self, reason: str, optimizer, hook: Optional[str] = None, advice: str = "") -> None:
        self._drop_graphs()
        self._recaptures += 1
        if self._recaptures > MAX_RECAPTURES:
            self._fall_back_train(
                hook, recaptured_too_often(reason, self._recaptures), CompiledEngine, redo=False, advice=advice
            )
            return
        if optimizer is not self._hparams.optimizer:
            if not isinstance(optimizer, CAPTURABLE_OPTIMIZERS):
                self._fall_back_train(
                    None, f"{reason}, and {type(optimizer).__name__} has no capturable step", CompiledEngine, redo=False
                )
                return
            self._hparams = TensorHyperparams(optimizer, capturable=self.capturable_optimizer)
            self._hparams.apply()

    def on_settings_changed(self, changes) -> None:
        # The graph has the old value compiled in; the update that just ran used it correctly
        # (the scheduler runs after the step), the next one would not.
        self._drop_graphs()
        self._fall_back_train(
            None,
            f"the scheduler changes {changes[0]}, which a captured graph would keep at its captured "
            "value",
            CompiledEngine,
            redo=False,
            advice=f"{settings_advice(changes)}.",
        )

    def _drop_graphs(self) -> None:
        # what they were captured with changed: warm up again before the next capture
        self._drop_train_graphs()
        self._warm.clear()
        self._warm_steps = self._warm_updates = self._sync_free_updates = 0

    def _drop_train_graphs(self) -> None:
        self._train_graphs.clear()
        self._last_graphs.clear()
        self._graphed_model = None
        self._static = self._last_static = None

    def _graphs_held(self) -> bool:
        return bool(self._train_graphs or self._last_graphs) or self._eval_graph is not None or self._eval_last_graph is not None

    def _release_graphs(self) -> None:
        # Before the first run of the partial batch's shape: every graph goes (keeping the warm-up
        # counts, so they are captured again at their shapes' next batch) and the memory pool is
        # handed back, so that run's activations are not taken beside it.
        if not self._graphs_held():
            return
        self._drop_train_graphs()
        self._drop_eval_graphs()
        self._return_cached_memory()
