"""Set-up and tear-down around the loops of ``fit``, ``validate``, ``test`` and ``predict``:
attaching the module, data, optimizers, the engine choice, checkpoints to resume from."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import warnings

from lightning.fabric.utilities.distributed import _InfiniteBarrier
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.loggers.utilities import _log_hyperparams
from lightning.pytorch.loops.utilities import _parse_loop_limits
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.compile import _maybe_unwrap_optimized
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import clean_namespace
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from fasttrain.auto_resume import decided_by_first_process
from fasttrain.engine import auto_engine_name
from fasttrain.lightning import checkpoint as ckpt_io
from fasttrain.lightning.arguments import LightningConfigError
from fasttrain.lightning.ckpt_path import select as select_ckpt_path
from fasttrain.lightning.combined import evaluation_loaders, plain_loader, prediction_loaders
from fasttrain.lightning.hooks import (
    BACKWARD_HOOKS,
    OBSERVED_BACKWARD_HOOKS,
    ZERO_GRAD_HOOKS,
    HookCaller,
    merge_module_callbacks,
    module_overrides,
)
from fasttrain.lightning.loop_objects import index_predict_loader
from fasttrain.lightning.loops import prepare_eval_loader, run_evaluation, run_predict
from fasttrain.lightning.metric_calls import metric_calls_outside_graphs
from fasttrain.lightning.profiler import ProfiledHookCaller, datamodule_hook, profile_batch_hooks, profiling
from fasttrain.lightning.profiler import start_run as start_profiler
from fasttrain.lightning.run_end import end_run, handle_errors, teardown
from fasttrain.lightning.run_checks import check_manual_optimization
from fasttrain.lightning.run_data import (
    datamodule_overrides,
    defer_val_data,
    load_data,
    load_train_data,
    load_val_data,
    process_each,
    process_loader,
    request_checked,
)
from fasttrain.lightning.runner import ModuleRunner
from fasttrain.lightning.skipped_steps import may_return_none
from fasttrain.lightning.strategy import check_launch

_BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _attach(lt, model, datamodule, fn: TrainerFn) -> None:
    if model is None and fn is not TrainerFn.FITTING:
        model = lt._module
        if model is None:
            raise TypeError(
                f"`Trainer.{fn.value}()` requires a `LightningModule` when it hasn't been passed in a previous run"
            )
    else:
        # Lightning's check (its TypeError), unwrapping a torch.compile'd module as it does
        model = _maybe_unwrap_optimized(model)
    if not isinstance(model, LightningModule):
        raise TypeError(f"expected a lightning.LightningModule, got {type(model).__name__}")
    if hasattr(model, "hparams"):
        # Lightning drops hyperparameters that cannot be pickled (with its warning), so that
        # checkpoints can be saved
        clean_namespace(model.hparams)
    if datamodule is not None and not isinstance(datamodule, LightningDataModule):
        raise TypeError(f"datamodule must be a lightning.LightningDataModule, got {type(datamodule).__name__}")
    lt._module = model
    model.trainer = lt
    # Lightning's record of where the training data comes from, as every run's setup hooks read
    # it (the batch size finder's check): the DataModule, else the module; a fit given loaders
    # records them (_fit)
    lt.fit_loop._data_source.instance = datamodule if datamodule is not None else model
    # Lightning's test for a step being defined (a step set to None on the instance is not)
    lt._has_val_step = is_overridden("validation_step", model)
    if datamodule is not None:
        lt.datamodule = datamodule
        datamodule.trainer = lt
    lt.state.fn = fn
    lt.state.status = TrainerStatus.RUNNING
    # the run's stage from its first hook (setup) to its last (teardown), as Lightning sets it
    lt.state.stage = {TrainerFn.FITTING: RunningStage.TRAINING, TrainerFn.VALIDATING: RunningStage.VALIDATING,
                      TrainerFn.TESTING: RunningStage.TESTING, TrainerFn.PREDICTING: RunningStage.PREDICTING}[fn]
    lt.should_stop = False
    lt._load_train_data = None
    # as in Lightning, a run's loaders replace every earlier run's (train_dataloader is None after
    # validate(), test_dataloaders after fit(), ...), which are no longer held
    lt._train_loader, lt._val_loaders, lt._test_loaders, lt._predict_loaders = None, [], [], []
    # before the hooks are resolved, so the module's callbacks get every hook of this run
    merge_module_callbacks(lt, model)
    lt._hooks = (ProfiledHookCaller if profiling(lt) else HookCaller)(lt, model, lt.callbacks)
    lt._backward_hooks = lt._hooks  # a fit on the graphed engine compiles them (runner.py)
    lt._eval_seen = collections.defaultdict(int)
    lt._batch_hooks = _batch_hooks(lt._hooks, model, datamodule)
    if profiling(lt):
        profile_batch_hooks(lt, _BATCH_HOOKS)


def _batch_hooks(hooks: HookCaller, model, datamodule) -> dict:
    """For each batch-transfer hook, what a batch goes through: the DataModule's override when
    the DataModule given to this call overrides it, else the module's override, else None (the
    hook is skipped; the default move to the device runs off the CPU). Lightning's rule, with its
    warnings when both override or when only the module does while a DataModule is given."""
    selected = {}
    for name in _BATCH_HOOKS:
        in_module = is_overridden(name, model)
        if datamodule is not None and is_overridden(name, datamodule):
            if in_module:
                warnings.warn(
                    f"You have overridden `{name}` in both `LightningModule` and `LightningDataModule`. "
                    "It will use the implementation from `LightningDataModule` instance.",
                    stacklevel=5,
                )
            selected[name] = getattr(datamodule, name)
            continue
        if in_module and datamodule is not None:
            warnings.warn(
                f"You have overridden `{name}` in `LightningModule` but have passed in a `LightningDataModule`. "
                "It will use the implementation from `LightningModule` instance.",
                stacklevel=5,
            )
        selected[name] = functools.partial(hooks.module_hook, name) if in_module else None
    return selected


def _verify_fit(module) -> None:
    """Lightning's minimum for a fit, with its error."""
    for name in ("training_step", "configure_optimizers"):
        if not is_overridden(name, module):
            raise MisconfigurationException(
                f"No `{name}()` method defined. Lightning `Trainer` expects as minimum a `training_step()`, "
                "`train_dataloader()` and `configure_optimizers()` to be defined."
            )


