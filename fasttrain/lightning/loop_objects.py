"""The loop objects of ``lightning.Trainer`` that Lightning's callbacks and users read:
``trainer.fit_loop`` (its ``epoch_progress``, ``epoch_loop`` with ``batch_progress``,
``scheduler_progress``, the optimizer progress, ``val_loop``), ``trainer.validate_loop``,
``trainer.test_loop`` and ``trainer.predict_loop``.

They are Lightning's ``_Loop`` with Lightning's own progress classes (``_Progress``,
``_BatchProgress``, ...), so ``state_dict()`` gives the checkpoint's ``loops`` entry in
Lightning's layout and a Lightning checkpoint loads into them. They run nothing: fasttrain's
loops (:mod:`fasttrain.lightning.loops`) advance their counters on the host, at the points
Lightning advances them, from fasttrain's own counts; no counter is read from the device.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.loops import _EvaluationLoop as _LightningEvaluationLoop
from lightning.pytorch.loops import _FitLoop as _LightningFitLoop
from lightning.pytorch.loops import _PredictionLoop as _LightningPredictionLoop
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import (
    _BatchProgress,
    _OptimizationProgress,
    _Progress,
    _ReadyCompletedTracker,
    _SchedulerProgress,
)
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader

from fasttrain.lightning.combined import CombinedData
from fasttrain.lightning.loader_state import warn_if_not_resumable


class _AutomaticOptimization(_Loop):
    """Counts the optimizer's ``step`` and ``zero_grad`` calls under automatic optimization."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.optim_progress = _OptimizationProgress()
        #: Lightning's flag to run a batch without zero-grad, backward or update (set by
        #: StochasticWeightAveraging for its BatchNorm epoch; the fit loop reads it per batch)
        self._skip_backward = False


class _ManualOptimization(_Loop):
    """Counts the optimizers' ``step`` calls under manual optimization (every optimizer)."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.optim_step_progress = _Progress.from_defaults(_ReadyCompletedTracker)

    def step_starting(self) -> None:  # LightningOptimizer._on_before_step
        self.optim_step_progress.increment_ready()

    def step_done(self) -> None:  # LightningOptimizer._on_after_step
        self.optim_step_progress.increment_completed()


def describe_loaders(loaders) -> CombinedLoader:
    """A ``CombinedLoader`` over a run's loaders, as Lightning's loops hold them in
    ``_combined_loader`` (what the batch size finder reads: ``flattened``, ``_dataset_length()``);
    the loops iterate fasttrain's own, never this one."""
    if isinstance(loaders, CombinedData):
        return loaders.combined
    if isinstance(loaders, (list, tuple)):
        flat = [dl.combined if isinstance(dl, CombinedData) else dl for dl in loaders]
        return CombinedLoader(flat, "sequential")
    return CombinedLoader(loaders, "max_size_cycle")


