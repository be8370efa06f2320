"""The fasttrain ``Trainer`` that runs a LightningModule: its hooks call the module's.

fasttrain's step engines call ``calculate_train_batch_loss`` -> ``backward_step`` -> (on update
steps) the context's ``clip`` -> ``optimizer_step`` -> ``optimizer_zero_grad``. Here those run the
module's ``training_step`` and Lightning's hooks around backward and the update, in Lightning's
order, so an unchanged module gets the eager, compiled or CUDA-graphed step. Lightning's
schedulers, validation cadence and logging are driven by :mod:`fasttrain.lightning.loops`, which
replaces the epoch loop (:meth:`ModuleRunner.train`) and calls the engine once per batch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from fasttrain import prepare, signals
from fasttrain.accelerate_state import build_accelerator
from fasttrain.engine.compiled_functions import CompileSettings, settings_for_engine
from fasttrain.sharding import is_fsdp2
from fasttrain.lightning.combined import CombinedData
from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.fast_log import step_logger
from fasttrain.lightning.grad_modes import anomaly_context
from fasttrain.lightning.graph_logging import LoggedCalls
from fasttrain.lightning.graphed_hooks import GraphedBackwardHooks
from fasttrain.lightning.plugins import share_loss_scaler
from fasttrain.lightning.profiler import profiling, strategy_action, timed
from fasttrain.lightning.skipped_steps import StepReturnedNone, check_none_step, raise_step_returned_none
from fasttrain.trainer import Trainer as FasttrainTrainer


class _StepClosure(Closure):
    """The ``optimizer_closure`` a module's ``optimizer_step`` receives: Lightning's ``Closure``
    (an ``isinstance`` check holds), evaluating the training step and backward of
    :meth:`ModuleRunner.closure_step`; a call returns a detached copy of the loss backward saw,
    as Lightning's does."""

    @torch.enable_grad()
    def closure(self, *args, **kwargs) -> ClosureResult:
        return ClosureResult(self._step_fn())


