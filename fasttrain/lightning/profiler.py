"""``Trainer(profiler=...)``: Lightning's profilers (``"simple"``, ``"advanced"``, ``"pytorch"``,
``"xla"``, or a ``Profiler`` object, a subclass of your own included) time what Lightning times,
under Lightning's action names:

- every module hook as ``[LightningModule]<Class>.<hook>`` and every callback hook as
  ``[Callback]<state_key>.<hook>`` (called for every callback and every hook, overridden or not,
  as Lightning calls them while profiling), the DataModule's set-up hooks as
  ``[LightningDataModule]<Class>.<hook>``;
- the steps and backward as ``[Strategy]<Class>.training_step`` (``validation_step``,
  ``test_step``, ``backward``), and the strategy hooks Lightning calls after the module's
  (``on_train_start``, ``on_validation_end``, ...);
- ``run_training_epoch``, ``run_training_batch``, the data fetches
  (``[_TrainingEpochLoop].train_dataloader_next``, ``[_EvaluationLoop].val_next``/``test_next``,
  ``[_PredictionLoop].predict_next``) and ``save_checkpoint``.

The profiler is set up at the start of each run (``setup(stage, local_rank, log_dir)``) and
``describe()`` writes its summary when the run ends, as in Lightning. Timing each hook needs
them called one by one from Python, so a profiled fit runs on the eager engine (one warning
when another engine was asked for). Without a profiler nothing here runs.
"""

from __future__ import annotations

import functools
from weakref import proxy

from lightning.pytorch.profilers import (
    AdvancedProfiler,
    PassThroughProfiler,
    Profiler,
    PyTorchProfiler,
    SimpleProfiler,
    XLAProfiler,
)

from fasttrain.lightning.errors import LightningConfigError
from fasttrain.lightning.hooks import HookCaller, module_overrides

_BY_NAME = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler, "xla": XLAProfiler}
# hooks after which Lightning calls the strategy's hook of the same name (profiled too)
_STRATEGY_HOOKS = frozenset({
    "on_train_start", "on_train_end", "on_validation_start", "on_validation_end", "on_test_start", "on_test_end",
    "on_predict_start", "on_predict_end", "on_train_batch_start",
})

# module hooks Lightning calls without timing them (the strategy's backward times the module's),
# and those it calls (timed) only when overridden
_UNTIMED = frozenset({"backward"})
_IF_OVERRIDDEN = frozenset({"configure_model"})


def build_profiler(profiler) -> Profiler:
    """Lightning's reading of ``profiler=``: a name (its error for an unknown one), an object, or
    None (``PassThroughProfiler``, which records nothing)."""
    if isinstance(profiler, str):
        name = profiler.lower()
        if name not in _BY_NAME:
            raise LightningConfigError(
                "When passing string value for the `profiler` parameter of `Trainer`,"
                f" it can only be one of {list(_BY_NAME)}"
            )
        profiler = _BY_NAME[name]()
    return profiler or PassThroughProfiler()


def profiling(lt) -> bool:
    return not isinstance(lt.profiler, PassThroughProfiler)


def start_run(lt) -> None:
    """Lightning's profiler set-up at the start of each run."""
    profiler = lt.profiler
    profiler._lightning_module = proxy(lt.lightning_module)
    profiler.setup(stage=lt.state.fn, local_rank=lt.local_rank if lt.world_size > 1 else None, log_dir=lt.log_dir)


def strategy_action(lt, name: str) -> str:
    return f"[Strategy]{type(lt.strategy).__name__}.{name}"


def profile_batch_hooks(lt, names) -> None:
    """While profiling, every batch-transfer hook (``names``) runs, and is timed, as in
    Lightning; the move to the device is timed as the strategy's ``batch_to_device``."""
    hooks = lt._batch_hooks
    for name in names:
        if hooks[name] is None:
            hooks[name] = functools.partial(lt._hooks.module_hook, name)
    name = "transfer_batch_to_device"
    hooks[name] = timed(lt.profiler, strategy_action(lt, "batch_to_device"), hooks[name])


def timed(profiler: Profiler, action: str, fn):
    """``fn`` timed as ``action`` at each call."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with profiler.profile(action):
            return fn(*args, **kwargs)

    return call


def timed_iterator(profiler: Profiler, action: str, iterator):
    """``iterator``'s items, each fetch timed as ``action`` (the last, ending one included)."""
    iterator = iter(iterator)
    while True:
        with profiler.profile(action):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


class ProfiledHookCaller(HookCaller):
    """A :class:`HookCaller` that times every hook under Lightning's names, and, as Lightning does
    while profiling, calls every hook of every callback and of the module, overridden or not."""

    def __init__(self, trainer, module, callbacks):
        self.profiler = trainer.profiler  # before HookCaller decides its hooks, timed here
        super().__init__(trainer, module, callbacks)

    def callback_methods(self, name: str) -> list:
        methods = self._callback_methods.get(name)
        if methods is None:
            methods = [
                (cb, timed(self.profiler, f"[Callback]{cb.state_key}.{name}", getattr(cb, name)))
                for cb in self.callbacks if callable(getattr(cb, name, None))
            ]
            self._callback_methods[name] = methods
        return methods

    def module_hook(self, name: str, *args, **kwargs):
        if name in _UNTIMED or (name in _IF_OVERRIDDEN and not module_overrides(self.module, name)):
            return super().module_hook(name, *args, **kwargs)
        with self.profiler.profile(f"[LightningModule]{type(self.module).__name__}.{name}"):
            return super().module_hook(name, *args, **kwargs)

    def __call__(self, name: str, *args, **kwargs):
        if self.callback_methods(name):
            self.callbacks_only(name, *args, **kwargs)
        result = self.module_hook(name, *args, **kwargs)
        if name in _STRATEGY_HOOKS:
            with self.profiler.profile(strategy_action(self.trainer, name)):
                pass  # fasttrain's strategy has nothing to do here; the action is listed as in Lightning
        return result

    def overridden(self, name: str) -> bool:
        return True  # every hook runs (and is timed), as Lightning calls them all


def datamodule_hook(lt, name: str, *args, **kwargs):
    """The DataModule's hook ``name`` called as Lightning calls it: timed by a profiler as
    ``[LightningDataModule]<class>.<name>``; a hook that is not callable (set to None) is not
    called and gives None."""
    dm = lt.datamodule
    fn = getattr(dm, name)
    if not callable(fn):
        return None
    if profiling(lt):
        with lt.profiler.profile(f"[LightningDataModule]{type(dm).__name__}.{name}"):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)