class _RunnableLoop(_Loop):
    """What Lightning's tuner (the learning rate and batch size finders) calls on a loop inside a
    run: ``setup_data()`` (the run's data requested when the loop holds none, ``_combined_loader``
    set to None meaning none), ``run()`` (the loop run again with the trainer's settings as they
    are then, no sanity check) and ``reset()``. A run lends the loop its means to load and to run
    (:meth:`lend`, fit.py); outside a run they raise."""

    def __init__(self, trainer) -> None:
        _Loop.__init__(self, trainer)  # not the Lightning loop class's own set-up (see _lightning_kind)
        #: Lightning's description of the loaders the loop holds (None: none loaded yet)
        self._combined_loader: Optional[CombinedLoader] = None
        self._load: Optional[Callable[[], object]] = None
        self._run_again: Optional[Callable[[], object]] = None
        #: whether the loop is running now (run() is refused then: it would run inside itself)
        self._running = False
        #: how many times run() ran the loop again in this run
        self._runs_again = 0
        #: the first epoch's data iterator when setup_data() made it (the fit loop: Lightning's
        #: setup_data creates it with the loader, so the tuner's loads draw the shuffle's seed
        #: where Lightning's do)
        self._iterator_ahead = None

    def lend(self, load: Optional[Callable[[], object]], run_again: Optional[Callable[[], object]]) -> None:
        """A run's ``load()`` (requests the loop's data, returns the loaders) and ``run_again()``;
        ``None, None`` when the run ends."""
        self._load, self._run_again = load, run_again
        self._combined_loader = None
        self._iterator_ahead = None
        self._running = False

    def _outside_a_run(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"`{what}` works inside a run of fasttrain.lightning.Trainer only (as Lightning's tuner calls it, from "
            "a callback's `on_fit_start`, `on_validation_start`, `on_test_start` or `on_predict_start`)"
        )

    def setup_data(self) -> None:
        if self._combined_loader is not None:
            return
        if self._load is None:
            raise self._outside_a_run(f"{type(self).__name__}.setup_data()")
        self._combined_loader = describe_loaders(self._load())

    def run(self):
        if self._run_again is None:
            raise self._outside_a_run(f"{type(self).__name__}.run()")
        if self._running:
            raise RuntimeError(
                f"fasttrain.lightning runs the {type(self).__name__} again (Lightning's learning rate and batch size "
                "finders do) only before it started: from `on_fit_start` for a fit, from the evaluation's "
                "start hook for an evaluation, as `Tuner` and the finder callbacks run them; this call came while "
                "it runs. Tune before the fit (`Tuner(trainer).lr_find(model)`), or from `on_fit_start`"
            )
        self._runs_again += 1
        return self._run_again()

    def reset(self) -> None:
        """Lightning's ``reset`` before a run: gradients on, and a restarting loop's current
        progress set back to where it was last completed."""
        torch.set_grad_enabled(True)
        if self.restarting:
            for progress in self._progress():
                progress.reset_on_restart()

    def _progress(self) -> list:
        return []


class EvaluationLoop(_RunnableLoop, _LightningEvaluationLoop):
    """``trainer.validate_loop``, ``trainer.test_loop`` and ``fit_loop.epoch_loop.val_loop``:
    the batch progress over all loaders of a run (``total`` counts on over runs; a fit's
    validation total restarts with each training epoch) and the loaders' batch counts."""

    def __init__(
        self, trainer, trainer_fn: TrainerFn, stage: RunningStage, verbose: bool = True, inference_mode: bool = True
    ) -> None:
        super().__init__(trainer)
        self.verbose = verbose
        #: torch.inference_mode (else torch.no_grad) around a run (see grad_modes.py)
        self.inference_mode = inference_mode
        self.batch_progress = _BatchProgress()
        self._max_batches: list = []
        #: whether a batch outside the sanity check ran in the current validation
        self._has_run = False
        self._trainer_fn = trainer_fn
        self._stage = stage

    @property
    def max_batches(self) -> list:
        """The batches to run per loader (the sanity check's counts while it runs)."""
        if not self.trainer.sanity_checking:
            return self._max_batches
        return [min(self.trainer.num_sanity_val_steps, batches) for batches in self._max_batches]

    @property
    def num_dataloaders(self) -> int:
        return len(self._max_batches)

    @property
    def skip(self) -> bool:
        return sum(self.max_batches) == 0

    def start_run(self) -> None:
        """Lightning's ``reset`` before a run's hooks."""
        self._has_run = False
        self.batch_progress.reset_on_run()

    def reset(self) -> None:
        """Lightning's ``reset`` (a restarting loop keeps its completed batches)."""
        self._has_run = False
        if self.restarting:
            self.batch_progress.reset_on_restart()
        else:
            self.batch_progress.reset_on_run()

    def pass_over(self, counts: list) -> None:
        """Count a validation as run without running it: Lightning's way past the validation due
        at the batch a checkpoint was saved at (saved before it ran)."""
        if not counts or sum(counts) == 0:
            return
        self._has_run = False
        if self.restarting:
            self.batch_progress.reset_on_restart()
        else:
            self.batch_progress.reset_on_run()
        if max(counts) != float("inf"):
            self.batch_progress.increment_by(int(max(counts)), True)


