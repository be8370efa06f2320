"""Stopping a training run cleanly on SIGINT or SIGTERM.

While ``Trainer.train()`` runs (in the main thread, with ``handle_signals=True``), the first
SIGINT or SIGTERM only sets a host flag. The step loop reads that flag once per micro-step (a
Python attribute: no device synchronisation), finishes the current step and raises
:class:`TrainingInterrupted`; the trainer then saves the training state when a location is
configured, fires ``on_training_interrupted(trainer, signal_number)`` and
``on_stop_training_error``, and ``train()`` returns. A second signal does not wait: the previous
handlers are put back and the signal is handled as it would have been without fasttrain
(``KeyboardInterrupt`` for SIGINT, the default action, i.e. termination, for SIGTERM).

With several processes a signal may reach them at different steps, and a process that stopped
alone would leave the others waiting in a collective. There the flag is only *noted* by the
handler and the processes agree at the next training flush (every ``log_every_n_steps`` updates),
where one gather of the flag makes them all stop after the same step.

The handler does nothing but set attributes: printing from a signal handler can re-enter a
buffered stream that the interrupted code was writing to.

Data-loader workers started during ``train()`` ignore SIGINT and SIGTERM. A terminal's Ctrl-C and
schedulers such as SLURM signal every process of the job, and torch's workers die of SIGTERM,
after which torch raises in the main process before it could finish its step. The workers end as
usual when the main process shuts them down or exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Dict, Optional

import torch
from torch.utils.data import DataLoader

from fasttrain.callbacks import SaveTrainingStateCallback, StopTrainingError
from fasttrain import step_metrics
from fasttrain.resume import innermost_loader

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

__all__ = [
    "HANDLED_SIGNALS",
    "TrainingInterrupted",
    "InterruptFlag",
    "InterruptHandler",
    "handle_interrupts",
    "finish_interrupted_run",
    "share_stop_decisions",
]


def signal_name(signal_number: int) -> str:
    try:
        return signal.Signals(signal_number).name
    except ValueError:
        return f"signal {signal_number}"


class TrainingInterrupted(StopTrainingError):
    """Raised by the step loop after the current step when a stop signal was received."""

    def __init__(self, signal_number: int):
        super().__init__(f"Training interrupted by {signal_name(signal_number)}; stopped after the current step")
        self.signal_number = signal_number


class InterruptFlag:
    """What the step loop reads: ``stop_requested`` (a host bool) and the signal that set it.
    This base class never changes: it stands in when no handler is installed."""

    stop_requested: bool = False
    signal_number: Optional[int] = None
    #: whether signals are handled (the processes of a run share decisions only when needed)
    listening: bool = False

    def local_signal(self) -> int:
        """The signal this process received and has not acted on yet (0: none)."""
        return 0

    def adopt(self, signal_number: int) -> None:
        """A signal some process received, as agreed by :func:`share_stop_decisions`."""


class InterruptHandler(InterruptFlag):
    """Installs handlers for ``signals`` and records the first one received.

    :param agree_at_flush: do not stop on the local signal alone; wait until the processes
        agree (:func:`share_stop_decisions`, distributed runs).
    """

    listening = True

    def __init__(self, signals=HANDLED_SIGNALS, agree_at_flush: bool = False):
        self.signals = tuple(signals)
        self.agree_at_flush = agree_at_flush
        self.stop_requested = False
        self.signal_number = None
        # received here (a signal adopted from another process does not make the next local one
        # a second signal)
        self._received = False
        self._previous: Dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers; returns False (installing nothing) outside the main thread,
        where Python does not allow signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                # the process was started to ignore it (a shell starts background jobs ignoring
                # SIGINT, so that a Ctrl-C at the terminal does not reach them): it stays ignored
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)
        return True

    def restore(self) -> None:
        """Put back the handlers found at :meth:`install`, where ours are still in place (a
        handler someone installed since is left alone)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum, frame):
        if self._received:
            self._escalate(signum, frame)
            return
        self._received = True
        self.signal_number = self.signal_number or signum
        if not self.agree_at_flush:
            self.stop_requested = True

    def _escalate(self, signum, frame):
        previous = self._previous.get(signum, signal.SIG_DFL)
        self.restore()
        if callable(previous):
            previous(signum, frame)  # e.g. signal.default_int_handler raises KeyboardInterrupt
        elif previous == signal.SIG_IGN:
            return
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            # SIG_DFL, or a handler installed outside Python: let the operating system act
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def local_signal(self) -> int:
        return self.signal_number if self._received and not self.stop_requested else 0

    def adopt(self, signal_number: int) -> None:
        if signal_number and not self.stop_requested:
            self.signal_number = self.signal_number or signal_number
            self.stop_requested = True


