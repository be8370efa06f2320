"""How a Lightning run ends, as Lightning ends it: the teardown hooks after a run that did not
raise; after one that did, the callbacks' and the DataModule's ``on_exception`` instead, and a
KeyboardInterrupt turned into a clean ``sys.exit(1)``."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable

from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from fasttrain.lightning.combined import flat
from fasttrain.lightning.hooks import callback_overrides
from fasttrain.lightning.profiler import datamodule_hook


def end_run(lt) -> None:
    """What Lightning's teardown does at the end of every run, whether it raised or not: the
    strategy's teardown, and the worker processes that the run's loaders keep between epochs
    (``persistent_workers=True``) ended; a later run over a loader starts new ones."""
    lt.strategy.teardown()
    train = [lt._train_loader] if lt._train_loader is not None else []
    for loader in flat(train + lt._val_loaders + lt._test_loaders + lt._predict_loaders):
        iterator = getattr(loader, "_iterator", None)
        if isinstance(iterator, _MultiProcessingDataLoaderIter):
            iterator._shutdown_workers()
        if iterator is not None:
            loader._iterator = None


def teardown(lt, stage: str) -> None:
    """The end of a run that did not raise: the teardown hooks (DataModule, callbacks, module),
    the loggers finalized."""
    dm = lt.datamodule
    if dm is not None:
        datamodule_hook(lt, "teardown", stage=stage)
    lt._hooks("teardown", stage=stage)
    lt.lightning_module._current_fx_name = None
    lt.lightning_module._metric_attributes = None
    for logger in lt.loggers:
        logger.finalize("success")
    lt.profiler.describe()  # the profile's summary, as Lightning ends a run
    lt.state.status = TrainerStatus.FINISHED
    lt.state.stage = None


def interrupt(lt, error: BaseException) -> None:
    """Lightning's reaction to an error in a run: the callbacks' ``on_exception`` hooks, then the
    DataModule's (a LightningModule has none), the loggers finalized as failed. The teardown
    hooks do not run."""
    lt.state.status = TrainerStatus.INTERRUPTED
    module = lt.lightning_module
    previous = module._current_fx_name if module is not None else None
    # the trainer's callbacks as they are now (a failure may come before a run resolved its hooks)
    for callback in lt.callbacks:
        if callback_overrides(callback, "on_exception"):
            if module is not None:
                module._current_fx_name = "on_exception"
            callback.on_exception(lt, module, error)
    if module is not None:
        module._current_fx_name = previous
    dm = lt.datamodule
    if dm is not None and callable(dm.on_exception):
        dm.on_exception(error)
    # Lightning's DDPStrategy adds what to do to DDP's error about parameters without gradients
    lt.strategy.on_exception(error)
    for logger in lt.loggers:
        logger.finalize("failed")


def handle_errors(lt, run: Callable[[], Any]):
    """``run()``'s result, with Lightning's handling of an error escaping it: ``on_exception``
    hooks (:func:`interrupt`) and the error re-raised; a KeyboardInterrupt ends the process
    with ``sys.exit(1)`` after Lightning's message, SIGINT ignored from then on so that a
    second Ctrl-C cannot cut the shutdown short."""
    try:
        return run()
    except _TunerExitException:
        # Lightning's tuner ends the run after finding its value (Tuner.lr_find, scale_batch_size):
        # a finished run, torn down as one (no on_fit_end, no on_exception)
        teardown(lt, lt.state.fn)
        end_run(lt)
        return None
    except KeyboardInterrupt as error:
        rank_zero_info("\nDetected KeyboardInterrupt, attempting graceful shutdown ...")
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        interrupt(lt, error)
        end_run(lt)
        # Lightning kills the processes its own launcher started; fasttrain starts none (torchrun
        # or accelerate launch ends its workers when one exits)
        sys.exit(1)
    except BaseException as error:
        interrupt(lt, error)
        end_run(lt)
        lt.state.stage = None  # after the strategy's teardown, as Lightning resets it
        raise