class PredictionLoop(_RunnableLoop, _LightningPredictionLoop):
    """``trainer.predict_loop``: its batch progress, the batch indices Lightning's
    ``BasePredictionWriter`` reads (``current_batch_indices``, ``epoch_batch_indices``), the
    predictions kept and ``return_predictions``."""

    def __init__(self, trainer, inference_mode: bool = True) -> None:
        super().__init__(trainer)
        self.inference_mode = inference_mode
        #: loaders x batches x sample indices, kept for a writer that writes at the epoch's end
        self.epoch_batch_indices: list = []
        #: the sample indices of the current batch, for a writer that writes per batch
        self.current_batch_indices: list = []
        self.batch_progress = _Progress()
        self.max_batches: list = []
        self._predictions: list = []
        self._return_predictions = False
        self._loaders: list = []
        #: (any writer writes per batch, any writes at the epoch's end), decided per run
        self._writers = (False, False)

    def reset(self) -> None:
        """Lightning's ``reset`` before a prediction."""
        self.batch_progress.reset_on_run()

    @property
    def return_predictions(self) -> bool:
        return self._return_predictions

    @return_predictions.setter
    def return_predictions(self, return_predictions: Optional[bool] = None) -> None:
        # Lightning's rule for the strategies that spawn or fork their processes (ddp_spawn,
        # ddp_notebook, ...), kept for them although fasttrain runs such a strategy in the launched
        # processes: the predictions are not returned by default, and asking for them is its error
        supported = getattr(self.trainer.strategy, "_start_method", "popen") not in ("spawn", "fork", "forkserver")
        if return_predictions and not supported:
            raise MisconfigurationException(
                "`return_predictions` should be set to `False` when using the strategies that spawn or fork."
                f" Found {return_predictions} with strategy {type(self.trainer.strategy)}."
            )
        self._return_predictions = supported if return_predictions is None else return_predictions

    @property
    def predictions(self) -> list:
        if self._predictions == []:
            return self._predictions
        return self._predictions[0] if self.num_dataloaders == 1 else self._predictions

    @property
    def num_dataloaders(self) -> int:
        return len(self._loaders)

    def start_run(self, loaders: list, callbacks) -> None:
        """Lightning's ``reset`` before a run's hooks."""
        self.batch_progress.reset_on_run()
        self._loaders = loaders
        writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
        self._writers = (any(w.interval.on_batch for w in writers), any(w.interval.on_epoch for w in writers))
        self.epoch_batch_indices = [[] for _ in loaders]
        self._predictions = [[] for _ in loaders]

    def keeps_predictions(self) -> bool:
        return self._return_predictions or self._writers[1]

    def note_batch_indices(self, batch_idx: int, dataloader_idx: int) -> None:
        """The sample indices of the batch, for the prediction writers (Lightning's loop reads
        them from the batch sampler it wrapped; see :func:`~fasttrain.lightning.loops.index_predict_loader`)."""
        on_batch, on_epoch = self._writers
        if not (on_batch or on_epoch):
            return
        seen = getattr(getattr(self._loaders[dataloader_idx], "batch_sampler", None), "seen_batch_indices", None)
        if not seen:
            return
        indices = seen[batch_idx]
        if on_epoch:
            self.epoch_batch_indices[dataloader_idx].append(indices)
        if on_batch:
            self.current_batch_indices = indices

    def finish_run(self) -> None:
        """Lightning's end of a prediction run: the predictions are dropped unless returned."""
        if not self._return_predictions:
            self._predictions = []
        self.epoch_batch_indices = []


def index_predict_loader(loader):
    """A DataLoader rebuilt as Lightning rebuilds a prediction loader: its batch sampler records
    the sample indices of each batch (what ``BasePredictionWriter`` gets as ``batch_indices``)
    and keeps a last partial batch (``drop_last=False``). Anything else is used as it is."""
    if not isinstance(loader, DataLoader):
        return loader
    return _update_dataloader(loader, loader.sampler, mode=RunningStage.PREDICTING)