def _prepare_data(lt) -> None:
    """Lightning's rule for the DataModule's and then the module's ``prepare_data``, each only
    when overridden: it runs on local rank 0 of every node when the owner's
    ``prepare_data_per_node`` is True (the default), else only on local rank 0 of node 0; every
    process waits at a barrier without a timeout until it has run (a download may take long)."""
    local_zero = lt.local_rank == 0
    owners = ((lt.datamodule, lambda: datamodule_hook(lt, "prepare_data")),
              (lt.lightning_module, lambda: lt._hooks.module_hook("prepare_data")))
    for owner, call in owners:
        if owner is None or not is_overridden("prepare_data", owner):
            continue
        with _InfiniteBarrier():
            if local_zero and (owner.prepare_data_per_node or lt.node_rank == 0):
                call()


def _setup_hooks(lt, stage) -> None:
    """prepare_data, setup, configure_model; the run's ModuleRunner exists already, so the
    process group is up and the hooks see the launch's ranks (see :func:`_runner`)."""
    hooks = lt._hooks
    dm = lt.datamodule
    if profiling(lt):
        start_profiler(lt)
    _prepare_data(lt)
    for logger in lt.loggers:
        getattr(logger, "experiment", None)  # Lightning creates the experiment before setup
    if dm is not None:
        datamodule_hook(lt, "setup", stage=stage)
    hooks("setup", stage=stage)
    hooks.module_hook("configure_model")
    # Lightning starts every fit, validate, test and predict with empty results and metric dicts:
    # after test(), callback_metrics hold the test's values only
    for results in (lt._train_results, lt._val_results, lt._test_results):
        results.reset()
    lt._logger_connector.reset_metrics()
    lt._pbar_metrics.start_run(lt.progress_bar_callback is not None)