class ModuleRunner(FasttrainTrainer):
    """A fasttrain Trainer whose hooks are a LightningModule's."""

    def __init__(self, lightning_trainer, optimizer, **options):
        self.lt = lightning_trainer
        self.batch_idx = 0
        self.window_start = True  # the micro-step opens an accumulation window
        #: > 0 inside the graphed engine's step, whose zero-grad hooks ran before it (_ZeroGradAhead)
        self._zeroed_ahead = 0
        #: the graphed engine's steps clear the gradients themselves, in place, in backward_step:
        #: Lightning's default zeroing when every batch opens a window (decided per run, see
        #: _decide_step_calls), which a capture records and each replay repeats
        self._zero_recorded = False
        #: ``self.log`` for the module's steps (see fast_log.py), put in place by run_step on the
        #: eager engine and around the engine's call on the compiled ones (engine_steps); else None
        self.step_log = None
        self._log_around_engine = None
        #: no autocast around the steps (decided per run; with mixed precision, run_step enters it)
        self._full_precision = False
        #: the LightningModule whose step methods run_step calls itself, when the prepared model
        #: is the plain StepModule (decided per run, see calls_steps_directly); else None
        self._step_methods_of = None
        super().__init__(step_module_for(lightning_trainer.lightning_module), None, optimizer, callbacks=[], **options)

    # ------------------------------------------------------------------ setup
    def _create_accelerator(self) -> Accelerator:
        kwargs = self.lt._args.strategy.accelerator_kwargs()  # DDP's options, FSDP2's plugin
        accelerator = build_accelerator(self.mixed_precision, cpu=self.lt._force_cpu, **kwargs)
        share_loss_scaler(self.lt.precision_plugin, accelerator)
        return accelerator

    def _prepare_model_optimizer_and_dataloaders(self):
        # combined loaders (combined.py) are no DataLoader for accelerate: each loader in them is
        # sharded on its own, and the loop iterates them as Lightning's CombinedLoader does
        combined = self._train_dataloader if isinstance(self._train_dataloader, CombinedData) else None
        if combined is None:
            return super()._prepare_model_optimizer_and_dataloaders()
        self._train_dataloader = None
        try:
            super()._prepare_model_optimizer_and_dataloaders()
        finally:
            self._train_dataloader = combined
        if self._accelerator.distributed_type != DistributedType.NO:
            from fasttrain.lightning.loops import prepare_train_loader

            self._train_dataloader = prepare_train_loader(self, combined)

    def create_train_dataloader(self, batch_size: int, train_dl_kwargs: dict = None):
        self._train_dl_kwargs = {"batch_size": batch_size, "shuffle": False}
        return self.train_dataset

    def create_eval_dataloader(self, batch_size: int, eval_dl_kwargs: dict = None):
        self._eval_dl_kwargs = {"batch_size": batch_size, "shuffle": False}
        return self.eval_dataset

    def prepare_for_evaluation(self, loader) -> None:
        """fasttrain's evaluate() set-up (accelerate, engine) without its loop."""
        self.eval_dataset = loader
        self._train_dataloader = None
        self._eval_dataloader = loader
        prepare.prepare_run(self)
        self.run_config = prepare.create_run_config(
            self,
            num_epochs=1, gradient_accumulation_steps=1, max_num_train_steps=None,
            per_device_batch_size=1, gradient_clip_value=None,
        )
        prepare.setup_engine(self, FasttrainTrainer)
        self._decide_step_calls()

    def _decide_step_calls(self) -> None:
        """What calling a step method involves in this run, decided once (see :meth:`run_step`)."""
        # the compiled engines trace the step with its self.log: the log goes in place around the
        # engine's call, outside the traced function (engine_steps); eager puts it in run_step
        engine_name = getattr(self._engine, "name", None)
        eager = engine_name == "eager"
        log = step_logger(self.lt.lightning_module, self.lt)
        # LightningModule's default zeroing (no zero-grad hook of the module's or a callback's)
        # with every batch its window's first: the graphs of the update can hold it (_ZeroGradAhead)
        self._zero_recorded = (
            engine_name == "cudagraph" and not self.lt._own_zero_grad and self.lt.accumulate_grad_batches == 1
        )
        self.step_log, self._log_around_engine = (log, None) if eager else (None, log)
        self._full_precision = self._accelerator.mixed_precision == "no"
        if not self._full_precision:
            keep_output_dtypes(self.lt.lightning_module.__dict__.get("_fasttrain_step_module"))
        self._step_methods_of = calls_steps_directly(self.model)
        # Lightning passes batch_idx only to a step whose signature takes it (read once per run)
        module = self.lt.lightning_module
        self._strategy_backward = self.lt.strategy.backward
        if engine_name == "cudagraph" and not self.lt._plain_backward_hooks:
            # the backward hooks run inside the captured step: compiled, so that their Python is
            # checked before each replay (graphed_hooks.py); other runs call them through the
            # HookCaller that fit._attach set for this run
            settings = settings_for_engine(CompileSettings.from_options(self.compile_options), "cudagraph")
            self.lt._backward_hooks = GraphedBackwardHooks(
                self.lt._hooks, self._engine, settings.kwargs(fullgraph=True), self._step_context.host_effects.kept_apart
            )
        if profiling(self.lt):  # the steps and backward timed under the strategy's names, as in Lightning
            profiler, lt = self.lt.profiler, self.lt
            self._strategy_backward = timed(profiler, strategy_action(lt, "backward"), lt.strategy.backward)
            plain_run_step = ModuleRunner.run_step.__get__(self)

            def run_step(name: str, *args):
                with profiler.profile(strategy_action(lt, name)):
                    return plain_run_step(name, *args)

            self.run_step = run_step
        self._takes_batch_idx = {
            name: is_param_in_hook_signature(getattr(module, name), "batch_idx", min_args=2)
            for name in ("training_step", "validation_step", "test_step", "predict_step")
            if callable(getattr(module, name, None))
        }

    def step_args(self, name: str, batch, batch_idx: int, *extra) -> tuple:
        """The positional arguments of step ``name``, as Lightning builds them."""
        if self._takes_batch_idx.get(name, True):
            return (batch, batch_idx, *extra)
        return (batch, *extra)

    def train(
        self,
        train_dataset,
        num_epochs,
        per_device_batch_size=1,
        gradient_accumulation_steps=1,
        gradient_clip_value=None,
        gradient_clip_norm=None,
    ):
        """fasttrain's training set-up (accelerate, engine, non-finite guard), then Lightning's
        fit loop (:func:`fasttrain.lightning.loops.run_fit`) instead of the epoch loop."""
        from fasttrain.lightning.loops import run_fit

        prepare.set_up_training(
            self,
            FasttrainTrainer,
            train_dataset=train_dataset,
            num_epochs=num_epochs,
            eval_dataset=None,
            per_device_batch_size=per_device_batch_size,
            # Lightning's loop ends the fit (max_steps, max_epochs, the end of the data); a loader
            # without a length leaves the core's own step budget unbounded
            max_num_train_steps=None if _sized(train_dataset) else 2**62,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clip_value=gradient_clip_value,
            gradient_clip_norm=gradient_clip_norm,
            create_scheduler_fn=None,
            train_dataloader_kwargs=None,
            eval_dataloader_kwargs=None,
            reset_run_history=True,
            collate_fn=None,
            resume_from=None,
        )
        # the accelerator (and with it the loss scaler) is new from here on
        self.lt._load_scaler_state()
        self._decide_step_calls()
        try:
            with signals.handle_interrupts(self), anomaly_context(self.lt):
                run_fit(self.lt, self)
        finally:
            self._nonfinite.close()

    # ------------------------------------------------------------------ the step, as hooks
    def run_step(self, name: str, *args):
        """The module's step method ``name`` (on the module itself in one plain process, as
        Lightning calls it; else through the prepared model, so DDP sees it as the forward), with
        ``_current_fx_name`` set for ``self.log`` and, on the eager engine, the fast ``self.log``
        in place while it runs."""
        # the module, read one way: a compiled step reaching one object along two paths is
        # guarded on their being the same object before each call (and each replay)
        step = self._step_methods_of
        state = (step if step is not None else self.lt.lightning_module).__dict__  # skips nn.Module.__setattr__
        state["_current_fx_name"] = name
        step_log = self.step_log
        if step_log is not None:
            state["log"] = step_log
        try:
            if step is not None:
                # no module hooks, no nn.Module call on the hot path (calls_steps_directly)
                target = getattr(step, name)
            else:
                target, args = self.model, (name, *args)
            if self._full_precision:
                output = target(*args)
            else:
                with self._accelerator.autocast():
                    output = target(*args)
        finally:
            if step_log is not None:
                state.pop("log", None)
        state["_current_fx_name"] = None
        return output

    def engine_steps(self):
        """The engine's ``train_step`` and ``eval_step`` as the loops call them: on a compiled
        engine, each with the fast ``self.log`` in the module's ``__dict__`` while it runs (the
        traced step, and the guards checked before a compiled call or a graph's replay, see it
        there; the module is as it was outside the call)."""
        engine, log = self._engine, self._log_around_engine
        if log is None:
            return engine.train_step, engine.eval_step
        state = self.lt.lightning_module.__dict__

        def with_log(call):
            def step(*args):
                state["log"] = log
                try:
                    return call(*args)
                finally:
                    state.pop("log", None)

            return step

        return with_log(engine.train_step), with_log(engine.eval_step)

    def model_call(self, name: str):
        """A callable that runs step ``name`` through the prepared model (as DDP's forward), under
        this run's autocast: what ``run_step`` does, for the loops that set the module's state
        themselves (prediction)."""
        call = functools.partial(self.model, name)
        if self._full_precision:
            return call
        autocast = self._accelerator.autocast

        def under_autocast(*args):
            with autocast():
                return call(*args)

        return under_autocast

    def calculate_train_batch_loss(self, batch) -> dict:
        output = self.run_step("training_step", *self.step_args("training_step", batch, self.batch_idx))
        if type(output) is torch.Tensor or isinstance(output, torch.Tensor):  # the exact type first: cheaper
            loss = output
        elif isinstance(output, dict) or isinstance(output, Mapping):  # any Mapping, as in Lightning
            loss = output.get("loss")
            if loss is None:
                raise LightningConfigError(  # Lightning's words
                    "In automatic_optimization, when `training_step` returns a dict, the 'loss' key needs to be present"
                )
        elif output is None:
            # Lightning skips this batch's backward: the fit loop does (skipped_steps.py)
            raise_step_returned_none(self.batch_idx)
        else:
            raise LightningConfigError(  # Lightning's words
                "In automatic optimization, `training_step` must return a Tensor, a dict, or None (where the step will"
                f" be skipped). It returned {type(output).__name__}."
            )
        return {"loss": loss, "output": output}

    def backward_step(self, loss):
        lt = self.lt
        if self.window_start and (not self._zeroed_ahead or self._zero_recorded):
            # inside the graphed engine's step (_ZeroGradAhead) the tensors stay bound: in place
            self.zero_grad_at_window_start(in_place=self._zeroed_ahead > 0)
        if lt._plain_backward_hooks:
            FasttrainTrainer.backward_step(self, loss)  # super() without building a super object per step
        else:
            self._strategy_backward(loss, lt.optimizers[0])

    def zero_grad_at_window_start(self, in_place: bool = False) -> None:
        """Lightning clears gradients before the first backward of a window, after its training
        step (never after an update: until then a callback sees the last backward's gradients):
        through the module's and callbacks' zero-grad hooks when they override them, else as
        LightningModule's ``optimizer_zero_grad`` does, to None. ``in_place``: to zeros instead,
        for the graphed engine, whose graphs accumulate into the tensors they were captured with
        (before its step, where nothing but the step's own code sees them before the backward)."""
        lt = self.lt
        if lt._own_zero_grad:
            optimizer = lt.optimizers[0]
            counts = lt.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
            counts.increment_ready()
            lt._hooks("on_before_zero_grad", optimizer)
            counts.increment_started()
            lt._hooks.module_hook("optimizer_zero_grad", lt.current_epoch, self.batch_idx, optimizer)
            counts.increment_completed()
        elif in_place:
            grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                with torch.no_grad():
                    torch._foreach_zero_(grads)
        else:
            FasttrainTrainer.optimizer_zero_grad(self)

    def closure_step(self, batch, backward: bool = True) -> dict:
        """A stepping batch when the module overrides ``optimizer_step`` or the optimizer's step
        needs a closure (LBFGS): as in Lightning, the hook runs first and its closure runs the
        training step and backward (``backward=False``: the training step only, no zero-grad, as
        under ``fit_loop._skip_backward``). Runs eagerly."""
        lt = self.lt
        result = {}
        # an optimizer may evaluate the closure several times: each evaluation of a window's
        # first batch clears the gradients after its training step, as Lightning's closure does
        # (backward_step, or below without a loss); the loop does not count these clearings
        count_clearing = backward and self.window_start and not lt._own_zero_grad
        counts = lt.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad

        @torch.enable_grad()  # as Lightning's closure: an optimizer may step under no_grad
        def closure():
            try:
                batch_output = self.calculate_train_batch_loss(batch)
            except StepReturnedNone:
                batch_output = None
            if count_clearing:
                counts.increment_by(1)  # Lightning counts its zero_grad after the training step
            if batch_output is None:
                # as Lightning's closure: no backward, the optimizer steps on what it has
                check_none_step(lt, self.batch_idx)
                if self.window_start and backward:
                    self.zero_grad_at_window_start()
                result["output"] = None
                return None
            # what backward sees (divided over the accumulation window), as Lightning's closure
            # loss; calling the closure gives a detached copy of it (_StepClosure)
            closure_loss = self._step_context.loss_for_backward(batch_output)
            if backward:
                self.backward_step(closure_loss)
            result["output"] = batch_output
            return closure_loss

        lt._hooks.module_hook(
            "optimizer_step", lt.current_epoch, self.batch_idx, lt.strategy._lightning_optimizers[0],
            _StepClosure(closure),
        )
        if "output" not in result:  # Lightning's error and words
            raise MisconfigurationException(
                "The closure hasn't been executed. HINT: did you call `optimizer_closure()` in your"
                " `optimizer_step` hook? It could also happen because the `optimizer.step(optimizer_closure)`"
                " call did not execute it internally."
            )
        return result["output"]

    def _clip_for_update(self):
        return self._clip_gradients

    def _epoch_position(self):
        # Lightning's batch index, and the last-batch flag its loop sets before each step (a
        # batch limit, a look-ahead for a loader of unknown length): the epoch's first step
        # checks what changed at its start, and its last, partial batch gets graphs of its own
        lt = self.lt
        return (lambda: self.batch_idx), (lambda: lt.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def _host_effects(self):
        return LoggedCalls(self.lt)

    def _zero_grad_before_step(self):
        # the graphed engine clears the gradients (or runs the zero-grad hooks) before its step
        return _ZeroGradAhead(self)

    def _unchecked_step_python(self, base) -> tuple:
        # backward_step is the runner's: the backward hooks it calls are compiled on the
        # graphed engine and checked before each replay (graphed_hooks.py), and a module's own
        # backward keeps the fit off that engine (fit.py)
        return ()

    def _compile_owner(self):
        # a runner lives for one fit(); the module outlives it
        return self.lt.lightning_module

    def _clip_gradients(self):
        lt = self.lt
        if self._accelerator.scaler is not None:
            # fp16: gradients are scaled until the optimizer step; hooks and clipping see true values
            self._accelerator.unscale_gradients()
        if lt._before_step_hooks:
            lt._hooks("on_before_optimizer_step", lt.optimizers[0])
        if lt._custom_clipping:
            lt._hooks.module_hook(
                "configure_gradient_clipping", lt.optimizers[0], lt.gradient_clip_val, lt.gradient_clip_algorithm
            )
            return None
        guard = self._nonfinite
        if not guard.checks_gradients and (self._clipper is None or not self._clipper.enabled):
            return None
        return guard.clip(self._clipper)

    def optimizer_zero_grad(self):
        # nothing after an update: Lightning clears the gradients at the next window's start
        # (zero_grad_at_window_start), and the engines' graphs and compiled code hold no zeroing
        return None

    def calculate_eval_batch_loss(self, batch) -> dict:
        lt = self.lt
        if lt._eval_dataloader_idx is None:
            return self.run_step(lt._eval_step_name, *self.step_args(lt._eval_step_name, batch, self.batch_idx))
        return self.run_step(
            lt._eval_step_name, *self.step_args(lt._eval_step_name, batch, self.batch_idx, lt._eval_dataloader_idx)
        )


class _ZeroGradAhead:
    """StepContext.zero_grad_before_step of a fit: where the gradients are cleared.

    Lightning clears them at a window's first batch between the training step and the backward,
    through the zero-grad hooks (the module's ``optimizer_zero_grad``, a callback's
    ``on_before_zero_grad``); a CUDA graph replays neither the hooks' Python nor what they do to
    ``.grad`` (a gradient set to None is not an operation). Around each step of the graphed engine
    (warm-up, capture, replay) the clearing comes first, eagerly, every window as under Lightning,
    and the step's backward leaves it out: LightningModule's default clears in place (one foreach
    zero: the tensors the graphs accumulate into stay bound), a user's hooks run as written, and
    gradients they set to None get their captured tensors back, zeroed, before a replay (the
    replay guard), which gives the new gradients as a fresh backward would. Only the place
    relative to the training step moves, whose own Python a replay does not run anyway.
    Re-entered by a step that is undone and run again (a failed capture), it clears once.

    Where every batch opens a window (``accumulate_grad_batches=1``) and the zeroing is
    LightningModule's default, it stays where Lightning has it, in ``backward_step`` after the
    training step, in place: a capture records the foreach zero with the step and each replay
    repeats it, so a replayed step launches nothing of its own for it. (With accumulation the
    graph of the non-stepping batches serves both a window's first batch and the ones after it,
    so the clearing of the first is made before the step, as above.) Each run of the step's
    body inside the block clears: a capture that failed, and was undone, and the run after it."""

    __slots__ = ("runner",)

    def __init__(self, runner: ModuleRunner):
        self.runner = runner

    def __enter__(self) -> None:
        runner = self.runner
        # where the zeroing is recorded with the step, backward_step clears instead
        if not runner._zeroed_ahead and runner.window_start and not runner._zero_recorded:
            runner.zero_grad_at_window_start(in_place=True)
        runner._zeroed_ahead += 1

    def __exit__(self, *exc) -> None:
        self.runner._zeroed_ahead -= 1


def _sized(loader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def step_module_for(module) -> "StepModule":
    """The StepModule that runs ``module``'s steps. FSDP2 shards the prepared root in place (its
    own parameters become shards of it), so a module sharded by ``fit()`` keeps that root for
    ``validate``/``test``/``predict``: a new root around it cannot be sharded again."""
    step = module.__dict__.get("_fasttrain_step_module")
    if step is None or not is_fsdp2(step):
        step = StepModule(module)
        # in the instance's __dict__, not registered as a submodule: the module's state_dict,
        # children and hooks stay as the user wrote them
        module.__dict__["_fasttrain_step_module"] = step
    return step


def keep_output_dtypes(step) -> None:
    """Take accelerate's mixed-precision forward off the StepModule ``step`` (None: nothing to
    do). accelerate replaces a prepared module's forward with one that runs under autocast and
    converts the outputs to fp32; Lightning runs a step under autocast and hands back what it
    returned, in the dtypes it computed them in. The runner enters the autocast around each step
    itself (``run_step``, ``model_call``), so without the replaced forward a step's outputs are
    Lightning's, and a module in one process has its steps called directly."""
    if step is None:
        return
    state = step.__dict__
    original = state.get("_original_forward")
    if "forward" in state and getattr(original, "__func__", None) is StepModule.forward:
        del state["forward"]
        del state["_original_forward"]


def calls_steps_directly(model):
    """The LightningModule inside ``model`` when ``model`` is the StepModule exactly as built: no
    process wrapper (DDP, FSDP), no hook on it, no forward replaced (accelerate's mixed-precision
    forward is taken off first, by :func:`keep_output_dtypes`). Then calling a step method on the
    module is what calling the StepModule does, without the module call; Lightning's
    single-process strategies call it the same way."""
    if type(model) is not StepModule or "forward" in model.__dict__:
        return None
    if model._forward_hooks or model._forward_pre_hooks or model._backward_hooks or model._backward_pre_hooks:
        return None
    return model.module


class StepModule(torch.nn.Module):
    """The module accelerate prepares: its forward runs one of the LightningModule's step
    methods, so that a DDP (or FSDP) wrapper sees the whole step as its forward, synchronises
    gradients, and the parameters are the module's own."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args):
        return getattr(self.module, step_name)(*args)