class TrainingEpochLoop(_Loop):
    """``trainer.fit_loop.epoch_loop``: the batch, scheduler and optimizer progress of the fit,
    ``_batches_that_stepped`` (the loggers' step) and the fit's validation loop."""

    def __init__(self, trainer, min_steps: Optional[int] = None, max_steps: int = -1) -> None:
        super().__init__(trainer)
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.batch_progress = _BatchProgress()
        self.scheduler_progress = _SchedulerProgress()
        self.automatic_optimization = _AutomaticOptimization(trainer)
        self.manual_optimization = _ManualOptimization(trainer)
        # a fit's validation runs under torch.no_grad, as in Lightning
        self.val_loop = EvaluationLoop(
            trainer, TrainerFn.FITTING, RunningStage.VALIDATING, verbose=False, inference_mode=False
        )
        self._batches_that_stepped = 0

    @property
    def total_batch_idx(self) -> int:
        return self.batch_progress.total.ready - 1

    @property
    def batch_idx(self) -> int:
        return self.batch_progress.current.ready - 1

    @property
    def global_step(self) -> int:
        module = self.trainer.lightning_module
        if module is None or module.automatic_optimization:
            return self.automatic_optimization.optim_progress.optimizer.step.total.completed
        return self.manual_optimization.optim_step_progress.total.completed

    def _accumulated_batches_reached(self) -> bool:
        """Whether the current batch ends its gradient-accumulation window."""
        return self.batch_progress.current.ready % self.trainer.accumulate_grad_batches == 0

    def _num_ready_batches_reached(self) -> bool:
        """Whether the current batch is the epoch's last."""
        batches = self.batch_progress
        return batches.current.ready == self.trainer.num_training_batches or batches.is_last_batch

    def _should_accumulate(self) -> bool:
        """Whether the current batch accumulates its gradients, rather than stepping the
        optimizer (the last batch of a window, and of the epoch, steps)."""
        return not self._accumulated_batches_reached() and not self._num_ready_batches_reached()

    def _should_check_val_epoch(self) -> bool:
        """Whether the current epoch validates (what Lightning's ``ProgressBar.total_val_batches``
        asks)."""
        every = self.trainer.check_val_every_n_epoch
        return self.trainer.enable_validation and (every is None or (self.trainer.current_epoch + 1) % every == 0)

    def on_save_checkpoint(self) -> dict:
        return {"_batches_that_stepped": self._batches_that_stepped}

    def on_load_checkpoint(self, state_dict: dict) -> None:
        self._batches_that_stepped = state_dict.get("_batches_that_stepped", 0)

    def start_epoch(self) -> None:
        """Lightning's ``reset`` at an epoch's start (after ``on_train_epoch_start``)."""
        self.batch_progress.reset_on_run()
        self.scheduler_progress.reset_on_run()
        self.automatic_optimization.optim_progress.reset_on_run()
        self.val_loop.batch_progress.total.reset()

    def resume(self, batch_end: bool, after_validation: bool, num_batches, accumulate: int) -> int:
        """Lightning's ``reset`` of the epoch a checkpoint restarts, saved at the end of a batch
        (``batch_end``) or after a validation (``after_validation``); returns the batch index
        the epoch continues at. A checkpoint of an epoch's last batch starts the next epoch."""
        batches = self.batch_progress

        def stepped() -> bool:  # whether the batch the checkpoint was saved at stepped the optimizer
            ready = batches.current.ready
            return ready % accumulate == 0 or ready == num_batches or batches.is_last_batch

        if stepped() and (batch_end or not after_validation):
            self._batches_that_stepped += 1  # saved before the batch counted its step
        if batch_end:
            batches.increment_completed()
            if batches.current.completed >= num_batches:
                batches.reset_on_run()
                self.scheduler_progress.reset_on_run()
                self.automatic_optimization.optim_progress.reset_on_run()
                self.val_loop.batch_progress.total.reset()
        batches.reset_on_restart()
        self.scheduler_progress.reset_on_restart()
        self.automatic_optimization.optim_progress.reset_on_restart()
        warn_if_not_resumable(self.trainer, self.global_step)
        if after_validation and stepped():
            # Lightning passes over the validation it ran before saving, counting the batch's step
            self._batches_that_stepped += 1
        return batches.current.ready