def _checkpoint_to_load(lt, fn: TrainerFn, choice: tuple):
    """The file a run loads (None: none), from ``choice`` = (the ``ckpt_path`` argument, whether
    a model was passed, whether the trainer held a module before this call), as Lightning
    chooses it; it becomes ``trainer.ckpt_path``."""
    ckpt_path, model_provided, model_connected = choice
    # every process reads ckpt_path as Lightning does (its warnings and settings alike), and the
    # first process's file is the one all of them load: "last" names the newest file of a folder
    # another process may be writing to, or that differs between nodes
    path = decided_by_first_process(
        lambda: select_ckpt_path(lt, fn.value, ckpt_path, model_provided, model_connected), everywhere=True
    )
    lt._ckpt_path = path
    return path


def _restore_for_evaluation(lt, path, weights_only) -> None:
    """An evaluation's or prediction's restore from the checkpoint ``path`` (when not None): the
    weights and, as Lightning restores them for every run, the DataModule's and the callbacks'
    states (a callback's state a training run computed for its evaluation); ``weights_only`` as
    for ``torch.load`` (None: safe loading)."""
    if path is not None:
        ckpt_io.restore_modules_and_callbacks(lt, path, weights_only)
        rank_zero_info(f"Restored all weights from the checkpoint at {path}")


def _choose_engine(lt, requested: str, device) -> str:
    """The engine that can honour the module's hooks; one warning when that is not the one asked for."""
    module = lt.lightning_module
    name = auto_engine_name(device) if requested == "auto" else requested
    if not module.automatic_optimization:
        blockers, target = ["the module's automatic_optimization = False"], "eager"
    else:
        if name != "eager" and may_return_none(module):
            warnings.warn(
                f"fasttrain: the module's training_step can return None (Lightning then skips that batch's update), "
                f"a Python path decided per batch, which one graph of the {name!r} engine cannot hold; this fit "
                "runs on the 'eager' engine instead.",
                RuntimeWarning,
                stacklevel=4,
            )
            return "eager"
        # the module's optimizer_step takes a closure that runs the step: eager (closure_step);
        # the module's other update hooks are compiled with the update (where they read a number
        # that changes between updates, the update runs uncompiled, engine/compiled.py), and
        # captured with it: their self.log calls are filed again after each replay, and a change
        # to the module's attributes refuses the capture, as for the training step
        # (graph_logging.py)
        blockers = ["the module's optimizer_step"] if module_overrides(module, "optimizer_step") else []
        blockers += [f"an optimizer whose step needs a closure ({type(o).__name__})"
                     for o in lt.optimizers if _needs_closure(o)]
        if lt._args.detect_anomaly:
            blockers.append("detect_anomaly=True (autograd's anomaly checks run eagerly)")
        if profiling(lt):
            blockers.append("a profiler (it times each hook)")
        target = "eager"
        if not blockers and name == "cudagraph":
            # a graph replays the kernels of the module's own backward, not its Python; the
            # module's and callbacks' on_before_backward and on_after_backward are compiled inside
            # the capture, their Python checked before each replay and what they change on the
            # module or their callback watched, as the training step's (graphed_hooks.py,
            # graph_logging.py); the zero-grad hooks run eagerly before each step
            # (runner._ZeroGradAhead)
            blockers = [f"the module's {h}" for h in BACKWARD_HOOKS
                        if module_overrides(module, h) and h not in OBSERVED_BACKWARD_HOOKS + ZERO_GRAD_HOOKS]
            target = "compiled"
    if not blockers or name == "eager" or (name == "compiled" and target == "compiled"):
        return name
    warnings.warn(
        f"fasttrain: {', '.join(blockers)} run(s) host code the {name!r} engine cannot replay; this fit runs on "
        f"the {target!r} engine instead.",
        RuntimeWarning,
        stacklevel=4,
    )
    return target


