"""The graphed engine's evaluation: the compiled ``calculate_eval_batch_loss`` captured as a CUDA
graph (and the epoch's last, smaller batch as a graph of its own) and replayed.

A mixin of :class:`~fasttrain.engine.cudagraph.CudaGraphEngine`, before ``CompiledEngine`` in its
bases: a step that is not replayed runs the compiled engine's evaluation step. Capture, memory
pool, side stream, long-lived allocations and fallbacks are the engine's; evaluation changes no
weights, so a failed capture is simply redone on the fallback.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from fasttrain.engine.capture_policy import (
    MAX_OFF_GRAPH_SHAPES,
    MAX_RECAPTURES,
    OVERLAPPING_BATCH_REASON,
    WARM_RUNS_OF_THE_LAST_SHAPE,
    WARMUP_STEPS_PER_SHAPE,
    CaptureRefused,
    failing_hook,
    recaptured_too_often,
    refusal_reason,
    refuse_changed,
)
from fasttrain.engine.compile_events import (
    CHANGING_VALUE_ADVICE,
    CompileMark,
    StaleCapture,
    is_stale,
    stale_capture_reason,
)
from fasttrain.engine.compiled import CompiledEngine, _is_control_flow
from fasttrain.engine.compiled_functions import EVAL_HOOK
from fasttrain.engine.graph_buffers import CapturedStep, StaticBatch, StepRing, batch_signature
from fasttrain.engine.host_state import HostStateWatch
from fasttrain.engine.step_guards import FramesRun, ReplayGuards, changed_value_reason


class GraphedEvaluation:
    """Evaluation steps replayed from captured graphs; see the module docstring."""

    def _init_eval_graphs(self) -> None:
        self._eval_graph: Optional[CapturedStep] = None
        self._eval_last_graph: Optional[CapturedStep] = None
        self._eval_static: Optional[StaticBatch] = None
        self._eval_last_static: Optional[StaticBatch] = None
        self._eval_ring: Optional[StepRing] = None
        self._eval_warm = Counter()
        self._eval_off_graph_shapes = set()
        #: evaluation graphs dropped because the step's Python values changed (step_guards.py)
        self._eval_recaptures = 0
        # the model the evaluation graph was captured with (a callback may swap trainer.model)
        self._eval_graphed_model = None

    def eval_step(self, batch) -> dict:
        if self._eval_fallback is not None:
            return self._eval_fallback.eval_step(batch)
        signature = batch_signature(batch)
        captured = self._eval_graph
        if captured is not None and self.trainer.model is not self._eval_graphed_model:
            # ModelEmaCallback evaluates its EMA model by swapping it in: not the graphed one
            return super().eval_step(batch)
        if captured is not None:
            if signature == self._eval_static.signature:
                return self._replay_eval(captured, batch)
            self._eval_off_graph_shapes.add(signature)
            if len(self._eval_off_graph_shapes) > MAX_OFF_GRAPH_SHAPES:
                self._fall_back_eval(
                    "calculate_eval_batch_loss",
                    "the evaluation batches change shape (dynamic shapes); a CUDA graph replays one shape",
                    CompiledEngine,
                    redo=False,
                )
                return self.eval_step(batch)
            # the last, partial batch: a graph of its own in the shared pool, as in training
            last = self._eval_last_graph
            if last is not None:
                return self._replay_eval(last, batch)
            if self._eval_warm[signature] >= WARM_RUNS_OF_THE_LAST_SHAPE:
                return self._capture_eval(batch, signature, last=True)
            self._release_graphs()
        if self._eval_warm[signature] >= WARMUP_STEPS_PER_SHAPE:
            return self._capture_eval(batch, signature)
        return self._eval_warmup_step(batch, signature)

    def _eval_warmup_step(self, batch, signature) -> dict:
        # on the side stream the graphs are captured on, as in training (_warmup_step)
        with self._on_side_stream():
            batch_output = super().eval_step(batch)
        self._eval_warm[signature] += 1
        return batch_output

    def _replay_eval(self, captured: CapturedStep, batch) -> dict:
        if self._hparams is not None:
            self._hparams.write()
        changed = self._values_changed(captured)
        if changed is not None:
            # the step's Python would run another compiled variant (step_guards.py): this step
            # runs compiled, and the graphs are captured again, or no longer where that repeats
            self._drop_eval_graphs()
            self._eval_warm.clear()
            self._eval_recaptures += 1
            if self._eval_recaptures > MAX_RECAPTURES:
                reason = recaptured_too_often(changed_value_reason(changed[1]), self._eval_recaptures)
                self._fall_back_eval(changed[0], reason, CompiledEngine, redo=False, advice=CHANGING_VALUE_ADVICE)
            return self.eval_step(batch)
        captured.static.load(batch)
        batch_output = captured.replay()[0]
        if captured.effects is not None:
            self.ctx.host_effects.redo(captured.effects)
        return batch_output

    def _capture_eval(self, batch, signature, last: bool = False) -> dict:
        with self._long_lived_allocations():
            static = StaticBatch(batch)
        if static.signature != signature:
            self._fall_back_eval("calculate_eval_batch_loss", OVERLAPPING_BATCH_REASON, CompiledEngine, redo=False)
            return self.eval_step(batch)
        ring = self._eval_ring

        def body():
            self._hook = "calculate_eval_batch_loss"
            batch_output = self._functions.eval_forward(self.ctx, static.tree)
            ring.record(batch_output, None)
            return batch_output

        effects = self.ctx.host_effects
        mark = effects.mark()
        compiles = CompileMark()
        host_state = HostStateWatch(self._hook_owners())
        try:
            frames = FramesRun(lambda: self._hook)
            graph, batch_output = self._capture_lent(lambda: frames.run(body))
            taken = effects.taken_since(mark)  # raises where a replay could not redo them
            refuse_changed(host_state)  # predictions appended to a list, say
            if compiles.saw_changed_values():
                raise StaleCapture(stale_capture_reason(compiles))  # as in training
            ctx, tree = self.ctx, static.tree
            guards = ReplayGuards.taken(
                [(EVAL_HOOK, self._functions.codes[EVAL_HOOK], lambda: {"ctx": ctx, "batch": tree})], frames
            )
            self._refuse_unreplayable(guards, frames)  # as in training
        except Exception as error:  # noqa: BLE001 - evaluation mutates nothing: redo on the fallback
            effects.discard(mark)
            if _is_control_flow(error):
                raise
            host_state.restore()
            self._drop_eval_graphs()
            stale = is_stale(error, compiles, CaptureRefused)
            if stale and self._stale.capture_again_later(("eval", last, False)):
                return self._eval_warmup_step(batch, signature)  # the next one captures
            reason = stale_capture_reason(compiles) if stale else refusal_reason(error)
            self._fall_back_eval(failing_hook(error, self._hook), reason, CompiledEngine)
            return self.eval_step(batch)
        self._stale.kept(("eval", last, False))
        captured = CapturedStep(graph, batch_output, None, ring, keep_model_outputs=self.ctx.keeps_model_outputs("eval"))
        captured.effects = taken
        captured.guards = guards
        del batch_output  # what the step keeps is in the CapturedStep
        captured.static = static
        if last:
            self._eval_last_graph, self._eval_last_static = captured, static
        else:
            self._eval_graph, self._eval_static = captured, static
        self._eval_graphed_model = self.trainer.model
        return self._replay_eval(captured, batch)

    def _drop_eval_graphs(self) -> None:
        self._eval_graph = self._eval_last_graph = None
        self._eval_static = self._eval_last_static = self._eval_graphed_model = None