class FitLoop(_RunnableLoop, _LightningFitLoop):
    """``trainer.fit_loop``: the epoch progress (``current.completed`` is ``current_epoch``),
    ``max_epochs``/``min_epochs`` (assigning ``max_epochs`` during a fit moves its end), the
    batch indices, ``restarting`` and ``done``."""

    def __init__(self, trainer, min_epochs: Optional[int] = None, max_epochs: Optional[int] = None) -> None:
        super().__init__(trainer)
        self.max_epochs = max_epochs
        self.min_epochs = min_epochs
        self.epoch_loop = TrainingEpochLoop(trainer)
        self.epoch_progress = _Progress()
        #: where a checkpoint just loaded resumes (see :meth:`restore`), until the first epoch starts
        self._resume: Optional[tuple] = None
        self._resumed_after_validation = False
        #: Lightning's record of where the fit's training data comes from (set as a fit starts):
        #: the batch size finder refuses loaders passed to fit(), whose batch size it cannot change
        self._data_source = _DataLoaderSource(None, "train_dataloader")
        #: whether the loop runs again inside a fit (the tuner's run: no sanity check)
        self._again = False

    def _progress(self) -> list:
        return [self.epoch_progress]

    @property
    def _skip_backward(self) -> bool:
        # Lightning's flag (StochasticWeightAveraging's BatchNorm epoch): batches without backward or update
        return self.epoch_loop.automatic_optimization._skip_backward

    @_skip_backward.setter
    def _skip_backward(self, value: bool) -> None:
        self.epoch_loop.automatic_optimization._skip_backward = value

    def _should_accumulate(self) -> bool:
        """Whether the current batch accumulates its gradients (see TrainingEpochLoop)."""
        return self.epoch_loop._should_accumulate()

    @property
    def max_batches(self):
        return self.trainer.num_training_batches

    @max_batches.setter
    def max_batches(self, value) -> None:
        self.trainer.num_training_batches = value

    @property
    def total_batch_idx(self) -> int:
        return self.epoch_loop.total_batch_idx

    @property
    def batch_idx(self) -> int:
        return self.epoch_loop.batch_idx

    @property
    def min_steps(self) -> Optional[int]:
        return self.epoch_loop.min_steps

    @property
    def max_steps(self) -> int:
        return self.epoch_loop.max_steps

    @_Loop.restarting.setter
    def restarting(self, restarting: bool) -> None:
        # Lightning's rule: a checkpoint saved at an epoch's end does not restart the epoch, and a
        # fit bounded by max_steps always counts as restarting
        current = self.epoch_progress.current
        unfinished = any(v != current.processed for v in (current.ready, current.started))
        _Loop.restarting.fset(self, restarting and unfinished or self.trainer.max_steps != -1)

    @property
    def _can_stop_early(self) -> bool:
        met_epochs = self.epoch_progress.current.processed >= self.min_epochs if self.min_epochs else True
        met_steps = self.epoch_loop.global_step >= self.min_steps if self.min_steps else True
        return met_epochs and met_steps

    @property
    def done(self) -> bool:
        """Whether the fit ends now: no training batches, ``max_steps`` or ``max_epochs`` reached,
        or ``should_stop`` with the minimums met."""
        if self.max_batches == 0:
            return True
        if self.max_steps != -1 and self.epoch_loop.global_step >= self.max_steps:
            return True
        if self.max_epochs is not None and self.max_epochs != -1 and (
            self.epoch_progress.current.processed >= self.max_epochs
        ):
            return True
        return bool(self.trainer.should_stop) and self._can_stop_early

    def on_save_checkpoint(self) -> dict:
        states = self.trainer._loader_states.state()  # resumable training loaders, as Lightning saves them
        return {"combined_loader": states} if states else {}

    def on_load_checkpoint(self, state_dict: dict) -> None:
        self.trainer._loader_states.keep_for_loading(state_dict.get("combined_loader", []))

    def restore(self, state: dict) -> None:
        """A checkpoint's ``fit_loop`` state, loaded as Lightning loads it (``restarting`` by
        Lightning's rule); :meth:`start_run` and :meth:`begin_epoch` resume where it was saved."""
        self.load_state_dict(state)
        self._resume = ()

    def start_run(self) -> None:
        """The counters as the fit loop starts (before ``on_train_start``): after a checkpoint was
        loaded, Lightning's adjustments for where it was saved (at the end of a batch, after a
        validation, at an epoch's start or end)."""
        if self._resume is not None:
            self._adjust_for_restart()
        if self.trainer.max_steps == -1:
            self.epoch_progress.current.completed = self.epoch_progress.current.processed

    def _adjust_for_restart(self) -> None:
        restarting = self.restarting
        epochs, batches = self.epoch_progress, self.epoch_loop.batch_progress
        e, b = epochs.total, batches.total
        mid_epoch = restarting and e.started == e.ready and e.processed == e.started - 1 and e.completed == e.processed
        epoch_start = (
            restarting and e.started == e.ready - 1 and e.processed == e.started and e.completed == e.processed
        )
        epoch_end = e.started == e.ready and e.processed == e.started and e.completed == e.processed - 1
        batch_end = restarting and b.started == b.ready and b.processed == b.started and b.completed == b.processed - 1
        after_validation = restarting and b.started == b.ready and b.processed == b.started and b.completed == b.processed
        if epoch_start:
            epochs.reset_on_restart()
        if epoch_end and not restarting:
            epochs.increment_completed()  # saved in on_train_epoch_end: that epoch is over
        if batch_end and batches.is_last_batch:
            if mid_epoch:
                epochs.increment_processed()
                epochs.increment_completed()
            elif not self.epoch_loop.val_loop.batch_progress.is_last_batch:
                epochs.increment_completed()
        skip_start = mid_epoch or (restarting and epoch_end)
        self._resume = (restarting, skip_start, epoch_start, batch_end, after_validation)

    def begin_epoch(self, start_hooks, num_batches, accumulate: int) -> int:
        """Lightning's start of an epoch: the counters around ``start_hooks()`` (the
        ``on_train_epoch_start`` hooks); returns the batch index the epoch starts at (a resumed
        epoch continues where its checkpoint was saved, without a new start)."""
        resume, self._resume = self._resume, None
        if resume is None:
            resume = (False, False, False, False, False)
        restarting, skip_start, epoch_start, batch_end, after_validation = resume
        #: a resumed epoch whose checkpoint was saved after its validation does not pass over it
        self._resumed_after_validation = after_validation
        if not skip_start:
            if not epoch_start:
                self.epoch_progress.increment_ready()
            start_hooks()
            self.epoch_progress.increment_started()
        if not restarting:
            self.epoch_loop.start_epoch()
            return 0
        return self.epoch_loop.resume(batch_end, after_validation, num_batches, accumulate)

    def set_restarting(self, value: bool) -> None:
        """Set ``restarting`` here and in the child loops as given (Lightning's setter adds its
        own rule, meant for a checkpoint just loaded)."""
        _Loop.restarting.fset(self, value)