def _runner(lt, engine: str) -> ModuleRunner:
    """The run's ModuleRunner, built before the set-up hooks: building its Accelerator starts the
    process group on the first run, so that ``prepare_data``, ``setup``, ``configure_model`` and
    the checkpoint hooks see the launch's world size and ranks, as under Lightning. The module is
    moved to the device later (:func:`_to_device`), once those hooks have built and loaded it."""
    args = lt._args
    runner = ModuleRunner(
        lt, None, engine=engine, log_every_n_steps=max(args.log_every_n_steps, 1),
        mixed_precision=args.mixed_precision, compile_options=args.compile_options, nonfinite=args.nonfinite,
        handle_signals=False,
    )
    check_launch(lt, runner._accelerator.num_processes)
    lt._args.plugin_set.check_environment(runner._accelerator.num_processes, runner._accelerator.process_index)
    lt._runner = runner
    lt._device = runner.device
    return runner


def _to_device(lt, runner: ModuleRunner) -> None:
    """The module onto the run's device, after the set-up hooks and any checkpoint restore, so
    that layers ``configure_model`` creates move too."""
    lt.lightning_module.to(runner.device)


def fit(lt, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only=None) -> None:
    """Lightning's fit, in its start-up order: the process group (the run's ModuleRunner);
    prepare_data, setup, configure_model; from a checkpoint, the module's ``on_load_checkpoint``
    and weights, the DataModule's state and the callbacks'; the module to the device;
    ``configure_optimizers``; ``on_fit_start``; hyperparameters to the loggers; from the
    checkpoint, the loop counters, optimizer and scheduler states; the dataloaders (see
    :func:`~fasttrain.lightning.run_data.load_data`); then the fit loop (sanity check, ``on_train_start``, the epochs)."""
    if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
        raise ValueError("pass either dataloaders or a datamodule to fit(), not both")
    if isinstance(train_dataloaders, LightningDataModule):
        datamodule, train_dataloaders = train_dataloaders, None
    choice = (ckpt_path, True, lt._module is not None)
    _attach(lt, model, datamodule, TrainerFn.FITTING)
    # Lightning decides the loop limits when a fit starts: max_epochs None becomes 1000 (with
    # its warning) or -1 (when max_steps or max_time bounds the fit)
    lt.min_epochs, lt.max_epochs = _parse_loop_limits(lt.min_steps, lt.max_steps, lt.min_epochs, lt.max_epochs, lt)
    _barebones_notice(lt)
    handle_errors(lt, functools.partial(_fit, lt, train_dataloaders, val_dataloaders, choice, weights_only))