def share_stop_decisions(accelerator, interrupt: InterruptFlag, nonfinite_code: int, totals=(0.0, 0)):
    """Share, between all processes, the signal any of them received and the most severe
    non-finite finding (an ordered code), so that all stop after the same step, and sum the
    epoch's loss ``totals`` (loss sum, sample count) over them. Called at flushes every process
    makes at the same step; returns the agreed non-finite code and the summed totals."""
    local = torch.tensor(
        [[float(interrupt.local_signal()), float(nonfinite_code), float(totals[0]), float(totals[1])]],
        dtype=torch.float64,
        device=accelerator.device,
    )
    # One gather of four numbers per training flush (every log_every_n_steps updates) and per
    # evaluation epoch, in distributed runs only: a process that stopped alone would leave the
    # others waiting in a collective, and the flushed loss is the mean over all processes.
    gathered = accelerator.gather(local)
    signum, agreed_code = gathered[:, :2].amax(dim=0)
    loss_sum, count = gathered[:, 2:].sum(dim=0)
    # SYNC(flush): the gathered numbers, read in one copy
    signum, agreed_code, loss_sum, count = torch.stack([signum, agreed_code, loss_sum, count]).tolist()
    interrupt.adopt(int(signum))
    return int(agreed_code), (loss_sum, int(count))


class _ShieldWorker:
    """``worker_init_fn`` wrapper: the worker ignores the stop signals (set after torch's own
    worker signal setup, which runs first), then runs the original function. A class, not a
    closure, so that it pickles for the spawn and forkserver start methods."""

    def __init__(self, worker_init_fn, signals):
        self.worker_init_fn = worker_init_fn
        self.signals = signals

    def __call__(self, worker_id):
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


def _loaders_with_workers(trainer):
    for loader in (trainer._train_dataloader, trainer._eval_dataloader):
        loader = innermost_loader(loader)
        # accelerate's loaders iterate an inner torch DataLoader, whose attribute counts
        loader = getattr(loader, "base_dataloader", loader)
        if isinstance(loader, DataLoader) and loader.num_workers > 0:
            yield loader


@contextlib.contextmanager
def _shield_workers(trainer, signals):
    shielded = []
    for loader in _loaders_with_workers(trainer):
        shielded.append((loader, loader.worker_init_fn))
        loader.worker_init_fn = _ShieldWorker(loader.worker_init_fn, signals)
    try:
        yield
    finally:
        for loader, original in shielded:
            loader.worker_init_fn = original


@contextlib.contextmanager
def handle_interrupts(trainer):
    """Install an :class:`InterruptHandler` as ``trainer._interrupt`` for the duration of the
    block (when ``trainer.handle_signals`` and in the main thread), then restore the previous
    handlers."""
    handler = None
    if getattr(trainer, "handle_signals", True):
        config = trainer.run_config
        handler = InterruptHandler(agree_at_flush=bool(config is not None and config.is_distributed))
        if not handler.install():
            handler = None
    trainer._interrupt = handler if handler is not None else InterruptFlag()
    shield = _shield_workers(trainer, handler.signals) if handler is not None else contextlib.nullcontext()
    unhandled = 0
    try:
        with shield:
            yield trainer._interrupt
        if handler is not None and handler._received and trainer.stop_reason != "interrupted":
            # the signal came after the last point where training checks for one (in the
            # epoch-end or run-end callbacks): the run finished, and the signal still gets to
            # the handler that was in place before train()
            unhandled = handler.signal_number
    finally:
        if handler is not None:
            handler.restore()
        trainer._interrupt = InterruptFlag()
    if unhandled:
        signal.raise_signal(unhandled)


# ------------------------------------------------------------------------------- after the stop
def interrupt_save_dir(trainer) -> Optional[str]:
    """Where a stopped run saves its state: ``Trainer(interrupt_save_dir=...)``, else
    ``<save_dir>/interrupted`` of a ``SaveTrainingStateCallback``, else nowhere."""
    if trainer.interrupt_save_dir is not None:
        return os.fspath(trainer.interrupt_save_dir)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, SaveTrainingStateCallback):
            return os.path.join(callback.save_dir, "interrupted")
    return None


def finish_interrupted_run(trainer, signal_number: int) -> None:
    """Deliver the last step metrics, save the training state where configured, record the
    stop and fire ``on_training_interrupted``."""
    if trainer._train_buffer is not None:
        try:
            step_metrics.flush(trainer, trainer._train_buffer, is_epoch_end=False)
        except StopTrainingError as nonfinite:  # recorded by the flush; the save is refused
            trainer._accelerator.print(nonfinite)
    where = interrupt_save_dir(trainer)
    name = signal_name(signal_number)
    if where is None:
        trainer.print(
            f"{name}: training stopped; no training state saved (set Trainer(interrupt_save_dir=...) "
            "or add a SaveTrainingStateCallback to save one)."
        )
    elif trainer.save_training_state(where):
        trainer.print(
            f"{name}: training stopped after update {trainer.progress.num_updates}; the training state is "
            f"saved in {where}. Continue with train(..., resume_from={where!r})."
        )
    # the signal ended the run; a non-finite value that flush found is in its stopped_ metric
    trainer.stop_reason = "interrupted"
    trainer.run_history.update_metric("stopped_interrupted", trainer.progress.num_updates)
    trainer.callback_handler.call_event("on_training_interrupted", trainer, signal_number=signal_number)