class _Missing:
    """A member of Lightning's loop class that fasttrain's loop does not have: reading it raises
    AttributeError (``hasattr`` is False), as for any attribute the object lacks."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, instance, owner=None):
        raise AttributeError(f"{owner.__name__!r} object has no attribute {self._name!r} (fasttrain runs its own loops)")


def _lightning_kind(cls, lightning_cls):
    """``cls``, a subclass of Lightning's loop class ``lightning_cls`` so that Lightning's code
    that tells loops apart by class (its tuner) knows it, without Lightning's implementation:
    the members of ``lightning_cls`` that ``cls`` does not define read as missing."""
    own = set()
    for klass in cls.__mro__:
        if klass.__module__ == __name__:
            own.update(vars(klass))
    for name in vars(lightning_cls):
        if not (name.startswith("__") and name.endswith("__")) and name not in own:
            setattr(cls, name, _Missing(name))
    return cls


_lightning_kind(EvaluationLoop, _LightningEvaluationLoop)
_lightning_kind(PredictionLoop, _LightningPredictionLoop)
_lightning_kind(FitLoop, _LightningFitLoop)


def loops_state_dict(trainer) -> dict:
    """The checkpoint's ``loops`` entry, as Lightning writes it."""
    return {
        "fit_loop": trainer.fit_loop.state_dict(),
        "validate_loop": trainer.validate_loop.state_dict(),
        "test_loop": trainer.test_loop.state_dict(),
        "predict_loop": trainer.predict_loop.state_dict(),
    }