def _fit(lt, train_dataloaders, val_dataloaders, choice, weights_only) -> None:
    _check_validation_setup(lt, val_dataloaders)
    module = lt.lightning_module
    if train_dataloaders is not None:  # Lightning's record of the training data's source (see _attach)
        lt.fit_loop._data_source.instance = train_dataloaders
    _verify_fit(module)
    if not module.automatic_optimization:
        check_manual_optimization(lt)
    lt.training = True
    runner = _runner(lt, "eager")
    # once the process group exists (the runner starts it), so that the processes agree
    ckpt_path = _checkpoint_to_load(lt, TrainerFn.FITTING, choice)
    _setup_hooks(lt, TrainerFn.FITTING)
    checkpoint = None
    if ckpt_path is not None:
        checkpoint = ckpt_io.restore_modules_and_callbacks(lt, ckpt_path, weights_only)
    _to_device(lt, runner)
    # no dataloader is requested before on_fit_start unless configure_optimizers reads
    # estimated_stepping_batches; until then the number of training batches is unknown
    lt._train_loader, lt._val_loaders = None, []
    lt.num_training_batches = float("inf")
    lt._load_train_data = functools.partial(load_train_data, lt, train_dataloaders, runner._accelerator.num_processes)
    lt._reload_train_data = functools.partial(load_train_data, lt, train_dataloaders, runner._accelerator.num_processes)
    lt._reload_val_data = functools.partial(load_val_data, lt, val_dataloaders)
    optimizers, lt.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(module)
    lt.optimizers = optimizers
    if module.automatic_optimization and len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization takes one. "
            "Set self.automatic_optimization = False to step several yourself."
        )
    lt._wrap_optimizers()
    hooks = lt._hooks
    lt._module_steps = module_overrides(module, "optimizer_step") or any(map(_needs_closure, optimizers))
    lt._custom_clipping = module_overrides(module, "configure_gradient_clipping")
    lt._before_step_hooks = hooks.overridden("on_before_optimizer_step")
    lt._own_zero_grad = hooks.overridden("on_before_zero_grad") or module_overrides(module, "optimizer_zero_grad")
    lt._plain_backward_hooks = not any(hooks.overridden(h) for h in ("backward", "on_before_backward", "on_after_backward"))
    if profiling(lt):
        # Lightning's path through its hooks, each timed: optimizer_step with its closure,
        # the module's configure_gradient_clipping applying gradient_clip_val
        lt._module_steps = lt._custom_clipping = True
    lt._restarting = False
    lt.fit_loop._resume = None
    lt._scaler_state = None
    clip_value = clip_norm = None
    # the clipping Trainer(gradient_clip_val=...) asks for is done by LightningModule's own
    # configure_gradient_clipping: with the hook set to None Lightning calls nothing, so nothing clips
    default_clipping = callable(getattr(module, "configure_gradient_clipping", None))
    if lt.gradient_clip_val and default_clipping and not lt._custom_clipping and module.automatic_optimization:
        if lt.gradient_clip_algorithm is not None and lt.gradient_clip_algorithm.value == "value":
            clip_value = lt.gradient_clip_val
        else:
            clip_norm = lt.gradient_clip_val
    runner.optimizer = optimizers[0] if optimizers else None

    def train():
        hooks("on_fit_start")
        if lt.enable_autolog_hparams:
            _log_hyperparams(lt)  # Lightning's own: hparams (and the graph) to every logger
        if checkpoint is not None:
            ckpt_io.restore_training_state(lt, ckpt_path, checkpoint)
        module.zero_grad()  # as Lightning starts each run's loop: gradients left before the fit go
        load_data(lt, val_dataloaders)
        run_loop()

    def run_loop():
        """The fit loop over the training loader with the trainer's settings as they are now."""
        runner.engine_name = _choose_engine(lt, lt._args.engine, runner.device)
        train_loader = lt._train_loader
        lt.fit_loop._running = True
        try:
            with metric_calls_outside_graphs(module, runner):
                runner.train(
                    train_loader,
                    num_epochs=max(lt.max_epochs, 1),
                    per_device_batch_size=getattr(train_loader, "batch_size", None) or 1,
                    gradient_accumulation_steps=lt.accumulate_grad_batches,
                    gradient_clip_value=clip_value,
                    gradient_clip_norm=clip_norm,
                )
        finally:
            lt.fit_loop._running = False

    def run_again():
        """``trainer.fit_loop.run()`` from ``on_fit_start`` (Lightning's tuner): the fit loop
        with the callbacks, limits and schedulers the tuner set, on the data it loaded (else the
        fit's, requested now), without a sanity check."""
        lt.fit_loop._again = True
        try:
            lt.fit_loop.setup_data()
            if lt.fit_loop.epoch_loop.val_loop._combined_loader is None:
                defer_val_data(lt, val_dataloaders)
            with _hooks_of_the_callbacks_now(lt):
                run_loop()
        finally:
            lt.fit_loop._again = False

    def load_train():
        lt._reload_train_data()
        loader = lt._train_loader
        # Lightning's setup_data creates the first epoch's iterator with the loader
        lt.fit_loop._iterator_ahead = iter(loader) if lt.num_training_batches > 0 else None
        return loader

    def load_val():
        lt._reload_val_data()
        lt._load_val_later = None
        lt.fit_loop.epoch_loop.val_loop._max_batches = lt.num_val_batches
        return lt._val_loaders

    lt.fit_loop.lend(load_train, run_again)
    lt.fit_loop.epoch_loop.val_loop.lend(load_val, None)
    try:
        train()
    finally:
        lt._load_train_data = None
        lt.fit_loop.lend(None, None)
        lt.fit_loop.epoch_loop.val_loop.lend(None, None)
    lt.training = True  # on_fit_end and teardown run in the training stage, as in Lightning
    end_run(lt)
    hooks("on_fit_end")
    teardown(lt, TrainerFn.FITTING)
    lt.training = False