class LoopProperties:
    """The Trainer attributes that read the loop objects, as ``lightning.Trainer``'s read them
    (``max_epochs`` is ``fit_loop.max_epochs``, ``global_step`` the optimizer steps counted by
    ``fit_loop.epoch_loop``, ...)."""

    def _build_loops(self, inference_mode: bool = True) -> None:
        self.fit_loop = FitLoop(self)
        self.validate_loop = EvaluationLoop(
            self, TrainerFn.VALIDATING, RunningStage.VALIDATING, inference_mode=inference_mode
        )
        self.test_loop = EvaluationLoop(self, TrainerFn.TESTING, RunningStage.TESTING, inference_mode=inference_mode)
        self.predict_loop = PredictionLoop(self, inference_mode=inference_mode)

    @property
    def current_epoch(self) -> int:
        return self.fit_loop.epoch_progress.current.completed

    @property
    def global_step(self) -> int:
        return self.fit_loop.epoch_loop.global_step

    # Lightning's Trainer reads these from its loops (read-only there: assign fit_loop.max_epochs);
    # fasttrain's set-up assigns them through the setters
    @property
    def max_epochs(self) -> Optional[int]:
        return self.fit_loop.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: Optional[int]) -> None:
        self.fit_loop.max_epochs = value

    @property
    def min_epochs(self) -> Optional[int]:
        return self.fit_loop.min_epochs

    @min_epochs.setter
    def min_epochs(self, value: Optional[int]) -> None:
        self.fit_loop.min_epochs = value

    @property
    def max_steps(self) -> int:
        return self.fit_loop.epoch_loop.max_steps

    @max_steps.setter
    def max_steps(self, value: int) -> None:
        self.fit_loop.epoch_loop.max_steps = value

    @property
    def min_steps(self) -> Optional[int]:
        return self.fit_loop.epoch_loop.min_steps

    @min_steps.setter
    def min_steps(self, value: Optional[int]) -> None:
        self.fit_loop.epoch_loop.min_steps = value

    @property
    def is_last_batch(self) -> bool:
        return bool(self.fit_loop.epoch_loop.batch_progress.is_last_batch)

    @property
    def num_sanity_val_batches(self) -> list:
        """The batches the sanity check takes from each validation loader (known once the fit's
        validation loop has counted its loaders, as in Lightning)."""
        counted = self.fit_loop.epoch_loop.val_loop._max_batches
        return [min(self.num_sanity_val_steps, batches) for batches in counted]

    @property
    def _restarting(self) -> bool:
        return self.fit_loop.restarting

    @_restarting.setter
    def _restarting(self, value: bool) -> None:
        self.fit_loop.set_restarting(value)

    @property
    def _evaluation_loop(self) -> EvaluationLoop:
        fn = self.state.fn
        if fn == TrainerFn.FITTING:
            return self.fit_loop.epoch_loop.val_loop
        if fn == TrainerFn.VALIDATING:
            return self.validate_loop
        if fn == TrainerFn.TESTING:
            return self.test_loop
        raise RuntimeError("The `Trainer._evaluation_loop` property isn't defined. Accessed outside of scope")

    @property
    def _active_loop(self):
        if self.training:
            return self.fit_loop
        if self.sanity_checking or self.evaluating:
            return self._evaluation_loop
        if self.predicting:
            return self.predict_loop
        return None