def _needs_closure(optimizer) -> bool:
    """Whether ``optimizer.step`` cannot run without a closure (LBFGS re-evaluates the loss):
    such a fit steps through the ``optimizer_step`` hook and its closure, as Lightning always does."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_validation_setup(lt, given) -> None:
    """Lightning's warnings for validation data without a ``validation_step`` and the reverse
    (either way the fit does not validate)."""
    dm = lt.datamodule
    if given is not None:
        has_loader = True
    elif dm is not None:
        has_loader = datamodule_overrides(dm, "val_dataloader")
    else:
        has_loader = module_overrides(lt.lightning_module, "val_dataloader")
    if has_loader and not lt._has_val_step:
        rank_zero_warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop.")
    if lt._has_val_step and not has_loader:
        rank_zero_warn(
            "You defined a `validation_step` but have no `val_dataloader`. Skipping val loop.",
            category=PossibleUserWarning,
        )


def _barebones_notice(lt) -> None:
    if lt.barebones:
        # no progress bar in barebones mode: say that the run started, as Lightning does
        rank_zero_info(
            "`Trainer(barebones=True)` started running. The progress bar is disabled so you might want to"
            " manually print the progress in your model."
        )


def evaluate(lt, stage: str, model, dataloaders, ckpt_path, datamodule, weights_only=None) -> list:
    fn = TrainerFn.TESTING if stage == "test" else TrainerFn.VALIDATING
    if isinstance(dataloaders, LightningDataModule):
        datamodule, dataloaders = dataloaders, None
    choice = (ckpt_path, model is not None, lt._module is not None)
    _attach(lt, model, datamodule, fn)
    return handle_errors(lt, functools.partial(_evaluate, lt, stage, dataloaders, choice, weights_only))


def _evaluate(lt, stage: str, dataloaders, choice, weights_only) -> list:
    fn = lt.state.fn
    ckpt_path = _checkpoint_to_load(lt, fn, choice)
    step = "test_step" if stage == "test" else "validation_step"
    if not is_overridden(step, lt.lightning_module):  # also a step set to None on the instance
        raise LightningConfigError(f"No `{step}()` method defined to run `Trainer.{stage}`.")
    runner = _runner(lt, lt._args.engine if lt._args.engine != "cudagraph" else "compiled")
    hook = "test_dataloader" if stage == "test" else "val_dataloader"
    running = RunningStage.TESTING if stage == "test" else RunningStage.VALIDATING
    loop = lt.test_loop if stage == "test" else lt.validate_loop

    def load():
        loaders = evaluation_loaders(request_checked(lt, dataloaders, hook))
        if not loaders:
            raise ValueError(f"{stage}() needs data: pass dataloaders, a datamodule, or define {hook}()")
        loaders = [process_each(lt, dl, running) for dl in loaders]
        if stage == "test":
            lt._test_loaders = loaders
        else:
            lt._val_loaders = loaders
        return loaders

    def run_again():
        with _hooks_of_the_callbacks_now(lt):
            loop.setup_data()
            return run_evaluation(lt, runner, stage)

    loop.lend(load, run_again)
    try:
        _setup_hooks(lt, fn)
        lt.lightning_module.zero_grad()  # as Lightning starts each run's loop: no gradient held through it
        loop.setup_data()  # (a callback's setup hook may have loaded them: Lightning's batch size finder)
        loaders = lt._test_loaders if stage == "test" else lt._val_loaders
        _restore_for_evaluation(lt, ckpt_path, weights_only)
        _to_device(lt, runner)
        with metric_calls_outside_graphs(lt.lightning_module, runner):
            runner.prepare_for_evaluation(plain_loader(loaders[0]))
            if runner.run_config.is_distributed:
                loaders[:] = [prepare_eval_loader(runner, dl) for dl in loaders]
            logged = run_evaluation(lt, runner, stage)
    finally:
        loop.lend(None, None)
    end_run(lt)
    teardown(lt, fn)
    return logged


@contextlib.contextmanager
def _hooks_of_the_callbacks_now(lt):
    """The run's hooks for ``trainer.callbacks`` as they are now, for a loop Lightning's tuner
    runs again with callbacks of its own (none, or its learning-rate callback); the run's hooks
    back after it."""
    hooks = lt._hooks
    if hooks.callbacks is not lt.callbacks:
        lt._hooks = lt._backward_hooks = type(hooks)(lt, lt.lightning_module, lt.callbacks)
    try:
        yield
    finally:
        lt._hooks = lt._backward_hooks = hooks


def predict(lt, model, dataloaders, datamodule, ckpt_path, return_predictions, weights_only=None):
    if isinstance(dataloaders, LightningDataModule):
        datamodule, dataloaders = dataloaders, None
    choice = (ckpt_path, model is not None, lt._module is not None)
    lt.predict_loop.return_predictions = return_predictions
    _attach(lt, model, datamodule, TrainerFn.PREDICTING)
    return handle_errors(lt, functools.partial(_predict, lt, dataloaders, choice, weights_only))


def _predict(lt, dataloaders, choice, weights_only) -> list:
    ckpt_path = _checkpoint_to_load(lt, TrainerFn.PREDICTING, choice)
    if lt.lightning_module.predict_step is None:
        raise LightningConfigError("`predict_step` cannot be None to run `Trainer.predict`")
    runner = _runner(lt, "eager")

    def load():
        loaders = prediction_loaders(request_checked(lt, dataloaders, "predict_dataloader"))
        if not loaders:
            raise ValueError("predict() needs data: pass dataloaders, a datamodule, or define predict_dataloader()")
        # prediction_loaders gives plain loaders only (a sequential CombinedLoader flattened)
        lt._predict_loaders = [index_predict_loader(process_loader(lt, dl, RunningStage.PREDICTING)) for dl in loaders]
        return lt._predict_loaders

    def run_again():
        with _hooks_of_the_callbacks_now(lt):
            lt.predict_loop.setup_data()
            return run_predict(lt, runner, lt._predict_loaders)

    lt.predict_loop.lend(load, run_again)
    try:
        _setup_hooks(lt, TrainerFn.PREDICTING)
        lt.lightning_module.zero_grad()  # as Lightning starts each run's loop: no gradient held through it
        lt.predict_loop.setup_data()  # (a callback's setup hook may have loaded them)
        loaders = lt._predict_loaders
        _restore_for_evaluation(lt, ckpt_path, weights_only)
        _to_device(lt, runner)
        runner.prepare_for_evaluation(plain_loader(loaders[0]))
        predictions = run_predict(lt, runner, loaders)
    finally:
        lt.predict_loop.lend(None, None)
    end_run(lt)
    teardown(lt, TrainerFn.PREDICTING)
    return predictions
